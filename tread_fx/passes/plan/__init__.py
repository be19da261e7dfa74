"""Stage 3, plan: a ``TracedCall``, its ``StreamInfo`` and one route in, a ``RoutePlan`` out.

What a value is to a route is decided by use, in one classifier (:mod:`.uses`, tensors and
ints), applied to the route's region by :mod:`.region_uses` (the blocks, the other module calls
inside them, the code between them, and token counts told as numbers); :mod:`.route_plan`
turns those verdicts into what enters, leaves and crosses the route. Its consumers:
:mod:`.inline_tables` (token tables cut inside a block) and :mod:`.forms` (routes that cross a
change of the stream's form).
"""
