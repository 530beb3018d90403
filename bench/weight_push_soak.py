"""Weight pushes under image traffic: which update procedure keeps vLLM alive (docs/WEIGHT-UPDATES.md).

A real dev-mode server (tiny Qwen2-VL, float32, prefix caching) serves continuous image traffic,
ref requests on ``/inference/v1/generate`` and data URLs on vLLM's own ``/v1/chat/completions``,
while the weights are pushed again and again (two checkpoints, A and B, alternating) through one
update procedure (``--procedure``):

- ``readme-async``: the earlier README recipe: ``/pause?mode=keep`` (vLLM's default
  ``clear_cache=true``), ``reload_weights``, ``/reset_encoder_cache``, ``/update_weight_version``,
  ``/resume``;
- ``keep-noclear``: the same with ``clear_cache=false``;
- ``abort``: ``/pause`` (mode abort), reload, version, ``/resume``;
- ``nopause``: reload, ``/reset_encoder_cache``, ``/reset_prefix_cache``, version;
- ``mmref``: the plugin's one call, ``POST /mmref/v1/weights/update`` (drain, reload, caches,
  version, resume).

Printed: pushes done, answers by route and status, cut-short answers (``finish_reason: abort``),
whether the engine is alive at the end, and the first engine traceback line when it died.

Usage: ``.venv/bin/python bench/weight_push_soak.py --procedure mmref --pushes 500 --interval 0.3``
"""

from __future__ import annotations

import argparse
import base64
import collections
import tempfile
import time
from pathlib import Path

from _common import print_facts, print_table, unique_photos
from traffic import Traffic

PROCEDURES = ("readme-async", "keep-noclear", "abort", "nopause", "mmref")


def build(root: Path) -> dict:
    """Tiny model, its jittered twin (checkpoint B), photos offloaded, request bodies."""
    import msgspec
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from make_tiny_models import ensure_tiny_model
    from protocol.adapters import load_adapter, offload_image
    from protocol.placeholders import expand_image_placeholders

    model = ensure_tiny_model("qwen2_vl")
    b = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in b.named_parameters():
            p.mul_(4.0) if "visual" in name else p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    b.save_pretrained(root / "B", safe_serialization=True)
    adapter = load_adapter(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    photos = unique_photos(6, size=(448, 336))
    refs = [offload_image(p, root / "run_1" / "assets", adapter) for p in photos]
    text = "Describe the picture in detail."
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
    ref_bodies = [
        {"token_ids": expand_image_placeholders(ids, [r], pad), "mm_refs": [msgspec.to_builtins(r)]}
        for r in refs
    ]
    chat_bodies = [
        {
            "model": str(model),
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _data_url(p)}},
                        {"type": "text", "text": text},
                    ],
                }
            ],
        }
        for p in photos
    ]
    return {"model": model, "A": model, "B": root / "B", "ref": ref_bodies, "chat": chat_bodies}


def _data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def push(client, procedure: str, weights: Path, version: str) -> dict:
    """One weight push through ``procedure`` (module doc): the plugin's answer for ``mmref``, else
    ``{}``. Raises on a non-2xx answer."""
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}

    def call(path: str, **kw) -> None:
        client.post(path, **kw).raise_for_status()

    if procedure == "mmref":
        body = {"weights_path": str(weights), "version": version}
        r = client.post("/mmref/v1/weights/update", json=body)
        r.raise_for_status()
        return r.json()
    if procedure == "readme-async":
        call("/pause", params={"mode": "keep"})
    elif procedure == "keep-noclear":
        call("/pause", params={"mode": "keep", "clear_cache": "false"})
    elif procedure == "abort":
        call("/pause")
    call("/collective_rpc", json=reload)
    if procedure in ("readme-async", "keep-noclear", "nopause"):
        call("/reset_encoder_cache")
    if procedure == "nopause":
        call("/reset_prefix_cache")
    call("/update_weight_version", json={"new_version": version})
    if procedure != "nopause":
        call("/resume")
    return {}


def traffic(server, data: dict, clients: int, max_tokens: int) -> Traffic:
    """``clients`` threads, a third on vLLM's chat route (data URLs), the rest by ref."""
    sampling = {"temperature": 1.0, "max_tokens": max_tokens}

    def send(client, k: int, i: int):
        if k % 3 == 2:
            body = {**data["chat"][i % 6], **sampling, "logprobs": True}
            return "chat", client.post("/v1/chat/completions", json=body)
        body = {**data["ref"][(k + i) % 6], "sampling_params": {**sampling, "logprobs": 0}}
        return "ref", client.post("/inference/v1/generate", json=body)

    return Traffic(server, clients, send, timeout=120)


