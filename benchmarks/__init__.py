"""Performance measurements of tread_fx (never timed tests).

Entry point: ``python -m benchmarks.step_time`` (see ``--help`` and ``docs/performance.md``).

Modules:
    handwritten: a hand-written TREAD forward for the reference models, for comparison only.
    specs: the benchmarked model configurations and their routes.
    measure: step timing (interleaved), FLOP counting, activation memory, first-call overhead.
    report: the JSON file, the markdown table and the targets.
    step_time: the command line.
    instructions: instructions per training step under valgrind's callgrind.
    callgrind: callgrind's client requests from Python and its dump files.
    block_time: forward + backward time of one block of each backbone.
    official: our DiT + route() beside the authors' hand-edited DiT (their files from a path).
"""

__all__: list[str] = []
