"""trainer_lib.forward and trainer_lib.positions on tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL with real photos.

The reference for every packed forward is transformers' own unpacked forward of each sample
(``model(input_ids, pixel_values, image_grid_thw, mm_token_type_ids)``: the model computes its
own MRoPE positions), so positions, masks, feature order and logprob alignment are all checked
against code that is not ours. The reference for adjacent images is vLLM's
``get_mrope_input_positions`` (transformers' ``get_rope_index`` cannot split them).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import types

import msgspec
import pytest
import torch
import torch.nn.functional as F

from helpers import (
    PAD,
    Families,
    Family,
    chat,
    ensure_tiny_model,
    reference_logprobs,
    run_packed,
    vllm_positions,
)
from protocol.refs import format_mmraw, parse_ref
from protocol.structs import decode_microbatch, encode
from trainer_lib import PackingSpec
from trainer_lib.attention import VARLEN_ATTENTION
from trainer_lib.forward import packed_logprobs
from trainer_lib.materialize import materialize_micro_batch
from trainer_lib.micro_batch import replace_loss_mask
from trainer_lib.model_inputs import PackedInputs, packed_inputs
from trainer_lib.packed_call import PackingUnsupported
from trainer_lib.planning.packing import pack_samples, rebuild_micro_batch
from trainer_lib.planning.plan import plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.positions import build_position_ids, cu_seqlens, rope_index_fn
from trainer_lib.prepare import check_packable, prepare_model_for_packing, select_backend

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
MROPE_FAMILIES = (*FAMILIES, "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
"""Every MRoPE family: the positions test runs on each (the Qwen3.5 hybrids and Qwen3-VL-MoE's
packed forward is ``test_forward_qwen35.py``'s)."""
TOL = 1e-5
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each family's :class:`helpers.Family`, built on first use."""
    return Families(tmp_path_factory.mktemp("fwd") / "run_3" / "assets")


def one_d_positions(seq_lens) -> torch.Tensor:
    """int64 ``[1, L]`` positions restarting at 0 per sample (DataCollatorWithFlattening style)."""
    return torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens]).unsqueeze(0)


