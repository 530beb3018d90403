"""What a sample costs the model, and what an unbalanced plan costs in waiting (docs/PACKING.md §3.4).

:class:`CostModel` counts forward FLOPs of the language model and the vision tower from a Qwen-VL
config (backward is ~2x forward for every term, so shares hold); :func:`sync_idle` turns
``[rank][slot]`` cost tables into the share of rank-time spent waiting at the per-micro-batch
synchronisation points (FSDP gathers parameters layer by layer, so every micro-batch "slot" lasts
as long as its slowest rank). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["H100_FORWARD_FLOPS_PER_S", "CostModel", "sync_idle"]

H100_FORWARD_FLOPS_PER_S = 1.07e14
"""Forward FLOPs (as :meth:`CostModel.from_config` counts them) per second of forward+backward on
the card the cost model was fitted on: an H100 80GB lent 2026-12 (docs/PACKING.md "GPU
measurements": ``bench/cost_model.py``'s fit of Qwen2-VL-2B shapes, random bf16 weights). Per
term: language linear 123, attention 95, vision linear 75, attention 192 TFLOP/s; 107 weighs
them by their shares of a step's seconds on ``bench/pack.py``'s mix (54.3 / 6.4 / 34.8 / 4.5%).
It turns a FLOP plan's predicted step into seconds (the plan's search budget,
:mod:`~trainer_lib.planning.refine`)."""


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of one sample; backward is ~2x forward for every term, so ratios hold.

    language model: ``llm_per_token * n + llm_per_token_sq * n**2`` for an ``n``-token sample
    (linear layers + LM head; causal attention); vision tower, per image of ``v`` placeholder
    tokens: ``vision_per_token * v + vision_per_token_sq * v**2`` (linear layers; full attention
    over the image's patches). Units: FLOPs (multiply-add = 2).
    """

    llm_per_token: float
    llm_per_token_sq: float
    vision_per_token: float = 0.0
    vision_per_token_sq: float = 0.0
    seconds_per_unit: float | None = None
    """Seconds of forward+backward on the card that one unit of this model's cost takes:
    ``1 / H100_FORWARD_FLOPS_PER_S`` for :meth:`from_config`'s FLOPs, 1.0 for coefficients fitted
    in seconds (``bench/cost_model.py``); None: not known (the plan's search then gets its
    floor budget)."""

    def language(self, num_tokens: int) -> float:
        """FLOPs of the language model (and LM head) for one ``num_tokens``-token sample."""
        return self.llm_per_token * num_tokens + self.llm_per_token_sq * num_tokens**2

    def vision(self, image_tokens: Sequence[int]) -> float:
        """FLOPs of the vision tower for one sample's images (placeholder tokens per image)."""
        return sum(self.vision_per_token * v + self.vision_per_token_sq * v * v for v in image_tokens)

    @classmethod
    def from_config(cls, config: Any) -> CostModel:
        """Coefficients from a Qwen2-VL / Qwen2.5-VL / Qwen3-VL config (``text_config``, ``vision_config``).

        Per layer and token: projections ``2*d*(2*H*hd + 2*kv*hd)``, gated MLP ``6*d*I``; causal
        attention ``2*H*hd*n**2`` per sample; LM head ``2*d*vocab`` (Kaplan et al. 2020, Table 1;
        Narayanan et al. 2021, §5.1). Vision, per patch (``merge**2`` per placeholder token): qkv+proj
        ``8*E**2``, MLP ``2*m*E*I_v`` (``m`` matrices: 3 when gated, Qwen2.5-VL), attention
        ``4*E*p**2`` per ``p``-patch image (Qwen2.5-VL: ``fullatt_block_indexes`` layers; windowed
        ones count as linear), patch embedding, merger(s). ValueError for another vision family.
        """
        t, v = config.text_config, config.vision_config
        d, heads = t.hidden_size, t.num_attention_heads
        hd = getattr(t, "head_dim", None) or d // heads
        proj = 2 * d * (2 * heads * hd + 2 * t.num_key_value_heads * hd) + 6 * d * t.intermediate_size
        llm = t.num_hidden_layers * proj + 2 * d * t.vocab_size
        llm_sq = t.num_hidden_layers * 2 * heads * hd
        kind = v.model_type.removesuffix("_vision")
        if kind == "qwen2_vl":
            width, inner, matrices, out, mergers = v.embed_dim, v.embed_dim * v.mlp_ratio, 2, v.hidden_size, 1
        elif kind in ("qwen2_5_vl", "qwen3_vl"):
            width, inner, out = v.hidden_size, v.intermediate_size, v.out_hidden_size
            matrices = 3 if kind == "qwen2_5_vl" else 2
            mergers = 1 + len(getattr(v, "deepstack_visual_indexes", None) or ())
        else:
            raise ValueError(
                f"no cost model for vision config {v.model_type!r}; supported: qwen2_vl, qwen2_5_vl, qwen3_vl"
            )
        merge = v.spatial_merge_size**2
        full = v.depth if kind != "qwen2_5_vl" else len(v.fullatt_block_indexes)
        window = (v.window_size // v.patch_size) ** 2 if kind == "qwen2_5_vl" else 0
        per_patch = v.depth * (8 * width**2 + 2 * matrices * width * inner)
        per_patch += (v.depth - full) * 4 * width * window
        per_patch += 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2 * width
        per_token = merge * per_patch + mergers * 2 * (merge * width) * (merge * width + out)
        return cls(llm, llm_sq, per_token, full * 4 * width * merge**2, 1.0 / H100_FORWARD_FLOPS_PER_S)


def sync_idle(
    work: Sequence[Sequence[Sequence[float]]], padding: Sequence[Sequence[Sequence[float]]] | None = None
) -> float:
    """The idle share: ``1 - total work / (dp * sum over stages and slots of the slowest rank's time)``.

    Args:
        work: one ``[rank][slot]`` cost table per synchronous stage (tokens alone; or
            vision-tower and language-model FLOPs, which FSDP gathers layer by layer, so each waits
            for its own slowest rank). A rank's time in a slot is its work plus its padding.
        padding: the same tables for the pads (time without work); default none.

    Returns:
        0.0 without work.

    Raises:
        ValueError: ranks with different slot counts, or padding tables of another shape.
    """
    busy = peak = 0.0
    for s, table in enumerate(work):
        pads = padding[s] if padding is not None else [[0.0] * len(row) for row in table]
        if len({len(row) for row in table}) > 1 or [len(r) for r in pads] != [len(r) for r in table]:
            raise ValueError(f"ranks have different slot counts: {[len(row) for row in table]}")
        for column, extra in zip(zip(*table, strict=True), zip(*pads, strict=True), strict=True):
            busy += sum(column)
            peak += len(column) * max(a + b for a, b in zip(column, extra, strict=True))
    return 1.0 - busy / peak if peak else 0.0