def answer_counts(load: Traffic) -> collections.Counter[str]:
    """The answers by route and status, plus those cut short and those without a version header."""
    counts = collections.Counter(load.counts)
    for route, _, _, r in load.answers:
        if r.json()["choices"][0].get("finish_reason") == "abort":
            counts[f"{route} 200 cut short (abort)"] += 1
        if r.headers.get("x-mmref-weight-version") is None:
            counts[f"{route} 200 without a version header"] += 1
    return counts


def soak(server, data: dict, args) -> dict:
    pushes, failure, answers = 0, None, []
    with server.client(timeout=300) as c, traffic(server, data, args.clients, args.max_tokens) as load:
        time.sleep(2)
        t0 = time.monotonic()
        for k in range(args.pushes):
            weights = data["B"] if k % 2 == 0 else data["A"]
            try:
                answers.append(push(c, args.procedure, weights, f"v{k + 1}"))
            except Exception as e:
                failure = f"push {k + 1}: {type(e).__name__}: {str(e)[:200]}"
                break
            pushes += 1
            if server.process.poll() is not None:
                failure = f"server exited after push {k + 1}"
                break
            time.sleep(args.interval)
        seconds = time.monotonic() - t0
        time.sleep(2)
    log_at_end = len(server.log())
    alive = server.process.poll() is None
    if alive:
        try:
            with server.client(timeout=30) as c:
                alive = c.get("/health").status_code == 200
        except Exception:
            alive = False
    return {
        "pushes": pushes,
        "seconds": seconds,
        "failure": failure,
        "alive": alive,
        "counts": answer_counts(load),
        "updates": [a for a in answers if a],
        "log": server.log()[:log_at_end],
    }


def update_rows(updates: list[dict]) -> list[tuple[str, str]]:
    """Medians and tails of the plugin's update answers (drain, reload, whole hold)."""
    if not updates:
        return []
    import statistics

    def stats(key: str) -> str:
        values = sorted(u[key] for u in updates)
        p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
        median = statistics.median(values)
        return f"median {median * 1e3:.0f} ms, p95 {p95 * 1e3:.0f} ms, max {values[-1] * 1e3:.0f} ms"

    drained = sum(u["drained_requests"] for u in updates)
    return [
        ("requests drained by the updates", f"{drained} ({drained / len(updates):.1f} per update)"),
        ("drain (requests in flight finishing)", stats("drain_seconds")),
        ("reload_weights", stats("reload_seconds")),
        ("server held (gate closed)", stats("held_seconds")),
        ("prefix cache reset every time", str(all(u["prefix_cache_reset"] for u in updates))),
    ]


def engine_error(log: str) -> str:
    for line in log.splitlines():
        if "Error" in line and ("assert" in line.lower() or "RuntimeError" in line or "EngineDead" in line):
            return line.strip()[:300]
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procedure", choices=PROCEDURES, default="mmref")
    parser.add_argument("--pushes", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between pushes")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    print_facts()
    from vllm_server import start_server

    root = Path(tempfile.mkdtemp(prefix="mmref-soak-"))
    data = build(root)
    print(f"[soak] starting the server ({args.procedure}) ...", flush=True)
    server = start_server(
        data["model"],
        root,
        root / "server.log",
        extra_args=("--enable-prefix-caching", "--max-num-seqs", "8"),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        result = soak(server, data, args)
    finally:
        server.stop()
    counts = result["counts"]
    rows = [
        ("procedure", args.procedure),
        ("pushes done / asked", f"{result['pushes']} / {args.pushes} in {result['seconds']:.0f} s"),
        ("engine alive at the end", "yes" if result["alive"] else "NO"),
        ("failure", result["failure"] or "-"),
        ("engine error in the log", engine_error(result["log"])),
        *sorted((k, str(v)) for k, v in counts.items()),
        *update_rows(result["updates"]),
    ]
    print_table("weight pushes under traffic", ("measure", "value"), rows)
    print(f"server log: {root / 'server.log'}")


if __name__ == "__main__":
    main()
