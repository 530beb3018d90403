#!/usr/bin/env bash
# vLLM 0.33 serve smoke (issue 24, step 2; a step of scripts/gpu_check.sh): the vllm==0.33.0 CUDA
# wheel + this repo, `vllm serve` of a tiny Qwen2-VL with VLLM_PLUGINS=mmref, one request by ref
# (POST /inference/v1/generate, mm_refs) and the same image as a data URL (POST
# /v1/chat/completions); greedy tokens must be equal.
#
# Ends with one line: "PASS: ..." (exit 0), "FAIL: ..." (exit 1), or "SKIP: <reason>" (exit 3) where
# what it needs is not there: no GPU, no wheel folder, no vllm-0.33.0 wheel in it, a dependency
# pip cannot find in it (named), no tiny model. A skip is not a pass: gpu_check.sh reports it.
#
# Offline: everything comes from a wheel folder ($VLLM033_WHEELS, default .whl-vllm033), made on a
# machine with internet (the pip there must match the GPU machine's Python, 3.12):
#   python -m pip download -d .whl-vllm033 --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 vllm==0.33.0 'setuptools>=77' msgspec pydantic-settings
#   python scripts/make_tiny_models.py --family qwen2_vl            # -> .cache/tiny_models/qwen2_vl
# vllm 0.33.0 pins torch==2.14.0 (and transformers>=5.16.1,<5.21): pip resolves every dependency
# from the folder and from what the machine has (--system-site-packages), and stops, naming what
# is missing, where the machine's torch is another version. The folder is several GB (the vllm
# wheel alone is 336 MB): more than a lent device machine's 64 MiB carry (docs/VLLM-SURFACE.md).
#
# Flags checked against vLLM 0.33.0's source: `vllm serve MODEL` (model_tag), --dtype,
# --max-model-len, --max-num-seqs, --enforce-eager, --limit-mm-per-prompt (JSON), --seed,
# --gpu-memory-utilization, --no-enable-prefix-caching (BooleanOptionalAction, kept in 0.33 beside
# --disable-prefix-caching); chat completions' return_token_ids.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/mmref-vllm033}
WHEELS=${VLLM033_WHEELS:-.whl-vllm033}
MODEL=${MODEL:-.cache/tiny_models/qwen2_vl}
DTYPE=${DTYPE:-bfloat16}
PORT=${PORT:-8033}
VENV=${VENV:-/tmp/mmref-vllm033-venv}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

fail() { echo "FAIL: $*"; exit 1; }
skip() { echo "SKIP: $*"; exit 3; }

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || skip "no NVIDIA GPU here (the 0.33 wheel is CUDA-only)"
[ -d "$WHEELS" ] || skip "no wheel folder $WHEELS (made with pip download on a machine with internet: see the header)"
compgen -G "$WHEELS/vllm-0.33.0-*.whl" >/dev/null || skip "no vllm-0.33.0 wheel in $WHEELS"
[ -f "$MODEL/config.json" ] || skip "no tiny model at $MODEL (scripts/make_tiny_models.py --family qwen2_vl)"

# 1. install: a venv over the machine's packages, vllm 0.33.0 and this repo from the folder only
"$PY" -m venv --system-site-packages "$VENV" || fail "venv"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --no-index --find-links "$WHEELS" --no-cache-dir)
missing() {  # pip's "No matching distribution found for X" (the folder lacks X): a skip, naming X
  grep -m1 -o "No matching distribution found for [^ ]*" "$LOGS/install.log" | sed 's/.* for //'
}
"${PIP[@]}" 'setuptools>=77' >"$LOGS/install.log" 2>&1 || skip "setuptools>=77 not installable from $WHEELS: $(missing)"
if ! "${PIP[@]}" 'vllm==0.33.0' >>"$LOGS/install.log" 2>&1; then
  what=$(missing)
  [ -n "$what" ] && skip "vllm==0.33.0 needs $what, which $WHEELS lacks (install.log)"
  tail -5 "$LOGS/install.log"
  fail "vllm==0.33.0 install (install.log)"
