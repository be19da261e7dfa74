"""Stage 1, trace: the model and one call's inputs in, a ``TracedCall`` out.

:mod:`.tracer` records the forward on real values (every node keeps its shape) with the
:mod:`.value_tracer` (proxies that carry their eager value), following the Python the model is
written in with the help of :mod:`.support` (data guards, hooks, Python random, torch wrappers
that must run their original), :mod:`.mutation` (item assignment, in-place writes, library
functions that become leaves) and :mod:`.thread_patch` (patches seen by the tracing thread
only). :mod:`.block` traces one block class through on its own inputs for the later stages;
:mod:`.concats` finds a concatenation inside a leaf on its values.
"""
