"""The LM head before issue 43, and the head's peak memory measured side by side (bench/packed_forward.py).

:func:`old_token_logprobs` is ``trainer_lib.forward._token_logprobs`` / ``_chunk_logprobs`` as
they were at commit 4539399 (4096-token chunks, float32 log-softmax through plain autograd, so
each chunk's float32 logits are kept for the backward unless ``checkpoint_lm_head`` recomputed
them with ``torch.utils.checkpoint``; no entropy), in the signature of today's
``trainer_lib.logprob_head.token_logprobs`` so that the packed-forward bench can swap it in.
:func:`head_peaks` runs one forward + backward of each head on the same random hidden states and
reports the bytes it allocated at its peak: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU
(no allocator statistics) :class:`LiveBytes`, a ``TorchDispatchMode`` that counts every storage an
operator creates until it is freed: the way ``torch.distributed._tools.mem_tracker.MemTracker``
tracks CPU tensors, without its module hooks (which refuse a module called twice in one region:
the head's chunks, the recomputation of checkpointed layers).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer_lib.logprob_head import SUPPRESSED_LOGIT, token_logprobs

OLD_CHUNK = 4096


def _old_chunk(head, hidden, targets, temperature, suppressed):
    logits = head(hidden).float() / temperature
    if suppressed is not None:
        logits = logits.index_fill(-1, suppressed, SUPPRESSED_LOGIT)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def old_token_logprobs(
    hidden, head, targets, *, temperature=1.0, suppressed=None, chunk_size=None, recompute=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-issue-43 head: ``(logprobs [N], zeros [N])`` (it computed no entropy)."""
    pieces = []
    for lo in range(0, hidden.shape[0], OLD_CHUNK):
        args = (head, hidden[lo : lo + OLD_CHUNK], targets[lo : lo + OLD_CHUNK], temperature, suppressed)
        if recompute:
            pieces.append(torch.utils.checkpoint.checkpoint(_old_chunk, *args, use_reentrant=False))
        else:
            pieces.append(_old_chunk(*args))
    logprobs = torch.cat(pieces)
    return logprobs, torch.zeros_like(logprobs)


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU storages created by operators inside the mode and still alive; ``peak``
    their maximum. An output sharing an input's storage (a view, an in-place op) is no new
    storage; storages made before the mode are not counted (nor freed from the count)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self._alive.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key in self._alive or storage.data_ptr() in inputs:
                    continue
                nbytes = storage.nbytes()
                self._alive[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._freed(k, n))
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return out


@contextlib.contextmanager
def peak_bytes(device: str) -> Iterator[list[int]]:
    """Yields a one-item list that holds, on exit, the peak bytes allocated inside the block above
    what was allocated at its start (CUDA), or the peak of the storages created inside it (CPU)."""
    out = [0]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out[0] = torch.cuda.max_memory_allocated() - base
        return
    with LiveBytes() as tracker:
        yield out
    out[0] = tracker.peak


HEADS: dict[str, Callable] = {
    "pre-43 head (4096-token chunks, logits kept)": old_token_logprobs,
    "pre-43 head, checkpoint_lm_head": functools.partial(old_token_logprobs, recompute=True),
    "chunked head (recomputed in backward)": token_logprobs,
}
"""The heads side by side; the first is the default the issue measures against, the last today's."""


def head_peaks(
    hidden_size: int, vocab: int, tokens: int, dtype: torch.dtype, device: str
) -> list[tuple[str, int]]:
    """``[(head, peak bytes)]`` of one forward + backward (loss over logprobs and entropy) of each
    head on the same random ``[tokens, hidden_size]`` hidden states, suppressing one id."""
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False, dtype=dtype, device=device)
    hidden = torch.randn(tokens, hidden_size, dtype=dtype, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    suppressed = torch.tensor([vocab - 1], device=device)
    rows = []
    for name, fn in HEADS.items():
        hidden.grad = head.weight.grad = None
        with peak_bytes(device) as peak:
            lp, ent = fn(hidden, head, targets, temperature=0.7, suppressed=suppressed)
            (lp.sum() - 0.01 * ent.sum()).backward()
            del lp, ent
        rows.append((name, peak[0]))
    return rows
