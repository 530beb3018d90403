"""What a packed model call carries, and the refusal when it cannot stay inside each sample.

A leaf: the varlen kernel (:mod:`trainer_lib.attention`), the Gated DeltaNet layers
(:mod:`trainer_lib.linear_attention`), the checks that set both up (:mod:`trainer_lib.prepare`)
and the forward (:mod:`trainer_lib.forward`) all import these names from here.
"""

from __future__ import annotations

__all__ = ["CU_SEQLENS_KWARG", "FSDP_FORWARD_METHOD", "MAX_SEQLEN_KWARG", "PackingUnsupported"]

CU_SEQLENS_KWARG = "mmref_cu_seqlens"
"""Model-call keyword carrying a packed row's int ``[num_samples + 1]`` sample boundaries, read by
the ``mmref_varlen`` attention backend and by the linear-attention layers. transformers forwards
unknown keywords to every decoder layer; the vision tower takes ``cu_seqlens`` / ``position_ids``
itself, so those names are not used."""
MAX_SEQLEN_KWARG = "mmref_max_seqlen"
"""Model-call keyword with the longest sample's token count (the ``mmref_varlen`` backend only)."""
FSDP_FORWARD_METHOD = "mmref_packed_forward"
"""The attribute :func:`~trainer_lib.shard_model` sets on a model sharded with FSDP2: the packed
forward's body, registered with ``register_fsdp_forward_method`` so that the root module's
parameters are gathered around it; :func:`~trainer_lib.packed_logprobs` calls it when present."""


class PackingUnsupported(ValueError):
    """The model (or backend, or device) cannot run a packed micro-batch without leaking across samples."""