def leaky_logprobs(fam: Family, inputs: PackedInputs) -> torch.Tensor:
    """The packed forward with a cache object (``use_cache=True``), which packed_logprobs never
    passes: transformers then builds a plain causal mask across the whole pack."""
    out = fam.model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=None,
        use_cache=True,
        pixel_values=inputs.pixel_values,
        image_grid_thw=inputs.image_grid_thw,
    )
    logits = out.logits[0, :-1].float()
    lp = F.log_softmax(logits, -1).gather(-1, inputs.input_ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp]).index_fill(0, inputs.cu_seqlens[:-1].long(), 0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_matches_one_sample_at_a_time(families, family):
    fam = families[family]
    samples = fam.samples()
    assert prepare_model_for_packing(fam.model) == "sdpa" == select_backend(fam.model)
    step = pack_samples(samples, fam.spec, seq_len=4096, micro_batch_max_tokens=300)
    assert step.num_micro_batches >= 2 and any(
        mb.has_pixels and mb.sample_count > 2 for mb in step.micro_batches
    )
    worst = 0.0
    t_packed = t_single = 0.0
    with torch.no_grad():
        for mb in step.micro_batches:
            t0 = time.perf_counter()
            inputs, out = run_packed(fam, mb)
            t_packed += time.perf_counter() - t0
            assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (mb.num_tokens,)
            assert inputs.position_ids.shape == (4, 1, mb.num_tokens) and inputs.input_ids.shape == (
                1,
                mb.num_tokens,
            )
            t0 = time.perf_counter()
            ref = torch.cat([reference_logprobs(fam, samples[s.sample_index]) for s in mb.slots])
            t_single += time.perf_counter() - t0
            worst = max(worst, (out.logprobs - ref).abs().max().item())
            # the loss mask is the samples' mask (completion tokens), never a sample's first token
            want = torch.tensor(mb.micro_batch.loss_mask) & (inputs.position_ids[0, 0] != 0)
            assert torch.equal(out.loss_mask, want) and int(out.loss_mask.sum()) == mb.num_loss_tokens
    print(
        f"\n{family}: packed vs one-at-a-time max |dlogprob| = {worst:.2e}; "
        f"{step.num_micro_batches} micro-batches, {step.num_tokens} tokens; "
        f"packed {t_packed * 1e3:.0f} ms, reference {t_single * 1e3:.0f} ms"
    )
    assert worst <= TOL


def test_dropping_the_block_diagonal_mask_breaks_the_match(families):
    """The match above is due to the per-sample mask: with a cache object (use_cache=True) transformers
    builds a causal mask across the whole pack, and 1D positions ([1, L], DataCollatorWithFlattening style)
    give a Qwen-VL model no text row to find the boundaries from (and wrong MRoPE)."""
    fam = families["qwen2_vl"]
    samples = fam.samples()
    mb = pack_samples(samples, fam.spec, seq_len=4096).micro_batches[0]
    with torch.no_grad():
        ref = torch.cat([reference_logprobs(fam, samples[s.sample_index]) for s in mb.slots])
        inputs, good = run_packed(fam, mb)
        m = materialize_micro_batch(mb, fam.spec, fam.config, dedup=False)  # transformers' own forward
        leaky = leaky_logprobs(fam, packed_inputs(m.packed, m.features, fam.model, fam.spec))
        flat = PackedInputs(**{**vars(inputs), "position_ids": one_d_positions(mb.seq_lens)})
        flat_out = packed_logprobs(fam.model, flat)
    # only the first sample is unaffected (nothing before it to leak from)
    later = torch.arange(mb.num_tokens) >= mb.seq_lens[0]
    errors = {
        "good": (good.logprobs - ref).abs().max().item(),
        "use_cache=True": (leaky - ref)[later].abs().max().item(),
        "1D positions": (flat_out.logprobs - ref)[later].abs().max().item(),
    }
    print(f"\nmax |dlogprob| vs one-at-a-time: {errors}")
    assert errors["good"] <= TOL
    assert errors["use_cache=True"] > 1e-2
    assert errors["1D positions"] > 1e-2


@pytest.mark.parametrize("family", MROPE_FAMILIES)
def test_positions_match_vllm_including_adjacent_images(families, family):
    fam = families[family]
    r, t = fam.refs, fam.tok
    samples = [
        chat([r["coffee"], r["astronaut"], r["chelsea"]], "three in a row", "ok", t, adjacent=True),
        chat([], "text only", "fine", t),
        chat([r["rocket"]], "one", "yes", t),
        chat([r["astronaut"], r["rocket"]], "two apart", "no", t),
    ]
    mb = pack_samples(samples, fam.spec, seq_len=4096).micro_batches[0]
    pos = build_position_ids(mb, fam.model)
    assert pos.shape == (4, 1, mb.num_tokens) and pos.dtype == torch.long
    # the config-only path binds the same transformers function: same result without a model
    assert torch.equal(build_position_ids(mb, fam.model.config), pos)
    assert rope_index_fn(fam.model).__func__ is type(fam.model.model).get_rope_index
    for slot in mb.slots:
        seg = slice(slot.start, slot.start + slot.length)
        assert torch.equal(pos[0, 0, seg], torch.arange(slot.length))  # row 0 restarts at 0
        spans = [
            (im.start - slot.start, im.length, list(im.grid))
            for im in mb.images[slot.first_image : slot.first_image + slot.num_images]
        ]
        want = vllm_positions(family, fam.model.config, samples[slot.sample_index].input_ids, spans)
        assert torch.equal(pos[1:, 0, seg], want), f"sample {slot.sample_index}"
    assert cu_seqlens(mb.seq_lens).tolist() == [0, *torch.tensor(mb.seq_lens).cumsum(0).tolist()]
    assert cu_seqlens(mb.seq_lens).dtype == torch.int32


def test_adjacent_images_forward_matches_one_sample_at_a_time(families):
    """Adjacent images through the packed forward (positions as vLLM's) vs the same sample packed alone."""
    fam = families["qwen2_5_vl"]
    r, t = fam.refs, fam.tok
    samples = [chat([r["coffee"], r["chelsea"]], "pair", "two", t, adjacent=True), chat([], "x", "y", t)]
    mb = pack_samples(samples, fam.spec, seq_len=4096).micro_batches[0]
    with torch.no_grad():
        _, packed = run_packed(fam, mb)
        alone = [
            run_packed(fam, pack_samples([s], fam.spec, seq_len=4096).micro_batches[0])[1] for s in samples
        ]
    assert (packed.logprobs - torch.cat([a.logprobs for a in alone])).abs().max().item() <= TOL


def _segments_sdpa(q, k, v, cu, scale=None, enable_gqa=False):
    """Causal sdpa per ``cu`` segment: what FlashAttention varlen computes, on CPU."""
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        o = F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def varlen_current(
    q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
    seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch 2.13's ``varlen_attn`` signature (torch/nn/attention/varlen.py)."""
    assert window_size == (-1, 0) and num_splits == 1 and q.ndim == 3 and cu_q.dtype == torch.int32
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    return _segments_sdpa(q, k, v, cu_q, scale, enable_gqa)


def varlen_older(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    """The earlier ``varlen_attn`` signature: ``is_causal``, no scale, no GQA."""
    assert is_causal and q.shape[1] == k.shape[1] and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    return _segments_sdpa(q, k, v, cu_q)


@pytest.mark.parametrize("kernel", [varlen_current, varlen_older])
def test_varlen_backend_plumbing_on_cpu(families, monkeypatch, kernel):
    """The CUDA backend's transformers wiring (AttentionInterface + AttentionMaskInterface, cu_seqlens
    passed once, GQA, [1,H,L,D] <-> [L,H,D] layouts) on CPU, a CPU kernel in place of varlen_attn,
    for both ``varlen_attn`` signatures torch has shipped."""
    import trainer_lib.attention as fw

    calls = []

    def reference_varlen(q, k, v, cu_q, *args, **kwargs):
        calls.append(cu_q.tolist())
        return kernel(q, k, v, cu_q, *args, **kwargs)

    reference_varlen.__signature__ = inspect.signature(kernel)
    monkeypatch.setattr(fw, "_varlen_kernel", lambda: reference_varlen)
    fam = families["qwen3_vl"]  # 4 heads / 2 kv heads: GQA
    samples = fam.samples()
    mb = pack_samples(samples, fam.spec, seq_len=4096).micro_batches[0]
    with torch.no_grad():
        ref = torch.cat([reference_logprobs(fam, samples[s.sample_index]) for s in mb.slots])
        try:
            assert prepare_model_for_packing(fam.model, VARLEN_ATTENTION) == VARLEN_ATTENTION
            _, out = run_packed(fam, mb)
        finally:
            fam.model.set_attn_implementation("sdpa")
    assert out.backend == VARLEN_ATTENTION
    n_layers = fam.model.config.text_config.num_hidden_layers
    assert calls == [cu_seqlens(mb.seq_lens).tolist()] * n_layers
    worst = (out.logprobs - ref).abs().max().item()
    print(f"\n{VARLEN_ATTENTION} wiring ({kernel.__name__} on CPU), qwen3_vl: max |dlogprob| = {worst:.2e}")
    assert worst <= TOL


def test_varlen_refuses_a_scale_the_kernel_cannot_take(monkeypatch):
    import trainer_lib.attention as fw

    monkeypatch.setattr(fw, "_varlen_kernel", lambda: varlen_older)
    q = torch.zeros(1, 2, 5, 32)
    module = types.SimpleNamespace(is_causal=True)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out, _ = fw._varlen_attention_forward(
        module, q, q, q, None, scaling=32**-0.5, mmref_cu_seqlens=cu, mmref_max_seqlen=3
    )
    assert out.shape == (1, 5, 2, 32)
    with pytest.raises(PackingUnsupported, match="takes no scale"):
        fw._varlen_attention_forward(
            module, q, q, q, None, scaling=0.5, mmref_cu_seqlens=cu, mmref_max_seqlen=3
        )


def test_backend_rules_on_cpu(families):
    model = families["qwen2_vl"].model
    check_packable(model, "sdpa")
    check_packable(model, "eager")
    with pytest.raises(PackingUnsupported, match="flex_attention"):
        check_packable(model, "flex_attention")


def test_missing_image_zeroes_only_its_sample_and_synthetic_pads_run(families, tmp_path):
    """placeholder_zero_loss inside a micro-batch: that sample's loss tokens go, the others stay; a
    synthetic-image pad from plan_step (zero features) runs through the model."""
    fam = families["qwen2_vl"]
    good = fam.refs["coffee"]
    gone = msgspec.structs.replace(
        good,
        ref=format_mmraw(
            msgspec.structs.replace(
                parse_ref(good.ref),
                raw_image_uri=(fam.root / "images" / "0000000000000000.jpg").as_uri(),
                mm_hash="0" * 32,
            )
        ),
    )
    samples = [
        chat([good], "a", "bb", fam.tok),
        chat([gone], "c", "dd", fam.tok),
        chat([], "e", "ff", fam.tok),
    ]
    step = pack_samples(samples, fam.spec, seq_len=4096)
    mb = step.micro_batches[0]
    m = materialize_micro_batch(mb, fam.spec, fam.config)
    per_sample = {s.sample_index: s.num_loss_tokens for s in m.packed.slots}
    assert per_sample[1] == 0 and per_sample[0] == 3 and per_sample[2] == 3
    assert m.packed.num_loss_tokens == mb.num_loss_tokens - 3 == sum(m.packed.micro_batch.loss_mask)
    assert m.stats.placeholders == 1

    (ranks,) = plan_step(  # dp 2: the rank with the text sample runs the vision tower on a pad
        [samples[0], samples[2]], fam.spec, StepShape(dp_size=2, mini_batch_size=2, seq_len=4096)
    ).mini_batches
    padded = next(mb for r in ranks for mb in r.micro_batches if mb.sample_indices == [1])
    assert padded.has_pixels and padded.images[-1].ref is None
    with torch.no_grad():
        inputs, out = run_packed(fam, padded)
        ref = reference_logprobs(fam, samples[2])
    assert inputs.pixel_values.shape[0] == 16 and not inputs.pixel_values.any()  # grid (1, 4, 4) of zeros
    assert (out.logprobs[: len(ref)] - ref).abs().max().item() <= TOL  # the real sample is untouched
    assert int(out.loss_mask.sum()) == padded.num_loss_tokens == 3

    # both micro-batches cross the wire (msgpack) and run the same on the receiving rank
    for packed in (mb, padded):
        back = rebuild_micro_batch(decode_microbatch(encode(packed.micro_batch)), fam.spec)
        with torch.no_grad():
            here, there = run_packed(fam, packed)[1], run_packed(fam, back)[1]
        assert torch.equal(here.logprobs, there.logprobs) and torch.equal(here.loss_mask, there.loss_mask)


def test_packed_inputs_tripwire(families):
    fam = families["qwen2_vl"]
    mb = pack_samples([chat([fam.refs["rocket"]], "x", "y", fam.tok)], fam.spec, seq_len=4096)
    mb = mb.micro_batches[0]
    m = materialize_micro_batch(mb, fam.spec, fam.config)
    short = {"pixel_values": m.features["pixel_values"][:-4], "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match="feature grids"):
        packed_inputs(m.packed, short, fam.model, fam.spec)
    with pytest.raises(ValueError, match="no features"):
        packed_inputs(m.packed, {}, fam.model, fam.spec)
    # a text token turned into the placeholder id behind the packer's back (what a stray
    # <|image_pad|> would do): N+1 placeholder tokens for N feature rows, caught before masked_scatter
    ids = list(m.packed.micro_batch.input_ids)
    ids[-2] = fam.tok
    forged = dataclasses.replace(
        m.packed, micro_batch=msgspec.structs.replace(m.packed.micro_batch, input_ids=ids)
    )
    n = m.packed.placeholder_count
    with pytest.raises(
        ValueError, match=rf"placeholder token id {fam.tok}: {n + 1} tokens .* but {n} feature rows"
    ):
        packed_inputs(forged, m.features, fam.model, fam.spec)


# --- GPU (skipped without CUDA) -------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_varlen_packed_matches_one_sample_at_a_time(families, family):
    fam = families[family]
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(fam.dir, dtype=torch.bfloat16).cuda().eval()
    backend = prepare_model_for_packing(model)
    assert backend in (VARLEN_ATTENTION, "flash_attention_2")
    samples = fam.samples()
    step = pack_samples(samples, fam.spec, seq_len=4096)
    worst = 0.0
    with torch.no_grad():
        for mb in step.micro_batches:
            m = materialize_micro_batch(mb, fam.spec, fam.config)
            inputs = packed_inputs(m.packed, m.features, model, fam.spec, image_index=m.image_index)
            out = packed_logprobs(model, inputs)
            alone = []
            for s in mb.slots:
                one = pack_samples([samples[s.sample_index]], fam.spec, seq_len=4096).micro_batches[0]
                mm = materialize_micro_batch(one, fam.spec, fam.config)
                alone.append(
                    packed_logprobs(
                        model,
                        packed_inputs(mm.packed, mm.features, model, fam.spec, image_index=mm.image_index),
                    ).logprobs
                )
            worst = max(worst, (out.logprobs - torch.cat(alone)).abs().max().item())
    print(
        f"\n{family} {backend} bf16 on {torch.cuda.get_device_name()}: packed vs alone max |d| = {worst:.2e}"
    )
    assert out.backend == backend
    assert worst == 0.0  # measured on a lent H100: varlen packed vs alone was bit-identical


@pytest.mark.gpu
@cuda
def test_gpu_refuses_sdpa_for_packed_batches(families):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(families["qwen2_vl"].dir, dtype=torch.bfloat16).cuda()
    with pytest.raises(PackingUnsupported, match="never sdpa"):
        prepare_model_for_packing(model, "sdpa")


def test_module_imports_without_cuda():
    """The attention module is import-safe on CPU: the varlen kernel is imported only when a packed CUDA
    batch runs, and registering it with transformers works without CUDA."""
    import trainer_lib.attention as fw

    assert fw.register_varlen_attention() == VARLEN_ATTENTION


def test_one_d_positions_restart_per_sample_and_only_mrope_types_get_packed_positions():
    samples = [chat([], "a" * n, "b", 261) for n in (3, 10, 1)]
    mb = pack_samples(
        samples, PackingSpec(placeholder_token_id=261, pad_token_id=PAD), seq_len=4096
    ).micro_batches[0]
    pos = one_d_positions(mb.seq_lens)
    assert pos.shape == (1, mb.num_tokens) and pos.dtype == torch.long
    assert pos[0].tolist() == [i for n in mb.seq_lens for i in range(n)]
    for model_type in ("kimi_k25", "kimi_vl", "llava"):  # Kimi is 1D RoPE and refuses to pack
        with pytest.raises(ValueError, match="no position convention"):
            build_position_ids(mb, types.SimpleNamespace(model_type=model_type))
    from transformers import AutoConfig, AutoModelForImageTextToText

    kimi = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(ensure_tiny_model("kimi_k25")))
    with pytest.raises(PackingUnsupported, match="not 'kimi_k25'"):
        check_packable(kimi)


def test_position_conventions_come_from_every_registered_adapter():
    """Every family in the adapter registry says how its language model takes positions; the MRoPE
    ones are exactly those transformers gives a ``get_rope_index`` (what the packed forward calls)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from protocol.adapters import ADAPTERS
    from trainer_lib.positions import mrope_model_types

    for model_type, cls in ADAPTERS.items():
        assert cls.rope in ("mrope", "1d"), model_type
        if cls.rope == "mrope":
            config = AutoConfig.for_model(model_type)
            assert hasattr(MODEL_MAPPING[type(config)], "get_rope_index"), model_type
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"} <= set(mrope_model_types())
    assert not {"kimi_vl", "kimi_k25"} & set(mrope_model_types())


def test_a_replaced_loss_mask_cannot_take_a_sample_start(families):
    """PACKING.md §1: ``num_loss_tokens`` equals the loss mask the forward returns, which drops
    each sample's first token (it has no logprob). A replacement with a loss there is refused;
    one without it is counted as the forward counts it."""
    fam = families["qwen2_vl"]
    samples = [chat([], "Hi", "yo", fam.tok), chat([], "Say", "ok", fam.tok)]
    (mb,) = pack_samples(samples, fam.spec, seq_len=4096).micro_batches
    starts = [slot.start for slot in mb.slots]
    assert len(starts) == 2 and starts[0] == 0
    with pytest.raises(ValueError, match="True at position 0, the first token of packed sample 0"):
        replace_loss_mask(mb, [True] * mb.num_tokens)  # counted 2 tokens the forward drops
    second = [i != 0 for i in range(mb.num_tokens)]
    with pytest.raises(ValueError, match=f"True at position {starts[1]}, the first token of packed sample 1"):
        replace_loss_mask(mb, second)
    ok = replace_loss_mask(mb, [i not in starts for i in range(mb.num_tokens)])
    with torch.no_grad():
        out = packed_logprobs(fam.model, packed_inputs(ok, {}, fam.model, fam.spec))
    assert ok.num_loss_tokens == int(out.loss_mask.sum()) == mb.num_tokens - 2