fi
"${PIP[@]}" --no-build-isolation --no-deps . >>"$LOGS/install.log" 2>&1 || fail "mmref install (install.log)"
"$VPY" - <<'PY' 2>&1 | tee "$LOGS/versions.txt" || fail "imports (versions.txt)"
import importlib.metadata as md
import torch, transformers, vllm
assert md.entry_points(group="vllm.endpoint_plugins").select(name="mmref"), "mmref entry point not installed"
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available())
assert vllm.__version__.startswith("0.33."), vllm.__version__
PY

# 2. the asset store, the ref, the prompt and the data URL (the same bytes)
ASSETS="$LOGS/outputs/run_smoke/assets"
"$VPY" - "$MODEL" "$ASSETS" "$LOGS/request.json" <<'PY' || fail "request preparation"
import base64, io, json, sys
import msgspec, numpy as np
from PIL import Image
from transformers import AutoTokenizer
from protocol.adapters import load_adapter, offload_image
from protocol.placeholders import expand_image_placeholders

model, assets, out = sys.argv[1:4]
y, x = np.mgrid[0:224, 0:320]
pixels = np.stack([x * 255 // 319, y * 255 // 223, (x + y) % 256], axis=-1).astype(np.uint8)
buf = io.BytesIO()
Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
jpeg = buf.getvalue()
ref = offload_image(jpeg, assets, load_adapter(model))
tokenizer = AutoTokenizer.from_pretrained(model)
text = "Describe the picture."
chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
sampling = {"temperature": 0, "max_tokens": 16}
by_ref = {"token_ids": expand_image_placeholders(ids, [ref], pad), "mm_refs": [msgspec.to_builtins(ref)],
          "sampling_params": sampling}
url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
by_url = {"model": model, "temperature": 0, "max_tokens": 16, "return_token_ids": True,
          "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": text}]}]}
json.dump({"by_ref": by_ref, "by_url": by_url}, open(out, "w"))
print("ref", ref.ref[:80], "placeholders", ref.num_placeholders)
PY

# 3. vllm serve with the plugin (the CUDA wheel's own `vllm` command)
VLLM_PLUGINS=mmref MMREF_ASSET_ROOT="$LOGS/outputs" "$VENV/bin/vllm" serve "$MODEL" \
  --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --max-model-len 2048 --max-num-seqs 4 \
  --enforce-eager --limit-mm-per-prompt '{"image": 4, "video": 0}' --seed 0 \
  --gpu-memory-utilization 0.3 --no-enable-prefix-caching >"$LOGS/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT

# 4. the two requests, compared
"$VPY" - "$PORT" "$LOGS/request.json" "$SERVER" <<'PY' 2>&1 | tee "$LOGS/smoke.txt"
import json, os, sys, time
import httpx
from vllm_plugin.weights import WEIGHT_VERSION_HEADER

port, request, pid = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 600
while True:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("FAIL: the server exited during start-up (server.log)")
    try:
        if httpx.get(f"{base}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("FAIL: the server was not healthy within 600 s (server.log)")
    time.sleep(2)
with httpx.Client(base_url=base, timeout=300) as client:
    ref = client.post("/inference/v1/generate", json=request["by_ref"])
    url = client.post("/v1/chat/completions", json=request["by_url"])
print("by ref:", ref.status_code, ref.text[:300])
print("by data URL:", url.status_code, url.text[:300])
if ref.status_code != 200 or url.status_code != 200:
    sys.exit("FAIL: a request was refused")
via_ref = ref.json()["choices"][0]["token_ids"]
via_url = url.json()["choices"][0]["token_ids"]
print("weight version:", ref.headers.get(WEIGHT_VERSION_HEADER))
if via_ref != via_url:
    sys.exit(f"FAIL: greedy tokens differ: ref {via_ref} vs data URL {via_url}")
print(f"PASS: vLLM 0.33 serves the ref as the data URL: {len(via_ref)} equal greedy tokens {via_ref}")
PY
rc=${PIPESTATUS[0]}
grep -m2 -E "mmref: (routes attached|serving refs)" "$LOGS/server.log" || echo "(no mmref start-up lines in server.log)"
exit "$rc"
