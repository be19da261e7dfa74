"""Stage 4, rewrite: ``RoutePlan``s in, the graph rewritten in place (:mod:`.insert`)."""
