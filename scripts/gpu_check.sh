#!/usr/bin/env bash
# The GPU halves of issues 8, 13 and 15, in one command on the lent GPU machine (docs/PACKING.md, "GPU
# measurements"): packed varlen vs one sample at a time (bf16; Qwen2-VL/2.5-VL/3-VL must be
# bit-identical), the same for tiny Qwen3.5 / Qwen3.5-MoE with flash-linear-attention's varlen kernels
# (and their leak control), bench/packed_forward.py (Qwen2-VL-2B shapes, fwd+bwd tokens/s, peak
# memory at caps 16k/8k), then bench/cost_model.py (seconds per micro-batch against the FLOP cost
# model), then the vLLM 0.33 serve smoke (scripts/gpu_smoke_vllm033.sh: the CUDA wheel, the plugin, a
# ref request equal to its data URL; it prints SKIP with the reason where its wheel folder, the
# 0.33 wheel or a dependency is missing). Logs go to $OUT (or /tmp).
# Prepare here first: `bash scripts/gpu_wheels.sh` and `make_tiny_models.py --family all`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/mmref-gpu}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  "$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" || true
} 2>&1 | tee "$LOGS/machine.txt"
"$PY" -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/test_forward.py tests/test_forward_qwen35.py 2>&1 | tee "$LOGS/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
"$PY" bench/packed_forward.py "$@" 2>&1 | tee "$LOGS/packed_forward.md"
bench_rc=${PIPESTATUS[0]}
"$PY" bench/cost_model.py 2>&1 | tee "$LOGS/cost_model.md"
cost_rc=${PIPESTATUS[0]}
# its own venv and logs (outside $OUT, which takes 8 files); only its report comes back
env -u PYTHONPATH OUT=/tmp/mmref-vllm033 PYTHON="$PY" bash scripts/gpu_smoke_vllm033.sh 2>&1 | tee "$LOGS/vllm033_smoke.txt"
smoke_rc=${PIPESTATUS[0]}
if [ "$smoke_rc" -eq 1 ] && [ -f /tmp/mmref-vllm033/server.log ]; then
  tail -40 /tmp/mmref-vllm033/server.log >>"$LOGS/vllm033_smoke.txt"
fi
case $smoke_rc in 0) smoke=pass ;; 3) smoke=skip ;; *) smoke="fail rc=$smoke_rc" ;; esac
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc, cost model rc=$cost_rc, vllm 0.33 smoke: $smoke"
[ "$smoke_rc" -eq 3 ] && smoke_rc=0  # a skip says why on its own line; it fails nothing
exit $((tests_rc || bench_rc || cost_rc || smoke_rc))
