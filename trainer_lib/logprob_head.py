"""The LM head of the packed forward: per-token logprobs and entropy, never an ``[L, vocab]`` tensor kept.

:func:`token_logprobs` runs the output projection over the hidden states in ``chunk_size``-token
chunks and keeps, per token, only the selected token's logprob, the entropy and the log-partition
(``logsumexp``): float32 ``[L]`` each. Its backward (a ``torch.autograd.Function``) recomputes each
chunk's logits from the saved hidden states and the head's weight, so autograd never holds the
float32 logits (``4 * vocab`` bytes per token: 9.96 GB for a 16k-token micro-batch at Qwen's
151,936-token vocabulary; docs/PACKING.md §6). The same design as liger-kernel's
``_ChunkedSelectiveLogProbFunction`` (``src/liger_kernel/chunked_loss/fused_linear_ppo.py``: chunked
forward keeping ``log_z``, chunked recompute in backward), extended by what the trainer needs and
liger's head lacks: the suppressed token ids out of the softmax and the entropy with its gradient
(docs/DESIGN-DECISIONS.md, "Issue 43").

Per chunk of ``n`` tokens (``h [n, H]``, head weight ``W [V, H]``, bias ``b``):

- ``z = (h @ W.T + b).float() / T``, then ``z[:, suppressed] = SUPPRESSED_LOGIT`` (the order and
  float32 cast of the head before issue 43); ``lse = logsumexp(z)``;
- ``logprob = z[target] - lse``; ``entropy = lse - sum(p * z)``, ``p = exp(z - lse)``;
- backward, given ``g`` (logprobs) and ``e`` (entropy): ``dz = g * (onehot(target) - p) -
  e * p * (z - lse + entropy)`` (``d entropy / dz_k = -p_k (log p_k + entropy)``), zero at the
  suppressed columns (their logits are constants), ``dz / T`` cast to the head's dtype, then
  ``dh = dz @ W``, ``dW += dz.T @ h`` (summed in place in the weight's dtype, as autograd sums the
  chunks of a head run in chunks: no weight-sized temporary), ``db += dz.sum(0)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_CHUNK_SIZE", "SUPPRESSED_LOGIT", "token_logprobs"]

SUPPRESSED_LOGIT = -1.0e4
"""The logit a suppressed token gets (after the temperature division): ``exp`` of it relative to
any real logit is 0 in float32, like the server's ``logit_bias`` of -100 (``e^-100``), and unlike
``-inf`` it keeps the logprob of a prompt position whose token is suppressed (the image
placeholder) finite: no NaN where a loss mask multiplies it by 0."""

DEFAULT_CHUNK_SIZE = 512
"""Tokens per chunk: the transient float32 logits of one chunk are ``512 * 4 * vocab`` bytes
(311 MB at Qwen's vocabulary, against 9.96 GB kept for a whole 16k micro-batch before), and 512
rows keep the head's matmul compute-bound on a GPU (the weight is read once per chunk)."""


def _logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    suppressed: torch.Tensor | None,
) -> torch.Tensor:
    """float32 ``[n, V]``: ``(hidden @ weight.T + bias).float() / temperature``, suppressed columns
    at :data:`SUPPRESSED_LOGIT`."""
    z = F.linear(hidden, weight, bias).float().div_(temperature)  # a fresh tensor: in place
    if suppressed is not None:
        z.index_fill_(-1, suppressed, SUPPRESSED_LOGIT)
    return z


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]``: ``lse - sum(softmax(z) * z)``, the entropy of ``softmax(z)``."""
    p = (z - lse[:, None]).exp_()
    return lse - p.mul_(z).sum(-1)


class _ChunkedLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, targets int64 [N])`` -> float32 ``[N]``
    logprobs and float32 ``[N]`` entropy; see the module docstring for the arithmetic."""

    @staticmethod  # over 6 parameters by design: autograd.Function.forward takes its inputs positionally
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        suppressed: torch.Tensor | None,
        temperature: float,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for lo in range(0, n, chunk_size):
            hi = min(lo + chunk_size, n)
            z = _logits(hidden[lo:hi], weight, bias, temperature, suppressed)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            logprobs[lo:hi] = z.gather(-1, targets[lo:hi, None]).squeeze(-1) - lse[lo:hi]
            entropy[lo:hi] = _entropy(z, lse[lo:hi])
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, suppressed, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: skipped
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple:
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        hidden, weight, bias, targets, suppressed, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None  # summed in place: no [V, H] temporary
        grad_b = torch.zeros_like(bias) if need_b else None
        for lo in range(0, hidden.shape[0], ctx.chunk_size):
            hi = min(lo + ctx.chunk_size, hidden.shape[0])
            dz = _grad_logits(
                _logits(hidden[lo:hi], weight, bias, ctx.temperature, suppressed),
                targets[lo:hi],
                lse[lo:hi],
                entropy[lo:hi],
                None if grad_logprobs is None else grad_logprobs[lo:hi],
                None if grad_entropy is None else grad_entropy[lo:hi],
            )
            if suppressed is not None:
                dz.index_fill_(-1, suppressed, 0.0)
            dz = dz.div_(ctx.temperature).to(weight.dtype)
            if grad_h is not None:
                torch.mm(dz, weight, out=grad_h[lo:hi])
            if grad_w is not None:
                grad_w.addmm_(dz.T, hidden[lo:hi])
            if grad_b is not None:
                grad_b += dz.sum(0)
            del dz  # before the next chunk's logits exist
        return grad_h, grad_w, grad_b, None, None, None, None


