"""Protocol structs (docs/PROTOCOL.md §3): msgspec, strict decoding, msgpack on the wire, JSON on HTTP.

Request/control structs are ``frozen, kw_only, forbid_unknown_fields``; bulk
structs (:class:`TrainingSample`, :class:`MicroBatch`) are ``array_like`` with
``gc=False``, and new fields may only be appended with defaults.
Cross-field rules live in ``__post_init__`` (a ``ValueError`` there becomes
``msgspec.ValidationError`` on decode).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.refs import is_ref

__all__ = [
    "MMRefs",
    "MicroBatch",
    "RawMMRef",
    "TrainingSample",
    "decode_microbatch",
    "decode_sample",
    "encode",
]

_SHA256_RE = re.compile(r"^[a-f0-9]{64}$")
_NonNegInt = Annotated[int, Meta(ge=0)]
_PosInt = Annotated[int, Meta(ge=1)]


class RawMMRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One image (or video) of a prompt, by reference.

    Example (Qwen2-VL, a 1024x768 JPEG)::

        RawMMRef(ref="mmraw:eyJm...", modality="image", sha256="3f1c...(64 hex)",
                 media_type="image/jpeg", grid=[1, 54, 74], num_placeholders=999)
    """

    ref: str
    """An ``mmraw:`` or ``mmfile:v1:`` ref string (:mod:`protocol.refs`)."""
    modality: Literal["image", "video"] = "image"
    """``"video"``: a clip (``media_type`` ``video/mp4``...), ``grid`` its ``video_grid_thw``
    ``[t, h, w]`` and ``num_placeholders`` its ``<|video_pad|>`` tokens (issue 44)."""
    sha256: str
    """Full lowercase hex sha256 of the raw image file."""
    media_type: str
    """E.g. ``"image/jpeg"``."""
    grid: list[_PosInt]
    """Adapter grid: Qwen ``[t, h, w]`` in patches; Kimi-VL ``[h, w]``."""
    num_placeholders: _PosInt
    """Placeholder tokens this image takes in the prompt (Qwen: ``t*h*w // merge**2``)."""

    def __post_init__(self) -> None:
        if not is_ref(self.ref):
            raise ValueError(f"ref {self.ref[:40]!r} is not an mmraw:/mmfile:v1: ref")
        if not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError("sha256 must be 64 lowercase hex characters")


