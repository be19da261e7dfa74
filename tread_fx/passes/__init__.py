"""The compiler passes, one sub-package per stage, each reading only the stages before it.

``trace`` -> ``locate`` -> ``plan`` -> ``rewrite`` (run in that order by
:func:`tread_fx.pipeline.build`); what one stage hands the next is one data structure:

- :mod:`~tread_fx.passes.trace` takes the model and one call's inputs, gives a
  :class:`~tread_fx.passes.trace.tracer.TracedCall` (the graph, with every node's shape).
- :mod:`~tread_fx.passes.locate` takes the TracedCall, gives a
  :class:`~tread_fx.passes.locate.stream.StreamInfo` (the block stack and the token stream's
  layout).
- :mod:`~tread_fx.passes.plan` takes both and a route, gives a
  :class:`~tread_fx.passes.plan.route_plan.RoutePlan` (what enters, leaves and crosses it).
- :mod:`~tread_fx.passes.rewrite` takes the RoutePlans and changes the graph in place: gathers
  at each route's start, scatters or blends at its end, the kept ids as extra outputs.
"""
