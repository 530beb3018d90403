"""One model family's packing facts, carried through the trainer as one object (docs/PACKING.md).

Planning, packing, padding, materializing and the model inputs need the same few facts of the
model family: the image placeholder token id, the pad id, how many placeholder tokens an image of
a grid takes (the adapter's arithmetic, never re-derived here), which grids the processor can
produce, the synthetic pad image's grid and the pixel mode. :class:`PackingSpec` holds them;
build it once per model::

    spec = PackingSpec.from_adapter(adapter, model.config, pad_token_id=tokenizer.pad_token_id)
    plan = plan_step(samples, spec, StepShape(dp_size=8, mini_batch_size=256, seq_len=16384))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # planning stays free of torch and transformers
    from protocol.adapters import ImageAdapter

__all__ = ["PackingSpec"]


@dataclass(frozen=True)
class PackingSpec:
    """A model family's packing facts.

    Raises:
        ValueError: ``pad_tokens`` below 1.
    """

    placeholder_token_id: int
    """The image placeholder id (``adapter.placeholder_token_id(config)``, e.g. ``<|image_pad|>``)."""
    pad_token_id: int
    """The token id of padding samples (e.g. ``tokenizer.pad_token_id``)."""
    adapter: ImageAdapter | None = None
    """The family's adapter: placeholder counts per grid, grid bounds, the smallest grid, zero
    features. None (packing tests, a packer without the processor): refs' ``num_placeholders``
    are taken as given, and no synthetic-image pad or feature can be made."""
    pad_tokens: int = 2
    """Tokens of a text pad (verl's scheme: 2)."""
    synthetic_grid: tuple[int, ...] | None = None
    """The synthetic-image pad's grid, bounded by ``adapter.check_grid``; None: the smallest grid
    the processor makes (:attr:`image_pad_grid`)."""
    raw_pixels: bool = False
    """The pixel mode: False, the normalized pixels an HF model takes (the trainer's); True,
    vLLM's raw pixels under ``mm_device_do_normalize`` (to compare with such a server)."""
    video_token_id: int | None = None
    """The video placeholder id (``adapter.video_token_id(config)``, ``<|video_pad|>``); None: the
    family takes no videos here (a video ref then fails packing as a placeholder mismatch)."""

    def __post_init__(self) -> None:
        if self.pad_tokens < 1:
            raise ValueError(f"pad_tokens must be >= 1, got {self.pad_tokens}")

    @classmethod
    def from_adapter(
        cls,
        adapter: ImageAdapter,
        model_or_config: Any,
        *,
        pad_token_id: int,
        pad_tokens: int = 2,
        synthetic_grid: Sequence[int] | None = None,
        raw_pixels: bool = False,
    ) -> PackingSpec:
        """The spec of ``adapter``'s family for a model (or its HF config): the placeholder id is
        ``adapter.placeholder_token_id(config)``, the video one ``adapter.video_token_id(config)``
        where the adapter has a video processor."""
        config = getattr(model_or_config, "config", model_or_config)
        videos = getattr(adapter, "video_processor", None) is not None  # VideoMixin, attached
        return cls(
            placeholder_token_id=adapter.placeholder_token_id(config),
            video_token_id=adapter.video_token_id(config) if videos else None,
            pad_token_id=pad_token_id,
            adapter=adapter,
            pad_tokens=pad_tokens,
            synthetic_grid=None if synthetic_grid is None else tuple(int(g) for g in synthetic_grid),
            raw_pixels=raw_pixels,
        )

    @property
    def num_placeholders(self) -> Callable[[Sequence[int]], int] | None:
        """``adapter.num_placeholders`` (placeholder tokens of one image of a grid); None without
        an adapter."""
        return None if self.adapter is None else self.adapter.num_placeholders

    @property
    def video_token_runs(self) -> Callable[[Sequence[int]], list[int]] | None:
        """``adapter.video_token_runs`` (a video grid's placeholder runs, prompt order); None without
        an adapter or without videos."""
        if self.adapter is None or self.video_token_id is None:
            return None
        return self.adapter.video_token_runs  # type: ignore[attr-defined]

    @functools.cached_property
    def image_pad_grid(self) -> tuple[int, ...]:
        """The synthetic-image pad's grid: :attr:`synthetic_grid` bounded by ``adapter.check_grid``,
        else the smallest the processor makes (a 1x1 image after its resize rules: ``(1, 4, 4)`` =
        4 placeholder tokens for released Qwen2-VL, whose ``smart_resize`` lifts tiny images to
        ``min_pixels``).

        Raises:
            ValueError: no adapter.
            GridMismatch: a :attr:`synthetic_grid` the processor cannot produce.
        """
        if self.adapter is None:
            raise ValueError(
                "a rank's micro-batch must run the vision tower with no image of its own: aligning "
                "the vision tower across ranks needs the adapter (synthetic-image pads)"
            )
        if self.synthetic_grid is None:
            return tuple(self.adapter.grid_for_size(1, 1))
        return tuple(self.adapter.check_grid(tuple(int(g) for g in self.synthetic_grid)))

    @property
    def image_pad_length(self) -> int:
        """Tokens of a synthetic-image pad, ``[pad] + placeholders + [pad]``; 0 without an adapter.

        Raises:
            GridMismatch: see :attr:`image_pad_grid`.
        """
        return 0 if self.adapter is None else self.adapter.num_placeholders(self.image_pad_grid) + 2
