#!/usr/bin/env bash
# The paper's throughput setting on one CUDA GPU: DiT-XL/2, 256 tokens, batch 64, bf16 autocast,
# unrouted vs tread_fx.route() vs hand-written, eager and torch.compile'd, plus the first routed
# call. Expected to finish in about 4-6 minutes on an H100/H200 (most of it is compilation).
# Writes docs/results/gpu_step_time.{json,md} and prints the table. Extra arguments are passed
# on, e.g. `benchmarks/gpu.sh --repeats 20` or `benchmarks/gpu.sh --modes eager`.
# Then a runtime-guard change on the GPU (benchmarks/guard_change.py, seconds): the guard fails
# on device data, the routed model traces again and keeps training (no device-side assert).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! "$PY" -c "import tread_fx.passes" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e .
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
"$PY" -m benchmarks.step_time --preset gpu "$@"
exec "$PY" -m benchmarks.guard_change --device cuda
