"""trainer_lib.mismatch and the logprob facts the rollout client relies on: suppressed token ids out
of the trainer's softmax, and the sampling temperature carried on each sample (tiny Qwen2-VL, fp32,
real photos)."""

from __future__ import annotations

import logging
import math

import msgspec
import pytest
import torch
import torch.nn.functional as F

from helpers import Family, chat
from trainer_lib import (
    SUPPRESSED_LOGIT,
    LogprobOptions,
    check_sampling_temperature,
    logprob_mismatch,
    materialize,
    pack_samples,
    packed_inputs,
    packed_logprobs,
    prepare_model_for_packing,
    recompute_logprobs,
)


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> Family:
    fam = Family("qwen2_vl", tmp_path_factory.mktemp("mis") / "run_5" / "assets")
    prepare_model_for_packing(fam.model)
    return fam


def samples_of(fam: Family, temperature: float | None = None):
    r, t = fam.refs, fam.tok
    samples = [
        chat([r["coffee"]], "Describe.", "A cup of coffee.", t),
        chat([], "Say hi.", "Hi there.", t),
        chat([r["astronaut"], r["rocket"]], "Both?", "yes", t),
    ]
    return [msgspec.structs.replace(s, sampling_temperature=temperature) for s in samples]


def unpacked_suppressed(fam: Family, sample, temperature: float, ids: list[int]) -> torch.Tensor:
    """transformers' own unpacked forward of one sample; logits / T, the ids at -inf (what the
    server's ``logit_bias`` -100 leaves of them), log-softmax, the next token's logprob."""
    tokens = torch.tensor([sample.input_ids])
    kwargs = {}
    if sample.mm_refs:
        feats = materialize([sample], fam.adapter, fam.root).features
        kwargs = dict(
            pixel_values=feats["pixel_values"],
            image_grid_thw=feats["image_grid_thw"],
            mm_token_type_ids=(tokens == fam.tok).int(),
        )
    with torch.no_grad():
        logits = fam.model(input_ids=tokens, use_cache=False, **kwargs).logits[0, :-1].float() / temperature
    logits[:, ids] = float("-inf")
    lp = F.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_suppressed_ids_leave_the_softmax_after_the_temperature(fam, temperature):
    samples = samples_of(fam, temperature)
    ids = [fam.tok]
    got = recompute_logprobs(
        samples,
        fam.model,
        fam.spec,
        fam.config,
        LogprobOptions(seq_len=4096, temperature=temperature, suppressed_token_ids=ids),
    )
    plain = recompute_logprobs(
        samples, fam.model, fam.spec, fam.config, LogprobOptions(seq_len=4096, temperature=temperature)
    )
    for sample, (lp, mask), (lp_plain, _) in zip(samples, got, plain, strict=True):
        want = unpacked_suppressed(fam, sample, temperature, ids)
        assert (lp[mask] - want[mask]).abs().max().item() < 1e-5
        assert torch.isfinite(lp).all()  # a prompt's placeholder position: finite, never NaN under a mask
        shift = (lp - lp_plain)[mask]  # each loss token rises by -log(1 - p_placeholder) > 0
        assert (shift > 0).all() and shift.max().item() < 0.1


def test_suppressed_ids_are_checked_against_the_vocabulary(fam):
    (mb,) = pack_samples(samples_of(fam)[1:2], fam.spec, seq_len=4096).micro_batches
    inputs = packed_inputs(mb, {}, fam.model, fam.spec)
    vocab = fam.model.get_output_embeddings().weight.shape[0]
    for bad in ([vocab], [-1]):
        with pytest.raises(ValueError, match="suppressed_token_ids"):
            packed_logprobs(fam.model, inputs, suppressed_token_ids=bad)
    with torch.no_grad():
        out = packed_logprobs(fam.model, inputs, suppressed_token_ids=[fam.tok, fam.tok])
    assert torch.isfinite(out.logprobs).all() and SUPPRESSED_LOGIT == -1.0e4


def test_recompute_warns_when_samples_were_sampled_at_another_temperature(fam, caplog):
    samples = samples_of(fam, 1.0)
    samples[2] = msgspec.structs.replace(samples[2], sampling_temperature=0.0)  # greedy: compared at 1
    with caplog.at_level(logging.WARNING, logger="trainer_lib.mismatch"):
        recompute_logprobs(samples, fam.model, fam.spec, fam.config, LogprobOptions(seq_len=4096))
        assert not caplog.records
        hot = LogprobOptions(seq_len=4096, temperature=0.7)
        recompute_logprobs(samples, fam.model, fam.spec, fam.config, hot)
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "temperature 0.7" in message and "3 of 3 sample(s)" in message and "3 at 1" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_lib.mismatch"):
        assert check_sampling_temperature(samples_of(fam, None), 0.7)  # unknown: nothing to compare
        mixed = [*samples_of(fam, 1.0)[:1], *samples_of(fam, 0.5)[:2]]
        assert not check_sampling_temperature(mixed, 1.0)
    (record,) = caplog.records
    assert "2 of 3 sample(s)" in record.getMessage() and "2 at 0.5" in record.getMessage()


@pytest.mark.parametrize("bad", [0.0, -0.7, float("nan"), float("inf")])
def test_a_temperature_logits_cannot_be_divided_by_is_refused(fam, bad, caplog):
    """Greedy (``sampling_temperature=0.0``) passed as is gave -inf/NaN logprobs, a negative one an
    inverted distribution: both refused, the message naming what a greedy sample's caller passes,
    before any packing or warning; 1.0 (greedy is compared unscaled) gives finite logprobs."""
    greedy = [msgspec.structs.replace(s, sampling_temperature=0.0) for s in samples_of(fam)]
    (mb,) = pack_samples(greedy[1:2], fam.spec, seq_len=4096).micro_batches
    inputs = packed_inputs(mb, {}, fam.model, fam.spec)
    with pytest.raises(ValueError, match=r"finite and > 0.*greedy.*temperature=1\.0"):
        packed_logprobs(fam.model, inputs, temperature=bad)
    with caplog.at_level(logging.WARNING, logger="trainer_lib.mismatch"):
        with pytest.raises(ValueError, match=r"finite and > 0.*greedy.*temperature=1\.0"):
            recompute_logprobs(
                greedy, fam.model, fam.spec, fam.config, LogprobOptions(seq_len=4096, temperature=bad)
            )
        assert not caplog.records
        out = recompute_logprobs(greedy, fam.model, fam.spec, fam.config, LogprobOptions(seq_len=4096))
        assert not caplog.records  # greedy is compared at 1.0
    assert all(torch.isfinite(lp).all() for lp, _ in out)


def test_an_integer_mask_is_refused_not_used_as_indices():
    """An int64 0/1 mask (verl's response_mask) would gather positions 0 and 1: a false perfect
    match on these logprobs, which differ by 0.5 on the masked tokens."""
    trainer = torch.tensor([0.0, -1.0, -2.0, -3.0])
    inference = torch.tensor([0.0, -1.0, -2.5, -3.5])
    ints = torch.tensor([0, 0, 1, 1])
    for mask in (ints, ints.int(), ints.float()):
        with pytest.raises(ValueError, match=r"mask must be bool.*mask\.bool\(\)"):
            logprob_mismatch(trainer, inference, mask)
    stats = logprob_mismatch(trainer, inference, ints.bool())
    assert stats.tokens == 2 and stats.max_abs == 0.5 and stats.mean_abs == 0.5
    assert stats.k3_kl == pytest.approx(math.expm1(0.5) - 0.5)
