"""Packed forward of Qwen3.5 / Qwen3.5-MoE (Gated DeltaNet + full attention) on CPU, fp32.

Real photos mixed with text-only samples, each sample's MRoPE positions from the model's own
``get_rope_index`` (with ``mm_token_type_ids``) and row 0 restarting per sample, the model called
directly on the packed row with ``mmref_cu_seqlens``: per-token logprobs and every parameter's
gradient equal those of one sample at a time, also under gradient checkpointing. Without the
per-segment reset the conv and recurrent state leak into the next sample (measured 2-4e-2).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import trainer_lib.linear_attention as la
from helpers import ensure_tiny_model, gradients, photo_bytes, relative
from protocol.adapters import ImageAdapter, load_adapter, offload_image
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders
from trainer_lib import CU_SEQLENS_KWARG, PackingUnsupported
from trainer_lib.linear_attention import (
    FLA_VARLEN,
    PER_SEGMENT_TORCH,
    linear_attention_layers,
    linear_attention_path,
    prepare_linear_attention,
    remove_linear_attention,
    select_linear_attention_path,
)

FAMILIES = ("qwen3_5", "qwen3_5_moe")
TOL = 1e-5
GRAD_RTOL = 1e-5
SAMPLES = [  # (photos, user text, assistant answer): photos mixed with text-only samples
    (["astronaut"], "What is this?", "A person in a suit."),
    ([], "Say hi.", "hi there friend"),
    (["coffee", "rocket"], "Compare them.", "a cup and a rocket"),
    ([], "Count to five.", "1 2 3 4 5"),
    (["chelsea"], "And this?", "a cat"),
]


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [1, n]
    position_ids: torch.Tensor  # int64 [4, 1, n]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


@dataclass
class Family:
    model: torch.nn.Module
    samples: list[Sample]
    alone: list[torch.Tensor]
    """Per-sample logprobs, one sample per call through transformers' own forward."""


