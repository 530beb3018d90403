"""vLLM's item wire format, and the check that an item is one the served model can take.

A ``features.kwargs_data`` slot is vLLM's base64 msgpack ``MultiModalKwargsItem``
(``vllm/.../token_in_token_out/mm_serde.py``). vLLM decodes it and hands it to the engine with no
check of its fields against the model or of its rows against its grid; a mismatch fails inside the
engine (the process exits) or silently misaligns features. :class:`ItemLayout` checks an item
before the engine sees it, with the served model's own field config and without allocating for
what the item claims:

- exactly the fields, field kinds and dtypes of the served model's item, and the same per-row
  shape; a flat field's ``dim`` an int within the tensor, its slices ints (vLLM slices with them
  inside the engine);
- rebuilt through the model's field config (``_get_mm_fields_config``, the layout vLLM declares
  once per model), the item is exactly one item and every flat field's rows are exactly the rows
  its grid implies (``Qwen2-VL``: ``pixel_values`` ``[t*h*w, C*T*P*P]`` for ``image_grid_thw``
  ``[t, h, w]``);
- ``pixel_values`` holds what the model's own processor can produce (:class:`PixelRange`): uint8
  (vLLM's device normalization) or float32, finite and within the processor's output range. One
  request's NaN, inf or 3e38 pixels otherwise change the answers of other requests batched with
  it (measured on vLLM 0.32, stock too). The check reads every value once (``torch.aminmax``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.adapters import ImageAdapter
from protocol.errors import MMRefError
from upstream import load

__all__ = ["CheckedItem", "ItemLayout", "PixelRange", "decode_item", "encode_item"]

_codecs = threading.local()


def _thread_codec() -> tuple[Any, Any]:
    """This thread's vLLM ``MsgpackEncoder``/``MsgpackDecoder`` (not thread-safe for tensors, so
    one per worker thread instead of ``mm_serde``'s module-level pair)."""
    if not hasattr(_codecs, "encoder"):
        encoder = load("MsgpackEncoder")(size_threshold=2**62)  # all tensors inline, as mm_serde
        _codecs.decoder = load("MsgpackDecoder")(t=load("MultiModalKwargsItem"))
        _codecs.encoder = encoder
    return _codecs.encoder, _codecs.decoder


def encode_item(item: Any) -> str:
    """``mm_serde.encode_mm_kwargs_item`` with this thread's encoder: base64 of vLLM's msgpack."""
    import pybase64

    (buf,) = _thread_codec()[0].encode(item)
    return pybase64.b64encode(buf).decode("ascii")


def decode_item(payload: bytes | str, error: type[MMRefError], what: str, ref: str | None = None) -> Any:
    """Decode vLLM's msgpack item (``bytes``) or its base64 (``str``) the way vLLM will.

    Raises:
        ``error``: not base64, not msgpack, or not a ``MultiModalKwargsItem`` of tensors; the
            message names ``what`` and the decoder's error type, never the bytes.
        ImportError: vLLM's codec cannot be imported (a server fault, never a client 4xx).
    """
    import pybase64

    decoder = _thread_codec()[1]  # outside the try: a broken vLLM install is the server's error
    try:
        # as vLLM's mm_serde.decode_mm_kwargs_item: characters outside the alphabet (line breaks of
        # a MIME-wrapped encoding) are skipped, not refused
        raw = pybase64.b64decode(payload) if isinstance(payload, str) else payload
        item = decoder.decode(raw)
        if not item or not all(hasattr(v, "data") and hasattr(v.data, "shape") for v in item.values()):
            raise ValueError("no tensor fields")
    except Exception as e:  # untrusted bytes: any failure is the sender's
        raise error(f"{what} is not a valid vLLM item ({type(e).__name__})", ref=ref) from e
    return item


@dataclass(frozen=True)
class CheckedItem:
    """What the plugin knows about one item once :meth:`ItemLayout.check` accepted it."""

    grid: tuple[int, ...]
    num_placeholders: int
    """Placeholder tokens (embeddings) the item takes in the prompt."""


