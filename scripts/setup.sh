#!/usr/bin/env bash
# Set up a fresh machine for tread_fx: a virtual environment in .venv with everything the
# examples and the tests use. Idempotent; safe to re-run (a second run only checks).
#   bash scripts/setup.sh                # Python packages only
#   bash scripts/setup.sh --system       # also Debian packages the tests use (graphviz, chromium)
# Prints one line per stage; pip shows its own progress for the large downloads (torch).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
stage() { echo "setup.sh: [$((SECONDS - START)) s] $*"; }

if [[ "${1:-}" == "--system" ]]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    stage "Debian packages: graphviz, chromium (apt-get; quiet)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq graphviz chromium >/dev/null
  else
    echo "setup.sh: apt-get not found; install graphviz and chromium yourself" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
if [[ -x .venv/bin/python ]]; then
  stage "virtual environment: .venv exists, reusing it"
else
  stage "virtual environment: creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check)
stage "pip: upgrading pip"
"${PIP[@]}" -q --upgrade pip
# torch and torchvision that load together (timm imports torchvision). On these CPU machines
# pip takes the local 2.14.1/0.29.1 builds; elsewhere any torch >= 2.4 with its matching
# torchvision works: install those into .venv first and this stage is skipped.
TORCH_OK="import torch, torchvision; assert tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 4)"
if .venv/bin/python -c "$TORCH_OK" 2>/dev/null; then
  stage "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') + torchvision: already installed"
else
  stage "torch 2.14.1 + torchvision 0.29.1: the large download, pip's progress follows"
  "${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1"
fi
EXTRAS="import tread_fx, timm, diffusers, transformers, accelerate, pytest, xdist, hypothesis, mambapy, einops, sklearn, mlxtend, torchmetrics, safetensors, tqdm, matplotlib, PIL"
# the community extra: model libraries of the coverage sweep's community population
EXTRAS="$EXTRAS, vit_pytorch, x_transformers, mmdit, perceiver_pytorch, denoising_diffusion_pytorch, open_clip, monai"
if .venv/bin/python -c "$EXTRAS" 2>/dev/null; then
  stage "tread_fx and its test/training/community extras: installed, checking quietly"
  "${PIP[@]}" -q -e ".[test,community]"
else
  stage "tread_fx (editable) + test/training/community extras (diffusers, transformers, timm, ...): pip follows"
  "${PIP[@]}" -e ".[test,community]"
fi
stage "checking that torch, timm and tread_fx import"
.venv/bin/python -c "import torch, timm, tread_fx; tread_fx.route" >/dev/null
stage "ready: .venv (call .venv/bin/python, or source .venv/bin/activate first)"
