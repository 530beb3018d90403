"""Dedup by default (issue 29): each distinct image decoded once per step and run through the vision
tower once per micro-batch, with logprobs and gradients equal to the per-slot path's (every image
slot its own copy and its own vision forward), fp32, on every served family that packs: tiny
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, real photos.
"""

from __future__ import annotations

import pytest

from helpers import Family, chat, forward_backward
from trainer_lib import (
    materialize_micro_batch,
    pack_samples,
    prepare_model_for_packing,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-5
"""Per parameter: ||g_dedup - g_per_slot|| <= GRAD_RTOL * ||g_per_slot|| (fp32 sums in another order)."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dedup") / "run_6" / "assets"


def group_samples(fam: Family):
    """An RL group of 4 sharing one photo, a sample showing that photo beside another, text only."""
    r, t = fam.refs, fam.tok
    group = [chat([r["coffee"]], "Describe.", f"answer number {k}", t) for k in range(4)]
    return [*group, chat([r["astronaut"], r["coffee"]], "Both?", "yes, both", t), chat([], "hi", "hello", t)]


@pytest.mark.parametrize("family", FAMILIES)
def test_dedup_equals_the_per_slot_path_in_logprobs_and_every_gradient(root, family):
    fam = Family(family, root / family)
    prepare_model_for_packing(fam.model)
    (mb,) = pack_samples(group_samples(fam), fam.spec, seq_len=4096).micro_batches
    per_slot = materialize_micro_batch(mb, fam.spec, fam.config, dedup=False)
    dedup = materialize_micro_batch(mb, fam.spec, fam.config)  # the default
    assert dedup.image_index.tolist() == [0, 0, 0, 0, 1, 0] and per_slot.image_index is None
    assert len(dedup.features["image_grid_thw"]) == 2 and len(per_slot.features["image_grid_thw"]) == 6

    lp_slot, g_slot, rows_slot = forward_backward(fam, per_slot)
    lp_dedup, g_dedup, rows_dedup = forward_backward(fam, dedup)
    assert rows_dedup == [dedup.features["pixel_values"].shape[0]]  # one vision forward, distinct images
    assert rows_slot == [per_slot.features["pixel_values"].shape[0]] and rows_dedup[0] * 2 < rows_slot[0]
    assert (lp_dedup - lp_slot).abs().max().item() <= LOGPROB_TOL
    assert g_dedup.keys() == g_slot.keys() and any("visual" in n for n in g_dedup)
    worst = max(((g_dedup[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in g_slot.items())
    assert worst <= GRAD_RTOL, worst


def test_each_distinct_image_is_decoded_once_per_step(root, monkeypatch):
    """One ``resolved`` dict for a step's micro-batches: the second micro-batch showing the same
    photo processes nothing (the cap splits the group over two micro-batches)."""
    fam = Family("qwen2_vl", root / "step")
    calls = []
    original = fam.adapter.process

    def counting(image, **kw):
        calls.append(image.size)
        return original(image, **kw)

    monkeypatch.setattr(fam.adapter, "process", counting)
    samples = group_samples(fam)[:4]
    step = pack_samples(samples, fam.spec, seq_len=4096, micro_batch_max_tokens=len(samples[0].input_ids) * 2)
    assert step.num_micro_batches == 2
    resolved: dict = {}
    stats = [
        materialize_micro_batch(mb, fam.spec, fam.config, resolved=resolved).stats
        for mb in step.micro_batches
    ]
    assert len(calls) == 1 and [s.processed for s in stats] == [1, 0] and len(resolved) == 1
    materialize_micro_batch(step.micro_batches[0], fam.spec, fam.config)  # no shared dict: decoded again
    assert len(calls) == 2


def test_a_forward_without_image_embeddings_gets_one_copy_per_slot(root, monkeypatch):
    """transformers 5.17's Qwen3.5 forward has no ``mm_encoder_outputs`` (seen on a lent GPU): the
    deduplicated features are gathered back to one copy per slot, with a warning, and give the
    per-slot path's logprobs and gradients (the vision tower then sees every slot's rows)."""
    fam = Family("qwen2_vl", root / "no_embeddings")
    prepare_model_for_packing(fam.model)
    (mb,) = pack_samples(group_samples(fam), fam.spec, seq_len=4096).micro_batches
    per_slot = materialize_micro_batch(mb, fam.spec, fam.config, dedup=False)
    lp_slot, g_slot, rows_slot = forward_backward(fam, per_slot)
    real = fam.model.model.forward

    def forward(input_ids, **kw):  # the signature of a forward without mm_encoder_outputs
        assert "mm_encoder_outputs" not in kw
        return real(input_ids=input_ids, **kw)

    monkeypatch.setattr(fam.model.model, "forward", forward)
    dedup = materialize_micro_batch(mb, fam.spec, fam.config)
    with pytest.warns(RuntimeWarning, match="once per image slot"):
        lp, grads, rows = forward_backward(fam, dedup)
    assert rows == rows_slot and (lp - lp_slot).abs().max().item() <= LOGPROB_TOL
    worst = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in g_slot.items())
    assert grads.keys() == g_slot.keys() and worst <= GRAD_RTOL, worst
