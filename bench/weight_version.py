"""What reading the weight version per request costs the plugin's route (docs/WEIGHT-UPDATES.md).

The plugin binds every generate request to ``EngineClient.get_weight_version()``, one utility RPC
to the engine core, which vLLM answers between engine steps. Measured side by side in one run on
a real server (tiny Qwen2-VL, ``VLLM_SERVER_DEV_MODE=1`` for vLLM's ``GET /weight_info``, which is
that RPC behind HTTP):

- the RPC: ``GET /weight_info`` minus ``GET /v1/models`` (the same HTTP path without the RPC),
  medians of interleaved calls, idle and while ``--clients`` clients generate by ref;
- a ref request under the same load (``/inference/v1/generate``, ``--max-tokens`` tokens).

Target: the RPC under load <= 0.1x a ref request's latency.

Usage: ``.venv/bin/python bench/weight_version.py [--clients 3] [--calls 200] [--max-tokens 16]``
(about 2 minutes, most of it the server's start).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import fmt_ms, print_facts, print_table, ratio_row

RPC_TARGET = 0.1


def interleaved(client, calls: int) -> tuple[float, float]:
    """Median seconds of ``GET /v1/models`` and ``GET /weight_info``, called alternately."""
    floor, rpc = [], []
    for _ in range(calls):
        for path, out in (("/v1/models", floor), ("/weight_info", rpc)):
            t0 = time.perf_counter()
            client.get(path).raise_for_status()
            out.append(time.perf_counter() - t0)
    return statistics.median(floor), statistics.median(rpc)


def start(root: Path):
    import msgspec
    from _common import unique_photos
    from transformers import AutoTokenizer

    from make_tiny_models import ensure_tiny_model
    from protocol.adapters import load_adapter, offload_image
    from protocol.placeholders import expand_image_placeholders
    from vllm_server import start_server

    model = ensure_tiny_model("qwen2_vl")
    adapter = load_adapter(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
    refs = [offload_image(jpeg, root / "run_1" / "assets", adapter) for jpeg in unique_photos(4)]
    bodies = [
        {"token_ids": expand_image_placeholders(ids, [r], pad), "mm_refs": [msgspec.to_builtins(r)]}
        for r in refs
    ]
    print("[weight_version] starting the server ...", flush=True)
    server = start_server(
        model,
        root,
        root / "server.log",
        extra_args=("--enable-prefix-caching",),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    return server, bodies


def measure(server, bodies: list[dict], args) -> tuple[tuple, tuple, list[float]]:
    """Interleaved medians idle and under ``args.clients`` generating clients, and their latencies."""
    stop, latencies = threading.Event(), []

    def generate(k: int) -> None:
        sampling = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
        with server.client() as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.post(
                    "/inference/v1/generate", json={**bodies[k % len(bodies)], "sampling_params": sampling}
                )
                latencies.append(time.perf_counter() - t0)

    with server.client() as c:
        for body in bodies:  # warm up: the engine, the resolve cache
            c.post("/inference/v1/generate", json={**body, "sampling_params": {"max_tokens": 1}})
        idle = interleaved(c, args.calls)
        threads = [threading.Thread(target=generate, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(2)
        latencies.clear()
        loaded = interleaved(c, args.calls)
        stop.set()
        for t in threads:
            t.join()
    return idle, loaded, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    print_facts()
    server, bodies = start(Path(tempfile.mkdtemp(prefix="mmref-bench-wv-")))
    try:
        idle, loaded, latencies = measure(server, bodies, args)
    finally:
        server.stop()
    request = statistics.median(latencies)
    rows = [
        ("idle", fmt_ms(idle[0]), fmt_ms(idle[1]), fmt_ms(idle[1] - idle[0]), "-"),
        (
            f"{args.clients} clients generating",
            fmt_ms(loaded[0]),
            fmt_ms(loaded[1]),
            fmt_ms(loaded[1] - loaded[0]),
            f"{fmt_ms(request)} ({len(latencies)} requests)",
        ),
    ]
    print_table(
        "weight version read (medians)",
        ("load", "GET /v1/models", "GET /weight_info", "the RPC", "ref request"),
        rows,
    )
    print_table(
        "targets",
        ("measure", "value", "target", "verdict"),
        [
            ratio_row(
                "RPC / ref request, under load",
                (loaded[1] - loaded[0]) / request,
                RPC_TARGET,
                higher_is_better=False,
            )
        ],
    )


if __name__ == "__main__":
    main()