class MMRefs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The images of one sample, in prompt order."""

    items: list[RawMMRef]
    mm_token_type_ids: list[Annotated[int, Meta(ge=0, le=2)]] | None = None
    """Per token of the sample (prompt and completion; a sample's ``input_ids`` length): 0 text,
    1 image placeholder, 2 video placeholder (transformers' convention). Locates image and video
    runs without trusting raw token ids (a text token equal to the placeholder id is not an image)."""


def _check_token_arrays(obj: Any) -> int:
    """``len(obj.input_ids)``, after checking ``loss_mask``/``advantages``/``inference_logprobs``
    have that many entries (ValueError naming the first that does not)."""
    n = len(obj.input_ids)
    for name in ("loss_mask", "advantages", "inference_logprobs"):
        if len(getattr(obj, name)) != n:
            raise ValueError(f"{name} has {len(getattr(obj, name))} entries, input_ids {n}")
    return n


class TrainingSample(msgspec.Struct, kw_only=True, array_like=True, gc=False, omit_defaults=True):
    """One rollout sample as the trainer receives it: prompt and completion, ``L`` tokens.

    The per-token lists all have ``L`` entries (checked on construction, decoding and
    ``msgspec.structs.replace``, a ``ValueError`` / ``msgspec.ValidationError`` naming the list).
    On the wire it is a msgpack array in field order (``array_like``), every field written; a
    shorter array decodes with the missing trailing fields at their defaults.
    """

    input_ids: list[_NonNegInt]
    """``[L]`` token ids; each image is a run of ``num_placeholders`` placeholder tokens."""
    loss_mask: list[bool]
    """``[L]``: True where the token takes loss (completion tokens; never the first token)."""
    advantages: list[float]
    """``[L]`` per-token advantages (computed by the RL framework)."""
    inference_logprobs: list[float]
    """``[L]``: the rollout engine's logprob of token ``t`` given the tokens before it (0.0 where
    it has none, e.g. prompt tokens)."""
    mm_refs: MMRefs | None = None
    """The sample's images in prompt order; None for a text-only sample."""
    run_id: str = ""
    """Packing isolation: samples of different ``(run_id, lora_id)`` never share a micro-batch."""
    lora_id: str | None = None
    is_padding: bool = False
    """A zero-loss pad kept out of metrics (``trainer_lib.planning.padding``)."""
    sampling_temperature: float | None = None
    """The temperature the completion was sampled at (``>= 0``, finite; 0 = greedy), or None when
    unknown. A server run with ``--logprobs-mode processed_logprobs`` returns logprobs after
    temperature: ``trainer_lib.recompute_logprobs`` warns when it computes at another one."""

    @classmethod
    def from_rollout(
        cls,
        prompt_ids: list[int],
        completion_ids: list[int],
        completion_logprobs: list[float],
        images: list[RawMMRef] | None = None,
        *,
        sampling_temperature: float | None = None,
    ) -> TrainingSample:
        """The sample of one rollout, as the server answered it: ``L = len(prompt_ids) +
        len(completion_ids)`` tokens, loss on the completion only, the server's logprob on each
        completion token (0.0 on the prompt), advantages 0.0 (the RL algorithm sets them, e.g.
        with ``msgspec.structs.replace``).

        Args:
            prompt_ids: the prompt as sent, each image's placeholders already expanded.
            completion_ids: the completion's token ids.
            completion_logprobs: the server's logprob of each completion token (same length).
            images: the prompt's image refs in prompt order (None or empty: text only).
            sampling_temperature: the temperature the completion was sampled at, if known.

        Raises:
            ValueError: ``completion_logprobs`` and ``completion_ids`` differ in length, or a
                negative or non-finite ``sampling_temperature``.
        """
        n, m = len(prompt_ids), len(completion_ids)
        if len(completion_logprobs) != m:
            raise ValueError(f"{len(completion_logprobs)} completion logprobs for {m} completion tokens")
        return cls(
            input_ids=[*prompt_ids, *completion_ids],
            loss_mask=[False] * n + [True] * m,
            advantages=[0.0] * (n + m),
            inference_logprobs=[0.0] * n + list(completion_logprobs),
            mm_refs=MMRefs(items=list(images)) if images else None,
            sampling_temperature=sampling_temperature,
        )

    @property
    def isolation_key(self) -> tuple[str, str | None]:
        """``(run_id, lora_id)``: samples of different keys never share a micro-batch (packing
        isolation); a pad takes the key of the sample it is packed beside."""
        return (self.run_id, self.lora_id)

    def __post_init__(self) -> None:
        n = _check_token_arrays(self)
        if self.mm_refs is not None and self.mm_refs.mm_token_type_ids is not None:
            if len(self.mm_refs.mm_token_type_ids) != n:
                raise ValueError("mm_token_type_ids must have one entry per input id")
        t = self.sampling_temperature
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise ValueError(f"sampling_temperature must be finite and >= 0, got {t}")


class MicroBatch(msgspec.Struct, kw_only=True, array_like=True, gc=False, omit_defaults=True):
    """Samples packed into one sequence; ``seq_lens`` marks the boundaries."""

    input_ids: list[_NonNegInt]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    seq_lens: list[_PosInt]
    """One entry per packed sample; ``sum(seq_lens) == len(input_ids)``."""
    sample_count: _NonNegInt
    mm_refs: list[RawMMRef] = msgspec.field(default_factory=list)
    """Every sample's refs, concatenated in sample order."""
    mm_token_type_ids: list[Annotated[int, Meta(ge=0, le=2)]] | None = None
    """Per token: 0 text, 1 image placeholder, 2 video placeholder (transformers' convention;
    locates image and video runs without trusting token ids)."""
    images_per_sample: list[_NonNegInt] | None = None
    """Per packed sample: how many of ``mm_refs`` (and synthetic pad images) it owns, in order."""
    is_padding: list[bool] | None = None
    """Per packed sample: a zero-loss pad kept out of metrics."""
    synthetic_grids: list[list[_PosInt]] | None = None
    """Grids of the zero-feature pad images (no ref: ``adapter.zero_features(grid)``),
    in pack order; they follow every ref'd image. Counted in ``images_per_sample``."""
    run_id: str = ""
    lora_id: str | None = None
    """The ``(run_id, lora_id)`` every packed sample shares (packing isolation)."""

    def __post_init__(self) -> None:
        n = _check_token_arrays(self)
        if self.mm_token_type_ids is not None and len(self.mm_token_type_ids) != n:
            raise ValueError(f"mm_token_type_ids has {len(self.mm_token_type_ids)} entries, input_ids {n}")
        for name in ("images_per_sample", "is_padding"):
            value = getattr(self, name)
            if value is not None and len(value) != self.sample_count:
                raise ValueError(f"{name} has {len(value)} entries for sample_count {self.sample_count}")
        if sum(self.seq_lens) != n:
            raise ValueError(f"seq_lens sum to {sum(self.seq_lens)}, input_ids has {n}")
        if len(self.seq_lens) != self.sample_count:
            raise ValueError(f"{len(self.seq_lens)} seq_lens for sample_count {self.sample_count}")
        n_synthetic = len(self.synthetic_grids or ())
        if self.images_per_sample is not None:
            if sum(self.images_per_sample) != len(self.mm_refs) + n_synthetic:
                raise ValueError(
                    f"images_per_sample sums to {sum(self.images_per_sample)}, but there are "
                    f"{len(self.mm_refs)} mm_refs and {n_synthetic} synthetic_grids"
                )
        elif n_synthetic:
            raise ValueError("synthetic_grids need images_per_sample (which sample owns each image)")


_encoder = msgspec.msgpack.Encoder()
_sample_decoder = msgspec.msgpack.Decoder(TrainingSample)
_microbatch_decoder = msgspec.msgpack.Decoder(MicroBatch)


def encode(obj: msgspec.Struct) -> bytes:
    """msgpack-encode any protocol struct."""
    return _encoder.encode(obj)


def decode_sample(data: bytes) -> TrainingSample:
    """Decode and validate a msgpack :class:`TrainingSample`.

    Raises:
        msgspec.ValidationError: wrong types or a cross-field rule broken.
        msgspec.DecodeError: not msgpack (invalid UTF-8 in a string included).
    """
    return _decode(_sample_decoder, data)


def decode_microbatch(data: bytes) -> MicroBatch:
    """Decode and validate a msgpack :class:`MicroBatch` (errors as :func:`decode_sample`)."""
    return _decode(_microbatch_decoder, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes):
    try:
        return decoder.decode(data)
    except UnicodeDecodeError as e:  # msgspec lets this one through for bad UTF-8 in a str
        raise msgspec.DecodeError(f"invalid UTF-8 in a string: {e}") from e
