"""Stage 3, plan: a ``TracedCall``, its ``StreamInfo`` and one route in, a ``RoutePlan`` out.

What a value is to a route is decided by use, in one classifier (:mod:`.uses`, with
:mod:`.inner_uses` and :mod:`.region_uses` for code inside a block's call and between the routed
blocks); :mod:`.route_plan` turns those verdicts into what enters, leaves and crosses the route.
Its consumers: :mod:`.count_slots` and :mod:`.token_counts` (token counts told as numbers),
:mod:`.inline_tables` (token tables cut inside a block) and :mod:`.forms` (routes that cross a
change of the stream's form).
"""
