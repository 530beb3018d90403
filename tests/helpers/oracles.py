"""vLLM's own engine-free multimodal processor as the oracle of the adapter tests
(``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))``: the very processor a vLLM server runs
on a chat with images), the photos they process, and chat prompts with image slots."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from protocol.adapters import offload_image
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders, locate_image_runs

from .photos import photo_bytes

__all__ = [
    "KIMI_GRID_SIZES",
    "QWEN_GRID_SIZES",
    "Oracle",
    "chat_ids",
    "check_against_vllm",
    "image_bytes",
    "make_oracle",
    "oracle_settings",
]

# Sizes (w, h) for grid_for_size vs the processed grid (synthetic images): tiny, square, extreme;
# Qwen's up to its aspect-ratio limit of 200.
QWEN_GRID_SIZES = [
    (1, 1), (2, 3), (3, 2), (17, 17), (28, 28), (31, 29), (56, 56), (100, 1), (1, 100),
    (224, 224), (225, 223), (300, 451), (451, 300), (512, 512), (600, 400), (640, 427),
    (1000, 30), (30, 1000), (1023, 767), (1280, 720), (720, 1280), (2000, 10), (10, 2000),
    (4000, 20), (20, 4000), (1999, 1501),
]  # fmt: skip
KIMI_GRID_SIZES = [
    (1, 1), (2, 3), (13, 13), (14, 14), (15, 29), (28, 28), (29, 27), (100, 1), (1, 100),
    (224, 224), (225, 223), (300, 451), (447, 449), (463, 461), (600, 400), (896, 14),
    (897, 14), (14, 897), (1023, 767), (1280, 720), (720, 1280), (3000, 7), (7, 3000), (4000, 20),
]  # fmt: skip


@functools.cache
def image_bytes(name: str, size: tuple[int, int] | None = None) -> bytes:
    """:func:`photo_bytes` as JPEG, cached: the photos the adapter tests process."""
    return photo_bytes(name, size=size)


@dataclass
class Oracle:
    """vLLM's multimodal processor for one model and one ``mm_device_do_normalize`` setting
    (``normalize``: True means raw uint8 pixels, normalized on the device); ``modality``: the
    key vLLM files the model's images under (``"image"``, Kimi K2.5's ``"vision_chunk"``)."""

    model_config: Any
    processor: Any
    normalize: bool
    modality: str

    @property
    def image_processor(self) -> Any:
        """The image processor vLLM runs (the plugin's ``upstream.served_image_processor``)."""
        from upstream import served_image_processor

        return served_image_processor(self.processor)

    def run(self, prompt_ids: list[int], images: list[Image.Image]) -> dict[str, Any]:
        """vLLM's processing of a prompt (one placeholder token per image) with ``images``:
        ``prompt_token_ids`` expanded, ``mm_kwargs`` and ``mm_placeholders`` by modality."""
        if self.modality == "vision_chunk":
            data = {"vision_chunk": [{"type": "image", "image": im, "uuid": None} for im in images]}
        else:
            data = {"image": images}
        items = self.processor.info.parse_mm_data(data)
        kwargs = self.model_config.multimodal_config.merge_mm_processor_kwargs({})
        return self.processor(prompt_ids, items, hf_processor_mm_kwargs=kwargs)


def oracle_settings(model_type: str) -> tuple[dict[str, Any], str]:
    """``(ModelConfig keywords, modality)`` for a family: Qwen's at most 4 images and no video;
    Kimi's longer context; Kimi-VL's HF processor is the checkpoint's remote code."""
    if model_type == "kimi_k25":
        return {"max_model_len": 4096}, "vision_chunk"
    if model_type == "kimi_vl":
        return {"max_model_len": 4096, "trust_remote_code": True}, "image"
    return {"max_model_len": 2048, "limit_mm_per_prompt": {"image": 4, "video": 0}}, "image"


def make_oracle(model_dir: Path, normalize: bool | None = None) -> Oracle:
    """vLLM's processor for the model in ``model_dir`` (fp32), as a server builds it with default
    flags (``normalize`` None) or with ``mm_device_do_normalize=normalize``."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    settings, modality = oracle_settings(model_type)
    if normalize is not None:
        settings = {**settings, "mm_device_do_normalize": normalize}
    mc = ModelConfig(model=str(model_dir), dtype="float32", **settings)
    processor = MULTIMODAL_REGISTRY.create_processor(mc)
    return Oracle(mc, processor, bool(mc.multimodal_config.mm_device_do_normalize), modality)


def chat_ids(tokenizer: Any, n_images: int, text: str = "Describe these.") -> list[int]:
    """Chat-template prompt ids with one image placeholder token per image (what vLLM expands)."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    return list(encoded["input_ids"])


def check_against_vllm(oracle: Oracle, adapters, data: bytes, prompt: list[int], tmp_path: Path) -> None:
    """One image (encoded ``data``) in ``prompt`` (one placeholder token) through vLLM's processor
    and through each adapter: bit-identical pixels, the same grid (int64), placeholder count and
    range, the prompt expanded as vLLM expands it from a ref offloaded with the last adapter.

    Raises AssertionError on the first difference."""
    image = load_image(data)
    out = oracle.run(prompt, [image])
    modality, grid_field = adapters[0].vllm_modality, adapters[0].grid_field
    assert set(out["mm_kwargs"]) == {modality}
    (item,) = out["mm_kwargs"][modality]
    (placeholder,) = out["mm_placeholders"][modality]
    want_pixels, want_grid = item["pixel_values"].data, item[grid_field].data
    assert want_pixels.dtype == (torch.uint8 if oracle.normalize else torch.float32)

    for adapter in adapters:
        got = adapter.process(image, raw_pixels=oracle.normalize)
        pixels = got.tensors["pixel_values"]
        assert pixels.dtype == want_pixels.dtype and pixels.shape == want_pixels.shape
        assert torch.equal(pixels, want_pixels), (
            f"max |diff| {(pixels.double() - want_pixels.double()).abs().max()}"
        )
        assert got.tensors[grid_field].dtype == want_grid.dtype == torch.int64
        assert got.tensors[grid_field].tolist() == [want_grid.tolist()]
        assert list(got.grid) == want_grid.tolist()
        assert got.num_placeholders == placeholder.length
        assert adapter.grid_for_size(image.width, image.height) == got.grid

    ref = offload_image(data, tmp_path, adapters[-1])
    assert ref.grid == want_grid.tolist() and ref.num_placeholders == placeholder.length
    token_id = out["prompt_token_ids"][placeholder.offset]
    expanded = expand_image_placeholders(prompt, [ref], token_id)
    assert expanded == list(out["prompt_token_ids"])
    assert locate_image_runs(expanded, [], token_id, counts=[ref.num_placeholders]) == [
        (placeholder.offset, placeholder.length)
    ]
