"""The packed forward on tiny models: a family's model, adapter and photos, chats to pack,
transformers' unpacked reference, vLLM's MRoPE positions."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from make_tiny_models import ensure_tiny_model
from protocol.adapters import load_adapter, offload_image
from protocol.structs import MMRefs, TrainingSample
from trainer_lib import (
    ForwardResult,
    MaterializeConfig,
    PackedInputs,
    PackingSpec,
    materialize,
    materialize_micro_batch,
    packed_inputs,
    packed_logprobs,
)

from .packing import IM_END, IM_START, PAD, V_END, V_START
from .photos import photo_bytes

__all__ = [
    "Families",
    "Family",
    "chat",
    "forward_backward",
    "gradients",
    "reference_logprobs",
    "relative",
    "run_packed",
    "vllm_positions",
]


def _text(s: str) -> list[int]:
    return list(s.encode())


def chat(images, prompt: str, answer: str, tok: int, *, adjacent: bool = False) -> TrainingSample:
    """A Qwen-style chat: ``<im_start>user\\n <vision_start> pads <vision_end> prompt <im_end> answer``."""
    ids = [IM_START, *_text("user\n")]
    for k, ref in enumerate(images):
        if not adjacent or k == 0:
            ids.append(V_START)
        ids += [tok] * ref.num_placeholders
        if not adjacent or k == len(images) - 1:
            ids.append(V_END)
    ids += [*_text(prompt), IM_END, IM_START, *_text("assistant\n")]
    completion = [*_text(answer), IM_END]
    n = len(ids) + len(completion)
    return TrainingSample(
        input_ids=ids + completion,
        loss_mask=[False] * len(ids) + [True] * len(completion),
        advantages=[0.25] * n,
        inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=list(images)) if images else None,
    )


class Family:
    """A tiny model of one family (float32, eval), its adapter, four photos offloaded under ``root``,
    its :class:`PackingSpec` and :class:`MaterializeConfig`."""

    def __init__(self, name: str, root) -> None:
        from transformers import AutoModelForImageTextToText

        self.name = name
        self.dir = ensure_tiny_model(name)
        self.model = AutoModelForImageTextToText.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.adapter = load_adapter(self.dir)
        self.root = root
        self.tok = self.adapter.placeholder_token_id(self.model.config)
        self.refs = {
            n: offload_image(photo_bytes(n), root, self.adapter)
            for n in ("astronaut", "coffee", "chelsea", "rocket")
        }
        self.spec = PackingSpec.from_adapter(self.adapter, self.model, pad_token_id=PAD)
        self.config = MaterializeConfig(asset_root=root)

    def samples(self) -> list[TrainingSample]:
        r, t = self.refs, self.tok
        return [
            chat([r["astronaut"]], "What is in the picture?", "An astronaut.", t),
            chat([], "Say hi.", "Hi there, how are you?", t),
            chat([r["coffee"], r["chelsea"]], "Compare them.", "A cup; a cat.", t),
            chat([], "Count to five", "1 2 3 4 5", t),
            chat([r["rocket"]], "Name it", "rocket", t),
            chat([r["chelsea"]], "?", "cat", t),
        ]


class Families(dict):
    """``name -> Family`` under one asset ``root``, each family built on first use (a test module's
    fixture holds one; a test parametrized over more families than the module's own loads only
    the ones it asks for)."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Family:
        self[name] = Family(name, self.root)
        return self[name]


def reference_logprobs(fam: Family, sample: TrainingSample) -> torch.Tensor:
    """transformers' own unpacked forward of one sample; logprob of token t given tokens < t."""
    ids = torch.tensor([sample.input_ids])
    kwargs = {}
    if sample.mm_refs:
        feats = materialize(
            [sample], fam.adapter, fam.root, dedup=False
        ).features  # transformers' own forward
        types_ = (ids == fam.tok).int()
        kwargs = dict(
            pixel_values=feats["pixel_values"],
            image_grid_thw=feats["image_grid_thw"],
            mm_token_type_ids=types_,
        )
    logits = fam.model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
    lp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def run_packed(fam: Family, packed) -> tuple[PackedInputs, ForwardResult]:
    """Materialize, build the inputs and run the packed forward of one micro-batch."""
    m = materialize_micro_batch(packed, fam.spec, fam.config)
    inputs = packed_inputs(m.packed, m.features, fam.model, fam.spec, image_index=m.image_index)
    return inputs, packed_logprobs(fam.model, inputs)


def vllm_positions(family: str, config, ids: list[int], spans) -> torch.Tensor:
    """vLLM 0.32's MRoPE positions of one prompt (``get_mrope_input_positions``); spans: (offset, n, grid)."""
    feats = [
        types.SimpleNamespace(
            mm_position=types.SimpleNamespace(offset=off, length=len_),
            modality="image",
            data={"image_grid_thw": types.SimpleNamespace(data=torch.tensor(grid))},
        )
        for off, len_, grid in spans
    ]
    if family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):  # each its own vLLM class
        from vllm.model_executor.models import qwen3_5, qwen3_vl, qwen3_vl_moe

        cls = {
            "qwen3_vl": qwen3_vl.Qwen3VLForConditionalGeneration,
            "qwen3_vl_moe": qwen3_vl_moe.Qwen3VLMoeForConditionalGeneration,
            "qwen3_5": qwen3_5.Qwen3_5ForConditionalGeneration,
            "qwen3_5_moe": qwen3_5.Qwen3_5MoeForConditionalGeneration,
        }[family]
        return torch.as_tensor(
            cls._get_mrope_input_positions(input_tokens=ids, mm_features=feats, config=config)[0]
        )
    if family == "qwen2_5_vl":
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as cls
    else:
        from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as cls
    shim = types.SimpleNamespace(config=config)
    shim.iter_mm_grid_thw = types.MethodType(cls.iter_mm_grid_thw, shim)
    return torch.as_tensor(cls.get_mrope_input_positions(shim, ids, feats)[0])


def forward_backward(fam: Family, m) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """One materialized micro-batch ``m`` (images, videos or both) through the packed forward and a
    GRPO-like loss (each token's logprob weighted distinctly, so no symmetry hides a bug), backward.

    Returns:
        the ``[T]`` float32 logprobs, every parameter's gradient (cloned; the model's grads cleared
        after), and the rows each vision-tower call saw (one entry per call, in call order).
    """
    rows: list[int] = []
    hook = fam.model.model.visual.register_forward_hook(lambda mod, a, o: rows.append(a[0].shape[0]))
    fam.model.zero_grad(set_to_none=True)
    try:
        inputs = packed_inputs(
            m.packed, m.features, fam.model, fam.spec, image_index=m.image_index, video_index=m.video_index
        )
        out = packed_logprobs(fam.model, inputs)
        weights = torch.linspace(0.5, 1.5, out.logprobs.shape[0])  # distinct per token
        (out.logprobs * out.loss_mask * weights).sum().backward()
    finally:
        hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in fam.model.named_parameters() if p.grad is not None}
    fam.model.zero_grad(set_to_none=True)
    return out.logprobs.detach(), grads, rows


def gradients(model, loss_fn) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of ``loss_fn()`` (a scalar), cloned; the model's grads cleared
    before and after."""
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``||got - want|| / ||want||`` over all the parameters' gradients together (same names)."""
    assert got.keys() == want.keys()
    num = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    den = sum((want[k] ** 2).sum() for k in want)
    return float(torch.sqrt(num / den))
