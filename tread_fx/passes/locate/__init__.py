"""Stage 2, locate: a ``TracedCall`` in, a ``StreamInfo`` out (the blocks and the token stream).

:mod:`.stacks` finds the candidate block stacks and chooses one, :mod:`.stream` the calls of
the chosen one and the slots the token stream takes through them, :mod:`.dims` the stream's
batch and token dims (packed and token-major streams too) and its never-routed prefix and
suffix. :mod:`.choice` chooses which stream to route when several are carried (asking
:mod:`.positions` which positions reach the output, and whether data decides them) and
reports a stack that holds few of the blocks. :mod:`.layout` finds the stream's layout across
chained lists and where it enters a member that is a list of sub-blocks (for the plan stage);
:mod:`.dataflow` holds the graph walks and call slots they share.
"""
