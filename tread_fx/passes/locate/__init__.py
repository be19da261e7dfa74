"""Stage 2, locate: a ``TracedCall`` in, a ``StreamInfo`` out (the blocks and the token stream).

:mod:`.stacks` finds the candidate block stacks, :mod:`.stream` the calls of the chosen one and
the layout of the tensor flowing through it, :mod:`.choice` which stream to route when several
are carried. The layout's details each have a module: :mod:`.layout` (the ``StreamLayout`` and
grids), :mod:`.joint` (a never-routed prefix and suffix), :mod:`.packed` (packed sequences),
:mod:`.token_major` (``(N, B, C)`` streams), :mod:`.role_masks`, :mod:`.member_entry`,
:mod:`.stream_lists`, :mod:`.positions` and :mod:`.thin_routes`; :mod:`.dataflow` holds the
graph walks they share.
"""