def _grad_logits(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """float32 ``[n, V]`` gradient of the loss w.r.t. the tempered logits ``z`` (overwrites ``z``):
    ``g * (onehot - p) - e * p * (log p + entropy)``."""
    logp = z.sub_(lse[:, None])
    p = torch.exp(logp)
    if grad_entropy is not None:
        dz = logp.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
        if grad_logprobs is not None:
            dz.sub_(p.mul_(grad_logprobs[:, None]))
    else:
        dz = p.mul_(-grad_logprobs[:, None])
    if grad_logprobs is not None:
        dz.scatter_add_(-1, targets[:, None], grad_logprobs[:, None])
    return dz


def token_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    suppressed: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` and the entropy under ``softmax(head(hidden) / temperature)``.

    Args:
        hidden: ``[N, H]`` in the head's dtype (the positions predicting ``targets``).
        head: the model's output projection, an ``nn.Linear`` ``[V, H]`` (its ``weight`` and
            ``bias`` are read directly: under FSDP2 call this inside the module's unsharded forward).
        targets: int64 ``[N]`` token ids in ``[0, V)``.
        temperature: finite and > 0 (checked by the caller, :func:`trainer_lib.check_temperature`).
        suppressed: int64 ``[k]`` distinct token ids whose logits become :data:`SUPPRESSED_LOGIT`
            after the temperature division, before the softmax; None for none.
        chunk_size: tokens per chunk (>= 1).

    Returns:
        ``(logprobs, entropy)``: float32 ``[N]`` each, differentiable w.r.t. ``hidden`` and the
        head's parameters. Memory kept for the backward: ``hidden`` (already alive) and three
        float32 ``[N]``; each chunk's ``[chunk_size, V]`` logits exist only while it runs.

    Raises:
        ValueError: ``chunk_size`` < 1, ``head`` without a 2-D ``weight``, or shapes that disagree.
    """
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ValueError(f"the LM head must be a linear layer with a [vocab, hidden] weight, got {head!r}")
    if hidden.ndim != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} / targets {tuple(targets.shape)} do not fit a head of "
            f"weight {tuple(weight.shape)}"
        )
    return _ChunkedLogprobs.apply(hidden, weight, bias, targets, suppressed, float(temperature), chunk_size)
