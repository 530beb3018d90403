"""Samples to pack: syntactically valid refs whose pixels are never read, token ids of the tiny
models, the two :class:`PackingSpec` of the packing tests."""

from __future__ import annotations

from protocol.structs import MMRefs, RawMMRef, TrainingSample
from trainer_lib import PackingSpec

__all__ = [
    "FAKE",
    "IM_END",
    "IM_START",
    "PAD",
    "SPEC",
    "TOK",
    "V_END",
    "V_START",
    "FakeAdapter",
    "count",
    "make_ref",
    "make_sample",
]

IM_START, IM_END, V_START, V_END = 257, 258, 259, 260
TOK = 261  # <|image_pad|> of the tiny models
PAD = 256  # <|endoftext|>


def make_ref(h: int, w: int, salt: int = 0) -> RawMMRef:
    """A syntactically valid ref for a (1, 2h, 2w) grid: h*w placeholders (packing reads no pixels);
    ``bench/pack.py``'s :func:`grid_ref`, the refs of its mixes."""
    from pack import grid_ref

    return grid_ref(h, w, f"{h:04x}{w:04x}{salt:08x}".ljust(64, "a"))


def count(grid) -> int:
    """Qwen2-VL's placeholder count of a grid (merge 2)."""
    t, h, w = grid
    return t * h * w // 4


class FakeAdapter:
    """The two adapter methods packing/padding use, with Qwen's arithmetic (merge 2, min grid 1x4x4)."""

    def num_placeholders(self, grid) -> int:
        return count(grid)

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        return (1, 4, 4)


SPEC = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD)
"""No adapter: refs' counts taken as given, no synthetic-image pad."""
FAKE = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD, adapter=FakeAdapter())
"""Qwen's arithmetic: counts checked, synthetic-image pads of (1, 4, 4)."""


def make_sample(
    text: list[int],
    refs: list[RawMMRef] = (),
    *,
    adjacent: bool = False,
    typed: bool = False,
    completion: int = 3,
    run_id: str = "",
    lora_id: str | None = None,
    is_padding: bool = False,
) -> TrainingSample:
    """``text``, each image (``<vision_start> pads <vision_end>``, or pads back to back), a completion."""
    ids = list(text)
    types = [0] * len(ids)
    for k, r in enumerate(refs):
        if not adjacent or k == 0:
            ids.append(V_START)
            types.append(0)
        ids += [TOK] * r.num_placeholders
        types += [1] * r.num_placeholders
        if not adjacent or k == len(refs) - 1:
            ids.append(V_END)
            types.append(0)
    ids += [7] * completion
    types += [0] * completion
    n = len(ids)
    loss = [False] * (n - completion) + [not is_padding] * completion
    loss[0] = False  # a sample's first token has no logprob: packing refuses a loss on it
    mm = MMRefs(items=list(refs), mm_token_type_ids=types if typed else None) if (refs or typed) else None
    return TrainingSample(
        input_ids=ids,
        loss_mask=loss,
        advantages=[0.0 if is_padding else 1.5] * n,
        inference_logprobs=[-0.5] * n,
        mm_refs=mm,
        run_id=run_id,
        lora_id=lora_id,
        is_padding=is_padding,
    )
