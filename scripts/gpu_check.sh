#!/usr/bin/env bash
# The GPU halves of issues 8, 13, 15, 29 and 43, in one command on the lent GPU machine
# (docs/PACKING.md, "GPU measurements"), most wanted first, each step bounded (`timeout`, seconds in
# the step's line) so that one slow step cannot cost the others their report: packed varlen vs one
# sample at a time (bf16; Qwen2-VL/2.5-VL/3-VL must be bit-identical; with video segments too), the same for tiny Qwen3.5 /
# Qwen3.5-MoE with flash-linear-attention's varlen kernels (and their leak control), the chunked LM
# head in bf16 at Qwen2-VL-2B's head shapes; bench/packed_forward.py (Qwen2-VL-2B shapes: packed at
# caps 32k and 16k and one sample per forward with the chunked LM head and activation checkpointing,
# then without checkpointing and with the pre-issue-43 head; fwd+bwd tokens/s, speed-up, MFU, peak
# memory; the LM head alone at 32k tokens; each row printed as it finishes); bench/rank_balance.py
# (one dp-8 step of the token- and compute-balanced plans timed micro-batch by micro-batch);
# bench/train_step.py (dedup vs per slot, tiny families); bench/cost_model.py (seconds per
# micro-batch against the FLOP cost model); bench/train_step.py at the real-size image limits; then the vLLM 0.33 serve smoke
# (scripts/gpu_smoke_vllm033.sh: the CUDA wheel, the plugin, a ref request equal to its data URL; it
# prints SKIP with the reason where its wheel folder, the 0.33 wheel or a dependency is missing).
# Logs go to $OUT (or /tmp), one file per step (a device run brings back 8 files at most).
# Prepare here first: `bash scripts/gpu_wheels.sh` and `make_tiny_models.py --family all`.
# `--tiny` (passed on to the benches) runs the same chain on CPU: the GPU tests skip.
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
step() {  # step SECONDS LOG CMD...: run CMD under `timeout`, output to $LOGS/LOG; its rc into $rc
  local secs=$1 log=$2 start=$SECONDS
  shift 2
  timeout -k 5 "$secs" "$@" 2>&1 | tee "$LOGS/$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "TIMEOUT after ${secs} s: $*" | tee -a "$LOGS/$log"
  echo "[gpu_check] $log: rc=$rc in $((SECONDS - start)) s (bound ${secs} s)" | tee -a "$LOGS/$log"
  return 0
}
tiny=0
for a in "$@"; do [ "$a" = --tiny ] && tiny=1; done
if [ "$tiny" -eq 1 ]; then ts_args=(--device cpu --repeat 1 --families qwen2_vl); else ts_args=(--device cuda); fi
step 120 gpu_tests.log "$PY" -m pytest -m gpu -p no:cacheprovider -q -s -rA tests/test_forward.py tests/test_forward_qwen35.py tests/test_logprob_head.py tests/test_video_forward.py
tests_rc=$rc
step 240 packed_forward.md "$PY" bench/packed_forward.py "$@"
bench_rc=$rc
step 200 rank_balance.md "$PY" bench/rank_balance.py --plans tokens,compute "$@"
balance_rc=$rc
step 60 train_step.md "$PY" bench/train_step.py "${ts_args[@]}"
train_rc=$rc
step 80 cost_model.md "$PY" bench/cost_model.py "$@"
cost_rc=$rc
step 40 train_step_real.md "$PY" bench/train_step.py "${ts_args[@]}" --real-size
real_rc=$rc
# its own venv and logs (outside $OUT, which takes 8 files); only its report comes back
env -u PYTHONPATH OUT=/tmp/mmref-vllm033 PYTHON="$PY" bash scripts/gpu_smoke_vllm033.sh 2>&1 | tee "$LOGS/vllm033_smoke.txt"
smoke_rc=${PIPESTATUS[0]}
if [ "$smoke_rc" -eq 1 ] && [ -f /tmp/mmref-vllm033/server.log ]; then
  tail -40 /tmp/mmref-vllm033/server.log >>"$LOGS/vllm033_smoke.txt"
fi
case $smoke_rc in 0) smoke=pass ;; 3) smoke=skip ;; *) smoke="fail rc=$smoke_rc" ;; esac
echo "gpu tests rc=$tests_rc, rank balance rc=$balance_rc, train step rc=$train_rc (real size rc=$real_rc), cost model rc=$cost_rc, packed forward rc=$bench_rc, vllm 0.33 smoke: $smoke"
[ "$smoke_rc" -eq 3 ] && smoke_rc=0  # a skip says why on its own line; it fails nothing
exit $((tests_rc || balance_rc || train_rc || real_rc || cost_rc || bench_rc || smoke_rc))
