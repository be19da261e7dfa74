"""Issue 58's research population: public repositories' backbones, built as their authors
wrote them from ``fetch`` snapshots and judged like the coverage sweep's other populations.

``population.json`` is the list (committed before any case ran); ``population.py`` turns an
entry and its snapshot into a :class:`~benchmarks.coverage_checks.Case`; the ``cases_*.py``
modules hold one builder per repository (tiny config, inputs, the CUDA-kernel edits);
``kernels.py`` holds the plain-PyTorch stand-ins those edits use. Run it with
``python -m benchmarks.coverage research --mirrors DIR --snapshots DIR``.
"""