@dataclass(frozen=True)
class PixelRange:
    """The ``pixel_values`` the served model's processor can produce: uint8 (vLLM's device
    normalization: raw 0-255, ``mm_device_do_normalize``), or float32 within ``[low, high]``, the
    union of the processor's normalized output range (measured by processing an all-black and an
    all-white image through it: its rescale and per-channel normalization are monotone) and the
    raw range 0-255 vLLM's device normalization takes in float too."""

    low: float
    high: float

    TOLERANCE = 1e-3
    """Slack for float rounding across processor backends and devices (normalized units)."""

    @classmethod
    def of(cls, adapter: ImageAdapter) -> PixelRange:
        from PIL import Image

        lows, highs = [], []
        for value in (0, 255):
            image = Image.new("RGB", (64, 64), (value, value, value))
            pixels = adapter.process(image).tensors["pixel_values"]
            lows.append(float(pixels.min()))
            highs.append(float(pixels.max()))
        return cls(min(min(lows), 0.0) - cls.TOLERANCE, max(max(highs), 255.0) + cls.TOLERANCE)

    def check(self, pixels: Any, error: type[MMRefError], what: str, ref: str | None) -> None:
        """Refuse a dtype the processor never emits, and non-finite or out-of-range values.

        Raises:
            ``error``: naming the dtype, or the range found and the range allowed.
        """
        import torch

        if pixels.dtype == torch.uint8:
            return
        if pixels.dtype != torch.float32:
            raise error(
                f"{what} pixel_values are {pixels.dtype}; the served model's processor emits uint8 "
                "or float32",
                ref=ref,
            )
        if pixels.numel() == 0:
            return
        low, high = (float(v) for v in torch.aminmax(pixels))
        if not (self.low <= low and high <= self.high):  # NaN fails both comparisons
            raise error(
                f"{what} pixel_values span [{low:.6g}, {high:.6g}]; the served model's processor emits "
                f"finite values in [{self.low:.6g}, {self.high:.6g}]",
                ref=ref,
            )


class ItemLayout:
    """The served model's item layout: checks an item against it and reads its grid.

    Args:
        adapter: the served family's adapter (grid field, placeholder arithmetic, a reference item).
        fields_config: ``BatchFeature -> {field: MultiModalFieldConfig}``, the served model's
            ``_get_mm_fields_config``.
    """

    def __init__(self, adapter: ImageAdapter, fields_config: Callable[[Any], Mapping[str, Any]]) -> None:
        self.adapter = adapter
        self.fields_config = fields_config
        small = adapter.grid_for_size(64, 64)  # a few kB: the layout does not depend on the size
        tensors = dict(adapter.zero_features(small).tensors)  # float32 pixels
        reference = self._rebuild(tensors)
        self.reference = {
            key: (type(elem.field), elem.data.dtype, _row_shape(elem)) for key, elem in reference.items()
        }
        """``{field: (field kind, dtype, shape without the flat dimension)}`` of the served model."""
        self.float32_bytes_per_placeholder = sum(
            t.numel() * t.element_size() for t in tensors.values()
        ) / adapter.num_placeholders(small)
        """Tensor bytes of a float32 item per placeholder token it takes (sizes request bodies)."""
        self.pixel_range = PixelRange.of(adapter)

    def _rebuild(self, hf_inputs: Mapping[str, Any]) -> Any:
        """The one item vLLM builds from per-field tensors with the model's own field config.

        Raises:
            ValueError: not exactly one item of the served modality.
        """
        from transformers import BatchFeature

        batch = BatchFeature(dict(hf_inputs))
        config = self.fields_config(batch)
        items = load("MultiModalKwargsItems.from_hf_inputs")(batch, config)
        modality = self.adapter.vllm_modality
        if set(items) != {modality} or len(items[modality]) != 1:
            counts = {m: len(v) for m, v in items.items()}
            raise ValueError(f"fields build {counts} items, not one {modality} item")
        for key, cfg in config.items():
            if key in batch and _is_flat(cfg.field):
                _check_flat_span(cfg.field, batch[key], key)
        return items[modality][0]

    def grid_of(
        self, item: Any, error: type[MMRefError], what: str, ref: str | None = None
    ) -> tuple[int, ...]:
        """The item's grid: ``grid_len`` ints in ``1..2**20``, read without sizing anything, each
        side a multiple of the processor's merge size (``adapter.check_grid(bounded=False)``: the
        engine's vision tower cannot reshape another; the processor's size limits are not applied,
        the item carries its own rows and may come from a render with larger limits).

        Raises:
            ``error``: no grid field, or not such ints.
            GridMismatch: a grid the processor cannot produce.
        """
        grid_field = self.adapter.grid_field
        try:
            values = item[grid_field].data.reshape(-1)[: self.adapter.grid_len + 1].tolist()
            grid = tuple(int(g) for g in values)
            if len(grid) != self.adapter.grid_len or min(grid) < 1 or max(grid) >= 1 << 20:
                raise ValueError(f"{grid_field} {list(grid)} is not {self.adapter.grid_len} ints in 1..2^20")
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise error(f"{what}: {e}", ref=ref) from e
        return self.adapter.check_grid(grid, ref=ref, bounded=False)

    def check(self, item: Any, error: type[MMRefError], what: str, ref: str | None = None) -> CheckedItem:
        """Check ``item`` (a decoded ``MultiModalKwargsItem``) against the served layout.

        Allocates nothing for the item's claimed grid: the rebuild slices views of the item's own
        tensors, whose size the request or file already paid for.

        Raises:
            ``error``: naming the first field that differs (no values, no reprs).
            GridMismatch: a grid the processor cannot produce (:meth:`grid_of`).
        """
        grid_field = self.adapter.grid_field
        if set(item) != set(self.reference):
            raise error(f"{what} has fields {sorted(item)}; the served model's item has "
                        f"{sorted(self.reference)}", ref=ref)  # fmt: skip
        for key, (kind, dtype, row_shape) in self.reference.items():
            elem = item[key]
            if type(elem.field) is kind and not _well_formed(elem):
                raise error(f"{what} field {key!r}: its flat dim or slices are not ints", ref=ref)
            if type(elem.field) is not kind or _row_shape(elem) != row_shape:
                raise error(
                    f"{what} field {key!r} is {type(elem.field).__name__} {list(elem.data.shape)}; "
                    f"the served model takes {kind.__name__} with rows {list(row_shape)}",
                    ref=ref,
                )
            if key != "pixel_values" and elem.data.dtype != dtype:
                raise error(f"{what} field {key!r} is {elem.data.dtype}, not {dtype}", ref=ref)
        self.pixel_range.check(item["pixel_values"].data, error, what, ref)
        grid = self.grid_of(item, error, what, ref)
        try:
            rebuilt = self._rebuild({key: elem.field.reduce_data([elem]) for key, elem in item.items()})
            for key, elem in item.items():
                if tuple(rebuilt[key].data.shape) != tuple(elem.data.shape):
                    raise ValueError(f"field {key!r} rows {list(elem.data.shape)} do not fit {grid_field}")
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            raise error(f"{what}: {e}", ref=ref) from e
        return CheckedItem(grid, self.adapter.num_placeholders(grid))


