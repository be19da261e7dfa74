#!/usr/bin/env bash
# Set up a fresh machine for tread_fx: a virtual environment in .venv with everything the
# examples and the tests use. Idempotent; safe to re-run.
#   bash scripts/setup.sh                # Python packages only
#   bash scripts/setup.sh --system       # also Debian packages the tests use (graphviz, chromium)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--system" ]]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq graphviz chromium >/dev/null
  else
    echo "setup.sh: apt-get not found; install graphviz and chromium yourself" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch and torchvision that load together (timm imports torchvision). On these CPU machines
# pip takes the local 2.14.1/0.29.1 builds; elsewhere any torch >= 2.4 with its matching
# torchvision works: install those first and this line is a no-op.
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install -q -e ".[test]"
echo "setup.sh: ready (.venv)"
