"""The public packed forward on tiny Qwen3.5, Qwen3.5-MoE (Gated DeltaNet + full attention) and
Qwen3-VL-MoE, CPU, fp32, real photos mixed with text-only samples.

``pack_samples`` -> ``materialize_micro_batch`` -> ``packed_inputs`` -> ``packed_logprobs`` against
transformers' own unpacked forward of each sample (``model(input_ids, pixel_values, image_grid_thw,
mm_token_type_ids)``: the model computes its own MRoPE positions and runs its own Gated DeltaNet
forward), so positions, boundaries, feature order and alignment are checked against code that is
not ours; gradients too, also under gradient checkpointing. The per-segment reset itself (and the
leak without it) is tested layer by layer in ``tests/test_linear_attention.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

import trainer_lib.linear_attention as la
from helpers import Family, gradients, reference_logprobs, relative, run_packed
from trainer_lib import (
    PackingUnsupported,
    check_packable,
    linear_attention_path,
    materialize_micro_batch,
    pack_samples,
    packed_inputs,
    packed_logprobs,
    prepare_model_for_packing,
)
from trainer_lib.linear_attention import FLA_VARLEN, PER_SEGMENT_TORCH, remove_linear_attention

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
HYBRID = ("qwen3_5", "qwen3_5_moe")
TOL = 1e-5
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("fwd35") / "run_4" / "assets"
    out = {name: Family(name, root) for name in FAMILIES}
    for fam in out.values():
        prepare_model_for_packing(fam.model)
    return out


def pack(fam: Family, samples, cap: int | None = None):
    return pack_samples(samples, fam.spec, seq_len=4096, micro_batch_max_tokens=cap)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_matches_transformers_one_sample_at_a_time(families, family):
    fam = families[family]
    samples = fam.samples()
    step = pack(fam, samples, cap=300)
    assert step.num_micro_batches >= 2
    assert any(mb.has_pixels and mb.sample_count > 2 for mb in step.micro_batches)
    worst, t_packed, t_alone = 0.0, 0.0, 0.0
    with torch.no_grad():
        for mb in step.micro_batches:
            t0 = time.perf_counter()
            _, out = run_packed(fam, mb)
            t1 = time.perf_counter()
            ref = torch.cat([reference_logprobs(fam, samples[s.sample_index]) for s in mb.slots])
            t_packed, t_alone = t_packed + t1 - t0, t_alone + time.perf_counter() - t1
            worst = max(worst, (out.logprobs - ref).abs().max().item())
            assert out.loss_mask.sum() == mb.num_loss_tokens
    want_path = PER_SEGMENT_TORCH if family in HYBRID else None
    assert (out.backend, out.linear_attention) == ("sdpa", want_path)
    assert linear_attention_path(fam.model) == want_path
    print(
        f"\n{family}: sdpa + {out.linear_attention}: packed vs transformers one at a time max |d logprob| "
        f"{worst:.2e} ({step.num_micro_batches} micro-batches, {step.num_tokens} tokens; packed "
        f"{t_packed * 1e3:.0f} ms, one at a time {t_alone * 1e3:.0f} ms)"
    )
    assert worst <= TOL


@pytest.mark.parametrize(
    ("family", "checkpointing"),
    [("qwen3_5", False), ("qwen3_5", True), ("qwen3_5_moe", True), ("qwen3_vl_moe", False)],
)
def test_gradients_match_transformers_one_sample_at_a_time(families, family, checkpointing):
    """Loss = the sampled tokens' logprobs summed; every parameter's gradient (vision tower, both
    layer kinds, experts, head) packed vs transformers' forward one sample at a time."""
    fam = families[family]
    samples = fam.samples()[:5]
    micro_batches = pack(fam, samples, cap=300).micro_batches

    def alone() -> torch.Tensor:
        total = torch.zeros(())
        for s in samples:
            mask = torch.tensor(s.loss_mask)
            mask[0] = False
            total = total + (reference_logprobs(fam, s) * mask).sum()
        return total

    def packed() -> torch.Tensor:
        outs = [run_packed(fam, mb)[1] for mb in micro_batches]
        return sum((out.logprobs * out.loss_mask).sum() for out in outs)

    want = gradients(fam.model, alone)
    if checkpointing:
        fam.model.gradient_checkpointing_enable()
        fam.model.train()
    try:
        got = gradients(fam.model, packed)
    finally:
        fam.model.gradient_checkpointing_disable()
        fam.model.eval()
    rel = relative(got, want)
    print(f"\n{family} gradients{' (checkpointed)' if checkpointing else ''}: relative {rel:.2e}")
    assert len(want) > 60 and rel <= GRAD_RTOL


