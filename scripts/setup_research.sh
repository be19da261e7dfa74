#!/usr/bin/env bash
# Packages the research population's model files import (issue 58), on top of
# scripts/setup.sh's .venv. Not needed by the tests or CI: only by
#   python -m benchmarks.coverage research --mirrors DIR --snapshots DIR
# Several are installed without their dependencies where those would replace the installed
# torch, numpy or omegaconf, or need a CUDA or fairseq build; none changes torch, torchvision,
# transformers, diffusers or timm. Left out on purpose: mlx-data (its empty `mlx` namespace
# makes transformers import mlx.core and fail), mmcv (its sdist needs a local wheel build),
# packages pinning transformers 4.x (OmniGen, DiffRhythm, Amphion stay not buildable).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" omegaconf easydict mup scikit-image jsonmerge clean-fid clip-anytorch torchdiffeq \
  torchsde onnx torchinfo simple_parsing boto3 "dataclass-wizard<1.0" jaxtyping einops_exts \
  rotary_embedding_torch torchaudio librosa beartype munch conformer hl-gauss-pytorch vocos \
  encodec g2p-en nltk torchode torchtyping gateloop-transformer rjieba pypinyin datasets wandb \
  progressbar pyworld vector-quantize-pytorch local-attention x-clip pytorch-warmup \
  sentencepiece num2words indic-num2words opencv-python-headless tensorboard tensorboardX \
  bitsandbytes peft addict yapf "antlr4-python3-runtime==4.9.3" "setuptools<81" PyWavelets \
  fvcore yacs termcolor
"${PIP[@]}" --no-deps dctorch smplx hydra-core colossalai galore-torch mmengine audiolm-pytorch \
  naturalspeech2-pytorch spear-tts-pytorch flash-linear-attention==0.1
# mamba_ssm's Python code only (its reference scan), no CUDA build
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "${PIP[@]}" --no-deps --no-build-isolation \
  "mamba-ssm==2.3.2.post1"
echo "setup_research.sh: done"