def _is_flat(field: Any) -> bool:
    return isinstance(field, load("MultiModalFlatField"))


def _well_formed(elem: Any) -> bool:
    """A flat field's ``dim`` is an int within its tensor and its slices are ``slice`` s of ints
    (or None; vLLM's own items hold 0-d integer tensors) with step 1: vLLM's decoder takes any
    msgpack values there and slices with them in the engine."""
    if not _is_flat(elem.field):
        return True
    dim, ndim = elem.field.dim, elem.data.ndim
    if type(dim) is not int or not -ndim <= dim < ndim:
        return False
    specs = [x for s in elem.field.slices for x in (s if isinstance(s, tuple | list) else (s,))]
    return all(
        isinstance(s, slice) and s.step in (None, 1) and _index(s.start) and _index(s.stop) for s in specs
    )


def _index(value: Any) -> bool:
    """None, an int, or a 0-d integer tensor."""
    import torch

    if value is None or type(value) is int:
        return True
    return (
        isinstance(value, torch.Tensor)
        and value.ndim == 0
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


def _row_shape(elem: Any) -> tuple[int, ...]:
    """The element's shape without its flat dimension (the rows an item of any size has)."""
    shape = tuple(elem.data.shape)
    if _is_flat(elem.field):
        return shape[: elem.field.dim] + shape[elem.field.dim + 1 :]
    return shape


def _check_flat_span(field: Any, data: Any, key: str) -> None:
    """A single item's flat field must span exactly its data along ``field.dim`` (vLLM slices
    ``data[0:stop]`` and a ``stop`` beyond the rows would silently keep fewer rows than the grid says).

    Raises:
        ValueError: naming the field.
    """
    rows = int(data.shape[field.dim])
    for spec in field.slices:
        s = spec[-1] if isinstance(spec, tuple) else spec
        start, stop = int(s.start or 0), int(s.stop if s.stop is not None else rows)
        if start != 0 or stop != rows:
            raise ValueError(f"field {key!r} has {rows} rows; its grid needs {stop - start}")
