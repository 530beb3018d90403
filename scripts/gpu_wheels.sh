#!/usr/bin/env bash
# Download, into ./.whl (ignored), the wheels the GPU checks need and the lent GPU machine lacks
# (it has torch, transformers 5.17, torchvision, pillow, numpy, httpx, pytest, hypothesis,
# scikit-image; Python 3.12; no internet). Versions are the ones installed in ./.venv, so both sides
# agree (transformers too: 5.19's Qwen-VL forwards take mm_encoder_outputs, the dedup path).
# Then one device `run` with carry [".whl", ".cache/tiny_models"]: `bash scripts/gpu_check.sh`.
# flash-linear-attention's kernels (`fla-core`, pure Python + Triton, which CUDA torch ships; its one
# other dependency is einops) are downloaded here but never installed in ./.venv: with `fla`
# importable, transformers routes the CPU Qwen3.5 forward to Triton kernels that cannot run on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(transformers msgspec pydantic pydantic_core pydantic-settings annotated-types typing-inspection python-dotenv typing_extensions einops prometheus_client)
PINNED=(fla-core==0.6.0)
mkdir -p .whl
download() {
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$1"
}
for p in "${PKGS[@]}"; do
  download "$p==$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")"
done
for p in "${PINNED[@]}"; do download "$p"; done
ls -la .whl
