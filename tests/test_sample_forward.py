"""``trainer_lib.sample_logprobs``: per-sample logprobs (and entropies) of rows through the packed
forward, with gradients, against transformers' own forward one sample at a time (tiny Qwen2-VL, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import Family, chat, photo_bytes
from protocol.adapters import offload_image
from protocol.refs import file_uri_to_path, parse_ref
from trainer_lib import (
    LogprobOptions,
    MaterializeConfig,
    materialize,
    prepare_model_for_packing,
    recompute_logprobs,
    sample_logprobs,
)


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> Family:
    family = Family("qwen2_vl", tmp_path_factory.mktemp("sample-forward"))
    prepare_model_for_packing(family.model)
    return family


def reference(fam: Family, sample, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' unpacked forward of one sample: (logprob of token t, entropy at t), 0 at t = 0."""
    ids = torch.tensor([sample.input_ids])
    kwargs = {}
    if sample.mm_refs:
        feats = materialize([sample], fam.adapter, fam.root, dedup=False).features
        kwargs = dict(
            pixel_values=feats["pixel_values"],
            image_grid_thw=feats["image_grid_thw"],
            mm_token_type_ids=(ids == fam.tok).int(),
        )
    logits = fam.model(input_ids=ids, use_cache=False, **kwargs).logits[0, :-1].float() / temperature
    logp = F.log_softmax(logits, -1)
    picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros(1)
    return torch.cat([zero, picked]), torch.cat([zero, entropy])


def grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_rows_equal_one_sample_at_a_time_with_entropy_and_gradients(fam):
    samples = fam.samples()
    options = LogprobOptions(seq_len=2048, temperature=0.7, compute_entropy=True)
    forward = sample_logprobs(samples, fam.model, fam.spec, fam.config, options)
    assert forward.micro_batches == 1 and forward.zeroed == []
    weights = [torch.linspace(0.5, 1.5, len(s.input_ids)) for s in samples]  # a loss that tells rows apart
    packed_loss = sum(
        (r.logprobs * w * r.loss_mask).sum() + 0.1 * r.entropy.sum()
        for r, w in zip(forward.samples, weights, strict=True)
    )
    refs = [reference(fam, s, 0.7) for s in samples]
    for (lp, ent), r, s in zip(refs, forward.samples, samples, strict=True):
        assert r.logprobs.shape == (len(s.input_ids),) and r.loss_mask.tolist() == s.loss_mask
        assert torch.allclose(r.logprobs.detach(), lp.detach(), atol=2e-5)
        assert torch.allclose(r.entropy.detach(), ent.detach(), atol=2e-5)
    got = grads(fam.model, packed_loss)
    mask = [torch.tensor(s.loss_mask) for s in samples]
    ref_loss = sum(
        (lp * w * m).sum() + 0.1 * ent.sum() for (lp, ent), w, m in zip(refs, weights, mask, strict=True)
    )
    want = grads(fam.model, ref_loss)
    assert got.keys() == want.keys()
    rel = torch.sqrt(
        sum(((got[k] - want[k]) ** 2).sum() for k in want) / sum((w**2).sum() for w in want.values())
    )
    assert rel < 1e-4


def test_recompute_logprobs_is_the_same_forward_without_gradients(fam):
    samples = fam.samples()
    per_sample = recompute_logprobs(samples, fam.model, fam.spec, fam.config, LogprobOptions(seq_len=2048))
    forward = sample_logprobs(samples, fam.model, fam.spec, fam.config, LogprobOptions(seq_len=2048))
    for (lp, m), r in zip(per_sample, forward.samples, strict=True):
        assert not lp.requires_grad and torch.equal(lp, r.logprobs.detach().cpu())
        assert torch.equal(m, r.loss_mask.cpu())


def test_a_missing_image_zeroes_that_sample_only(fam, tmp_path):
    ref = offload_image(photo_bytes("coffee", fmt="PNG", size=(80, 52)), tmp_path, fam.adapter)
    samples = [chat([], "Say hi.", "Hi there.", fam.tok), chat([ref], "What?", "A cup.", fam.tok)]
    Path(file_uri_to_path(parse_ref(ref.ref).raw_image_uri)).unlink()
    config = MaterializeConfig(asset_root=tmp_path)
    forward = sample_logprobs(samples, fam.model, fam.spec, config, LogprobOptions(seq_len=2048))
    assert forward.zeroed == [1] and not forward.samples[1].loss_mask.any()
    assert forward.samples[0].loss_mask.tolist() == samples[0].loss_mask
    assert forward.stats.placeholders == 1 and forward.stats.zeroed_samples == 1
