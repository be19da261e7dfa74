"""Stage 3, plan: a ``TracedCall``, its ``StreamInfo`` and one route in, a ``RoutePlan`` out.

What a value is to a route is decided by use, in one classifier (:mod:`.uses`), applied to the
route's region by :mod:`.region_uses` (the blocks, the other module calls inside them and the
code between them); :mod:`.route_plan` turns those verdicts into what enters, leaves and
crosses the route. Its consumers: :mod:`.token_counts` (token counts told as numbers),
:mod:`.inline_tables` (token tables cut inside a block) and :mod:`.forms` (routes that cross a
change of the stream's form).
"""