# --- refusals -----------------------------------------------------------------------------------


def test_an_unprepared_hybrid_model_is_refused_not_leaked(families):
    fam = families["qwen3_5"]
    (mb,) = pack(fam, fam.samples()[:2]).micro_batches
    m = materialize_micro_batch(mb, fam.spec, fam.config)
    inputs = packed_inputs(m.packed, m.features, fam.model, fam.spec, image_index=m.image_index)
    remove_linear_attention(fam.model)
    try:
        with pytest.raises(PackingUnsupported, match="prepare_model_for_packing"), torch.no_grad():
            packed_logprobs(fam.model, inputs)
    finally:
        assert prepare_model_for_packing(fam.model) == "sdpa"
    assert linear_attention_path(fam.model) == PER_SEGMENT_TORCH


def test_check_packable_reports_and_refuses_linear_attention_paths(families):
    hybrid, plain = families["qwen3_5"].model, families["qwen3_vl_moe"].model
    assert check_packable(hybrid) == PER_SEGMENT_TORCH and check_packable(plain) is None
    with pytest.raises(PackingUnsupported, match="CUDA"):  # flash-linear-attention's kernels: CUDA only
        check_packable(hybrid, linear_attention=FLA_VARLEN)
    with pytest.raises(ValueError, match="chunked"):
        prepare_model_for_packing(hybrid, linear_attention="chunked")


def test_unknown_layer_kinds_are_refused():
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    config = Qwen3_5Config(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=512, linear_num_value_heads=2,
            linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_config(config)
    assert check_packable(model) == PER_SEGMENT_TORCH
    model.config.text_config.layer_types = ["mamba", *model.config.text_config.layer_types[1:]]
    with pytest.raises(PackingUnsupported, match=r"layer kinds \['mamba'\]"):
        prepare_model_for_packing(model)


# --- GPU (skipped without CUDA; scripts/gpu_check.sh runs it with flash-linear-attention) ----------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _packed_and_alone(fam: Family, model, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of ``samples`` packed in one micro-batch, and of each sample packed alone."""
    (mb,) = pack(fam, samples).micro_batches
    m = materialize_micro_batch(mb, fam.spec, fam.config)
    packed = packed_logprobs(
        model, packed_inputs(m.packed, m.features, model, fam.spec, image_index=m.image_index)
    ).logprobs
    alone = []
    for s in samples:
        (one,) = pack(fam, [s]).micro_batches
        mm = materialize_micro_batch(one, fam.spec, fam.config)
        inputs = packed_inputs(mm.packed, mm.features, model, fam.spec, image_index=mm.image_index)
        alone.append(packed_logprobs(model, inputs).logprobs)
    return packed, torch.cat(alone)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("family", HYBRID)
def test_gpu_fla_varlen_packed_matches_one_sample_at_a_time(families, family, monkeypatch):
    """bf16 on CUDA: varlen attention + flash-linear-attention's varlen conv and delta rule, packed
    vs each sample alone through the same kernels; the leak control runs FLA's kernels over the
    whole row (no boundaries) and must be far off (a lent H100, 2026-11-26: 0.0 and 2.7e-2;
    docs/PACKING.md)."""
    from transformers import AutoModelForImageTextToText

    pytest.importorskip("fla", reason="flash-linear-attention (fla-core) not installed")
    fam = families[family]
    model = AutoModelForImageTextToText.from_pretrained(fam.dir, dtype=torch.bfloat16).cuda().eval()
    backend = prepare_model_for_packing(model)
    assert linear_attention_path(model) == FLA_VARLEN
    samples = fam.samples()[:5]  # photos mixed with text-only samples, one micro-batch
    with torch.no_grad():
        packed, alone = _packed_and_alone(fam, model, samples)
        worst = (packed - alone).abs().max().item()
        base = la._fla_kernels()

        def whole(cu: torch.Tensor) -> torch.Tensor:
            return cu[[0, -1]]

        monkeypatch.setattr(
            la,
            "_kernels",
            lambda cls, path: la._Kernels(
                lambda x, w, b, act, cu: base.conv(x, w, b, act, whole(cu)),
                lambda q, k, v, g, beta, cu: base.rule(q, k, v, g, beta, whole(cu)),
            ),
        )
        leaked = (_packed_and_alone(fam, model, samples)[0] - alone).abs().max().item()
    print(
        f"\n{family} {backend} + {FLA_VARLEN} bf16 on {torch.cuda.get_device_name()}: packed vs alone "
        f"max |d| {worst:.2e}; FLA without boundaries (the leak) {leaked:.2e}"
    )
    assert worst <= 1e-2 and leaked > 10 * max(worst, 1e-3)
