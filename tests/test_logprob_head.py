"""trainer_lib.logprob_head: the chunked LM head that never keeps ``[L, vocab]`` logits.

The reference is the head as plain autograd computes it over the whole row at once (float32
logits, the temperature division, the suppressed columns filled, ``log_softmax``): the head before
issue 43 computed exactly this in chunks. Logprobs, entropy and every gradient (hidden states,
weight, bias; losses over logprobs, entropy or both) must agree in float32 on CPU, directly and
through ``packed_logprobs`` on the tiny Qwen2-VL and Qwen3.5 (whose hidden states come from the
real packed forward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import trainer_lib.forward as fw
from helpers import Family, run_packed
from trainer_lib import packed_logprobs, prepare_model_for_packing
from trainer_lib.logprob_head import SUPPRESSED_LOGIT, token_logprobs
from trainer_lib.planning.packing import pack_samples

ATOL = 1e-5
GRAD_RTOL = 1e-5


def reference_head(hidden, head, targets, *, temperature=1.0, suppressed=None, chunk_size=None):
    """Plain autograd over the whole row: float32 ``[N, V]`` logits kept for the backward."""
    z = head(hidden).float() / temperature
    if suppressed is not None:
        z = z.index_fill(-1, suppressed, SUPPRESSED_LOGIT)
    logp = F.log_softmax(z, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _grads(fn, head, hidden, targets, loss, **kw):
    head.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_(True)
    lp, ent = fn(h, head, targets, **kw)
    loss(lp, ent).backward()
    out = [lp.detach(), ent.detach(), h.grad, head.weight.grad]
    return out + ([head.bias.grad] if head.bias is not None else [])


LOSSES = {
    "logprobs": lambda lp, ent: (lp * torch.linspace(-1, 2, lp.numel())).sum(),
    "entropy": lambda lp, ent: (ent * torch.linspace(0.5, 1, ent.numel())).sum(),
    "both": lambda lp, ent: (lp.exp() * 0.3).sum() - 0.01 * ent.sum() + lp[::3].sum(),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize(
    ("temperature", "chunk", "bias"), [(1.0, 7, False), (0.7, 64, True), (1.3, 1000, False)]
)
def test_head_matches_plain_autograd(loss, temperature, chunk, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 97, bias=bias)
    hidden = torch.randn(150, 32) * 2
    targets = torch.randint(0, 97, (150,))
    suppressed = torch.tensor([3, 50, 96])
    targets[::11] = 50  # a suppressed target (a prompt placeholder): finite, its logit fixed
    kw = dict(temperature=temperature, suppressed=suppressed)
    got = _grads(token_logprobs, head, hidden, targets, LOSSES[loss], chunk_size=chunk, **kw)
    want = _grads(reference_head, head, hidden, targets, LOSSES[loss], **kw)
    assert torch.isfinite(got[0]).all() and got[0].dtype == got[1].dtype == torch.float32
    # rtol: a suppressed target's logprob is ~-1e4, where one float32 step is 1e-3
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=ATOL)
    assert torch.allclose(got[1], want[1], atol=ATOL)
    for g, w in zip(got[2:], want[2:], strict=True):
        assert relative(g, w) <= GRAD_RTOL, (loss, relative(g, w))
    assert got[3][suppressed].abs().max() == 0  # suppressed logits are constants: no gradient


def test_head_keeps_no_logits_for_the_backward():
    """Bytes autograd saves during the forward (``saved_tensors_hooks``): the reference keeps the
    float32 ``[N, V]`` logits; the chunked head keeps its inputs and three float32 ``[N]``."""
    torch.manual_seed(0)
    n, hid, vocab = 2048, 16, 1024
    head = torch.nn.Linear(hid, vocab, bias=False)
    hidden = torch.randn(n, hid, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))

    def saved(fn, **kw) -> int:
        total = 0
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            key = t.untyped_storage().data_ptr()
            if key not in seen and key not in (hidden.data_ptr(), head.weight.data_ptr()):
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(hidden, head, targets, **kw)
        return total

    logits_bytes = n * vocab * 4
    assert saved(reference_head) >= logits_bytes
    assert saved(token_logprobs, chunk_size=128) <= 3 * n * 4 + n * 8  # lse, entropy, logprobs; targets


def test_head_refuses_bad_arguments():
    head = torch.nn.Linear(8, 16)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(torch.zeros(4, 8), head, torch.zeros(4, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="do not fit"):
        token_logprobs(torch.zeros(4, 9), head, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="linear layer"):
        token_logprobs(torch.zeros(4, 8), torch.nn.Identity(), torch.zeros(4, dtype=torch.long))


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("head") / "run_6" / "assets"
    out = {name: Family(name, root) for name in ("qwen2_vl", "qwen3_5")}
    for fam in out.values():
        prepare_model_for_packing(fam.model)
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_packed_forward_head_matches_the_plain_head(families, family, monkeypatch):
    """Through ``packed_logprobs`` (tiny model, photos, T=0.7, the placeholder suppressed): the
    chunked head vs the plain-autograd head on the same packed hidden states; every parameter's
    gradient of a loss over logprobs and entropy."""
    fam = families[family]
    (mb,) = pack_samples(fam.samples()[:4], fam.spec, seq_len=4096).micro_batches
    kw = dict(temperature=0.7, suppressed_token_ids=[fam.tok], chunk_size=16)

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        fam.model.zero_grad(set_to_none=True)
        inputs, _ = run_packed(fam, mb)
        out = packed_logprobs(fam.model, inputs, **kw)
        mask = out.loss_mask
        ((out.logprobs * mask).sum() + 0.1 * (out.entropy * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in fam.model.named_parameters() if p.grad is not None}
        return out.logprobs.detach(), out.entropy.detach(), grads

    lp, ent, grads = run()
    monkeypatch.setattr(fw, "token_logprobs", reference_head)
    lp_ref, ent_ref, grads_ref = run()
    assert grads.keys() == grads_ref.keys() and len(grads) > 20
    assert torch.allclose(lp, lp_ref, rtol=1e-6, atol=ATOL) and torch.allclose(ent, ent_ref, atol=ATOL)
    assert float(ent.max()) > 1.0  # a real distribution: random weights, vocab 512
    flat, flat_ref = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (grads, grads_ref))
    # each parameter against its own norm, floored at 1e-4 of the whole gradient: Qwen3.5's
    # layer-0 delta-rule decay (A_log, dt_bias) has gradients ~1e-5 of the others', where float32
    # summation order alone moves them by ~1e-4 of themselves (1e-9 absolute)
    floor = 1e-4 * float(flat_ref.norm())
    worst = max(
        float((grads[k] - grads_ref[k]).norm()) / max(float(grads_ref[k].norm()), floor) for k in grads
    )
    print(
        f"\n{family}: chunked vs plain head, max |d entropy| {(ent - ent_ref).abs().max():.2e}; "
        f"gradients relative {relative(flat, flat_ref):.2e} (worst parameter {worst:.2e})"
    )
    assert relative(flat, flat_ref) <= GRAD_RTOL and worst <= 10 * GRAD_RTOL


# --- GPU (skipped without CUDA; scripts/gpu_check.sh runs it) ------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_head_at_qwen2_vl_2b_shapes():
    """bf16 on CUDA at Qwen2-VL-2B's head (hidden 1536, vocab 151,936), 8192 tokens: the chunked
    head against the plain one on the same bf16 weights (logprobs and gradients within bf16
    rounding of the logits), and at most 1/8 of its peak memory."""
    torch.manual_seed(0)
    head = torch.nn.Linear(1536, 151936, bias=False, dtype=torch.bfloat16, device="cuda")
    hidden = torch.randn(8192, 1536, dtype=torch.bfloat16, device="cuda")
    targets = torch.randint(0, 151936, (8192,), device="cuda")
    kw = dict(temperature=0.7, suppressed=torch.tensor([151655], device="cuda"))
    peaks = []
    results = []
    for fn in (reference_head, token_logprobs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results.append(_grads(fn, head, hidden, targets, LOSSES["both"], **kw))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    want, got = results
    d_lp = float((got[0] - want[0]).abs().max())
    rel = [relative(g.float(), w.float()) for g, w in zip(got[2:], want[2:], strict=True)]
    name = torch.cuda.get_device_name()
    print(f"\nbf16 head on {name}: max |d logprob| {d_lp:.2e}, gradients {rel}, peak bytes {peaks}")
    assert d_lp <= 5e-2 and max(rel) <= 2e-2
    assert 8 * peaks[1] <= peaks[0]
