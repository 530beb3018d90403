"""Activation checkpointing of the packed forward (``prepare_model_for_packing(activation_checkpointing=)``).

transformers' own gradient checkpointing (non-reentrant) over the language decoder layers and the
vision blocks, with the packed paths underneath (sdpa's per-sample mask from the positions,
Qwen3.5's per-segment Gated DeltaNet): every parameter's gradient equals the uncheckpointed one in
float32, and the checkpointing is shown to run (each checkpointed layer's forward runs again in the
backward, and autograd keeps fewer bytes), so the test fails if it silently stops.
"""

from __future__ import annotations

import pytest
import torch

from helpers import Family, run_packed
from trainer_lib import prepare_model_for_packing
from trainer_lib.planning.packing import pack_samples

FAMILIES = ("qwen2_vl", "qwen3_vl", "qwen3_5")
GRAD_RTOL = 1e-6


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("ckpt") / "run_7" / "assets"
    return {name: Family(name, root) for name in FAMILIES}


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language decoder layers and vision blocks (what transformers checkpoints)."""
    return [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "VisionBlock"))]


def _step(fam: Family, mb) -> tuple[dict[str, torch.Tensor], int, int, bool]:
    """One packed fwd+bwd in training mode: every parameter's gradient, the layers' forward calls,
    the bytes autograd saved, and what the result says about checkpointing."""
    calls = 0
    saved = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    # a pre-hook: torch's non-reentrant recomputation stops once it has what the backward needs,
    # before a layer's forward returns (forward hooks would not see it)
    hooks = [layer.register_forward_pre_hook(count) for layer in _layers(fam.model)]
    fam.model.train()
    fam.model.zero_grad(set_to_none=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, out = run_packed(fam, mb)
        mask = out.loss_mask
        ((out.logprobs * mask).sum() - 0.05 * (out.entropy * mask).sum()).backward()
    finally:
        fam.model.eval()
        for h in hooks:
            h.remove()
    grads = {n: p.grad.clone() for n, p in fam.model.named_parameters() if p.grad is not None}
    return grads, calls, saved, out.activation_checkpointing


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_gradients_equal_plain_ones_and_checkpointing_runs(families, family):
    fam = families[family]
    step = pack_samples(fam.samples(), fam.spec, seq_len=4096, micro_batch_max_tokens=600)
    mb = next(mb for mb in step.micro_batches if mb.has_pixels and mb.sample_count >= 2)
    prepare_model_for_packing(fam.model, activation_checkpointing=False)
    plain, plain_calls, plain_saved, plain_flag = _step(fam, mb)
    prepare_model_for_packing(fam.model)  # the default: on
    assert fam.model.is_gradient_checkpointing
    try:
        ckpt, ckpt_calls, ckpt_saved, ckpt_flag = _step(fam, mb)
    finally:
        prepare_model_for_packing(fam.model, activation_checkpointing=False)
    n_layers = len(_layers(fam.model))
    flat = torch.cat([plain[k].flatten() for k in sorted(plain)])
    diff = torch.cat([(ckpt[k] - plain[k]).flatten() for k in sorted(plain)])
    rel = float(diff.norm() / flat.norm())
    print(
        f"\n{family}: {n_layers} layers; forward calls {plain_calls} -> {ckpt_calls}, saved bytes "
        f"{plain_saved:,} -> {ckpt_saved:,}; gradients relative {rel:.2e}"
    )
    assert (plain_flag, ckpt_flag) == (False, True)
    assert ckpt.keys() == plain.keys() and len(plain) > 20
    assert plain_calls == n_layers and ckpt_calls == 2 * n_layers  # every layer recomputed once
    assert ckpt_saved < plain_saved / 2
    assert rel <= GRAD_RTOL


def test_checkpointing_stays_off_outside_training(families):
    """transformers checkpoints in training mode only: an eval-mode forward reports it off."""
    fam = families["qwen2_vl"]
    (mb,) = pack_samples(fam.samples()[:2], fam.spec, seq_len=4096).micro_batches
    prepare_model_for_packing(fam.model)
    try:
        assert fam.model.is_gradient_checkpointing and not fam.model.training
        assert run_packed(fam, mb)[1].activation_checkpointing is False
        with torch.no_grad():
            fam.model.train()
            assert run_packed(fam, mb)[1].activation_checkpointing is False
    finally:
        fam.model.eval()
        prepare_model_for_packing(fam.model, activation_checkpointing=False)
