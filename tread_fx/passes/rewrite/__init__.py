"""Stage 4, rewrite: ``RoutePlan``s in, the graph rewritten in place.

:mod:`.insert` puts a select and gathers before each route, a scatter or blend after it, and the
kept ids of every route as extra graph outputs.
"""