def build_sample(model, tokenizer, adapter: ImageAdapter, root: Path, photos, text, answer) -> Sample:
    refs = [offload_image(photo_bytes(p), root, adapter) for p in photos]
    content = [{"type": "image"}] * len(photos) + [{"type": "text", "text": text}]
    chat = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = expand_image_placeholders(list(tokenizer.apply_chat_template(chat)["input_ids"]), refs, image_pad)
    input_ids = torch.tensor([ids])
    features = [adapter.process(load_image(photo_bytes(p))).tensors for p in photos]
    pixels = torch.cat([f["pixel_values"] for f in features]) if features else None
    grid = torch.cat([f["image_grid_thw"] for f in features]) if features else None
    mm_token_type_ids = (input_ids == image_pad).int()
    mrope, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid)
    position_ids = torch.cat([torch.arange(len(ids)).view(1, 1, -1), mrope], dim=0)
    return Sample(input_ids, position_ids, pixels, grid)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = ensure_tiny_model(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    adapter, root = load_adapter(path), tmp_path_factory.mktemp("assets")
    family = Family(model, [build_sample(model, tokenizer, adapter, root, *s) for s in SAMPLES], [])
    with torch.no_grad():
        family.alone = one_at_a_time(family)
    return family


def logprobs(model, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[n - 1]``: log p(token t+1 | tokens ..t) within one sample."""
    logits = model.lm_head(hidden[0, :-1]).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[0, 1:, None])[:, 0]


def one_at_a_time(fam: Family) -> list[torch.Tensor]:
    out = []
    for s in fam.samples:
        hidden = fam.model.model(
            input_ids=s.input_ids, position_ids=s.position_ids, pixel_values=s.pixel_values,
            image_grid_thw=s.image_grid_thw, use_cache=False,
        ).last_hidden_state  # fmt: skip
        out.append(logprobs(fam.model, hidden, s.input_ids))
    return out


def cu_seqlens(fam: Family) -> torch.Tensor:
    lens = torch.tensor([s.input_ids.shape[1] for s in fam.samples])
    return torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])


def packed(fam: Family, model=None, *, boundaries: bool = True, **overrides) -> list[torch.Tensor]:
    """The packed row through ``model.model``; per-sample logprobs sliced back out of it."""
    model = model or fam.model
    s = fam.samples
    ids = torch.cat([x.input_ids for x in s], dim=1)
    kwargs = {
        "input_ids": ids,
        "position_ids": torch.cat([x.position_ids for x in s], dim=2),
        "pixel_values": torch.cat([x.pixel_values for x in s if x.pixel_values is not None]),
        "image_grid_thw": torch.cat([x.image_grid_thw for x in s if x.image_grid_thw is not None]),
        "use_cache": False,
        **({CU_SEQLENS_KWARG: cu_seqlens(fam)} if boundaries else {}),
        **overrides,
    }
    hidden = model.model(**kwargs).last_hidden_state
    edges = cu_seqlens(fam).tolist()
    return [logprobs(model, hidden[:, lo:hi], ids[:, lo:hi]) for lo, hi in itertools.pairwise(edges)]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# --- forward ------------------------------------------------------------------------------------


def test_packed_equals_one_sample_at_a_time(family):
    alone = family.alone
    with torch.no_grad():
        remove_linear_attention(family.model)
        leaked = max_diff(packed(family, boundaries=False), alone)  # transformers' forward, packed
        assert prepare_linear_attention(family.model) == PER_SEGMENT_TORCH
        assert linear_attention_path(family.model) == PER_SEGMENT_TORCH
        got = max_diff(packed(family), alone)
        unpacked_after = max_diff(one_at_a_time(family), alone)
    print(f"packed vs one at a time: {got:.2e} (transformers' forward, packed: {leaked:.2e})")
    assert got <= TOL
    assert leaked > 1e-3  # the negative control: the leak is real and this comparison sees it
    assert unpacked_after == 0.0  # calls without boundaries still run transformers' own forward


@pytest.mark.parametrize("removed", ["conv and recurrence", "conv", "recurrence"])
def test_removing_the_per_segment_reset_shows_the_leak(family, monkeypatch, removed):
    """The same path with one packed segment where the reset is removed: each reset is needed."""
    prepare_linear_attention(family.model)
    layer_cls = type(linear_attention_layers(family.model)[0])
    base = la._torch_kernels(layer_cls)

    def whole(cu: torch.Tensor) -> torch.Tensor:
        return torch.tensor([0, int(cu[-1])])

    conv, rule = base.conv, base.rule
    if "conv" in removed:
        conv = lambda x, w, b, act, cu: base.conv(x, w, b, act, whole(cu))  # noqa: E731
    if "recurrence" in removed:
        rule = lambda q, k, v, g, beta, cu: base.rule(q, k, v, g, beta, whole(cu))  # noqa: E731
    monkeypatch.setattr(la, "_kernels", lambda cls, path: la._Kernels(conv, rule))
    with torch.no_grad():
        leaked = max_diff(packed(family), family.alone)
    print(f"reset removed from {removed}: max |d logprob| {leaked:.2e}")
    assert leaked > (1e-3 if removed == "conv and recurrence" else 3 * TOL)


def test_gradients_equal_one_sample_at_a_time_also_with_checkpointing(family):
    model = family.model
    remove_linear_attention(model)
    want = gradients(model, lambda: sum(lp.sum() for lp in one_at_a_time(family)))
    prepare_linear_attention(model)
    got = gradients(model, lambda: sum(lp.sum() for lp in packed(family)))
    calls = []
    hooks = [
        layer.register_forward_hook(lambda *a: calls.append(1)) for layer in linear_attention_layers(model)
    ]
    model.gradient_checkpointing_enable()
    model.train()
    try:
        checkpointed = gradients(model, lambda: sum(lp.sum() for lp in packed(family)))
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        for hook in hooks:
            hook.remove()
    print(f"gradients, relative: {relative(got, want):.2e}; checkpointed {relative(checkpointed, want):.2e}")
    assert len(want) > 80  # vision tower, both layer kinds, head
    assert relative(got, want) <= GRAD_RTOL
    assert relative(checkpointed, want) <= GRAD_RTOL
    # Each linear-attention layer ran twice: forward, then recomputed in backward, both on the packed path.
    assert len(calls) == 2 * len(linear_attention_layers(model))


def test_a_deep_copy_keeps_the_path(family):
    prepare_linear_attention(family.model)
    clone = copy.deepcopy(family.model)
    assert linear_attention_path(clone) == PER_SEGMENT_TORCH
    with torch.no_grad():
        assert max_diff(packed(family, clone), packed(family)) == 0.0
        with pytest.raises(PackingUnsupported, match=CU_SEQLENS_KWARG):
            packed(family, clone, boundaries=False)


# --- refusals -------------------------------------------------------------------------------------


def test_a_packed_row_without_or_with_wrong_boundaries_is_refused(family):
    prepare_linear_attention(family.model)
    cu = cu_seqlens(family)
    with torch.no_grad():
        with pytest.raises(PackingUnsupported, match="restart at"):
            packed(family, boundaries=False)
        shifted = cu.clone()
        shifted[1] += 1
        with pytest.raises(PackingUnsupported, match="disagrees"):
            packed(family, **{CU_SEQLENS_KWARG: shifted})
        with pytest.raises(PackingUnsupported, match="disagrees"):
            packed(family, **{CU_SEQLENS_KWARG: cu[:-1]})  # the last sample left out
        three_rows = torch.cat([s.position_ids[1:] for s in family.samples], dim=2)
        with pytest.raises(PackingUnsupported, match=r"\[4, 1, L\]"):
            packed(family, position_ids=three_rows)
        with pytest.raises(PackingUnsupported, match="no cache"):
            packed(family, use_cache=True)


def test_remove_restores_transformers_forward(family):
    prepare_linear_attention(family.model)
    remove_linear_attention(family.model)
    assert linear_attention_path(family.model) is None
    assert all("forward" not in vars(layer) for layer in linear_attention_layers(family.model))
    with torch.no_grad():  # no hook left either: the leaking packed call runs again
        packed(family, boundaries=False)


def test_path_selection():
    assert la._choose("cpu", False, None) == PER_SEGMENT_TORCH
    assert la._choose("cpu", True, None) == PER_SEGMENT_TORCH
    assert la._choose("cuda", True, None) == FLA_VARLEN
    assert la._choose("cuda", False, PER_SEGMENT_TORCH) == PER_SEGMENT_TORCH  # asked for: correct, slow
    with pytest.raises(PackingUnsupported, match="pip install flash-linear-attention"):
        la._choose("cuda", False, None)
    with pytest.raises(PackingUnsupported, match="CUDA"):
        la._choose("cpu", True, FLA_VARLEN)
    with pytest.raises(ValueError):
        la._choose("cpu", True, "chunked")


def test_cpu_model_selects_the_per_segment_path_and_refuses_fla(family):
    assert select_linear_attention_path(family.model) == PER_SEGMENT_TORCH
    with pytest.raises(PackingUnsupported, match="flash-linear-attention"):
        select_linear_attention_path(family.model, FLA_VARLEN)
    assert len(linear_attention_layers(family.model)) == 2  # [linear, full, linear, full]


def test_a_model_without_linear_attention_needs_nothing():
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        ensure_tiny_model("qwen3_vl_moe"), dtype=torch.float32
    )
    assert linear_attention_layers(model) == []
    assert prepare_linear_attention(model) is None and linear_attention_path(model) is None


def test_another_gated_deltanet_is_refused():
    """Qwen3-Next's layer (fused qkvz / ba projections) is not Qwen3.5's: no packed path, no guess."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    with pytest.raises(PackingUnsupported, match="Qwen3NextGatedDeltaNet"):
        prepare_linear_attention(Qwen3NextForCausalLM(config))
