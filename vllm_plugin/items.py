"""vLLM's item wire format, and the check that an item is one the served model can take.

A ``features.kwargs_data`` slot is vLLM's base64 msgpack ``MultiModalKwargsItem``
(``vllm/.../token_in_token_out/mm_serde.py``). vLLM decodes it and hands it to the engine with no
check of its fields against the model or of its rows against its grid; a mismatch fails inside the
engine (the process exits) or silently misaligns features. :class:`ItemLayout` checks an item
before the engine sees it, with the served model's own field config and without allocating for
what the item claims:

- exactly the fields, field kinds and (but for ``pixel_values``, whose dtype follows the pixel mode
  or the client) dtypes of the served model's item, and the same per-row shape;
- rebuilt through the model's field config (``_get_mm_fields_config``, the layout vLLM declares
  once per model), the item is exactly one item and every flat field's rows are exactly the rows
  its grid implies (``Qwen2-VL``: ``pixel_values`` ``[t*h*w, C*T*P*P]`` for ``image_grid_thw``
  ``[t, h, w]``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.adapters import ImageAdapter
from protocol.errors import MMRefError

__all__ = ["CheckedItem", "ItemLayout", "decode_item", "encode_item"]

_codecs = threading.local()


def _thread_codec() -> tuple[Any, Any]:
    """This thread's vLLM ``MsgpackEncoder``/``MsgpackDecoder`` (not thread-safe for tensors, so
    one per worker thread instead of ``mm_serde``'s module-level pair)."""
    if not hasattr(_codecs, "encoder"):
        from vllm.multimodal.inputs import MultiModalKwargsItem
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        _codecs.encoder = MsgpackEncoder(size_threshold=2**62)  # all tensors inline, as mm_serde
        _codecs.decoder = MsgpackDecoder(t=MultiModalKwargsItem)
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
        raw = pybase64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
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
        tensors = dict(adapter.synthesize_placeholder(small).tensors)  # float32 pixels
        reference = self._rebuild(tensors)
        self.reference = {
            key: (type(elem.field), elem.data.dtype, _row_shape(elem)) for key, elem in reference.items()
        }
        """``{field: (field kind, dtype, shape without the flat dimension)}`` of the served model."""
        self.float32_bytes_per_placeholder = sum(
            t.numel() * t.element_size() for t in tensors.values()
        ) / adapter.num_placeholders(small)
        """Tensor bytes of a float32 item per placeholder token it takes (sizes request bodies)."""

    def _rebuild(self, hf_inputs: Mapping[str, Any]) -> Any:
        """The one item vLLM builds from per-field tensors with the model's own field config.

        Raises:
            ValueError: not exactly one item of the served modality.
        """
        from transformers import BatchFeature
        from vllm.multimodal.inputs import MultiModalKwargsItems

        batch = BatchFeature(dict(hf_inputs))
        config = self.fields_config(batch)
        items = MultiModalKwargsItems.from_hf_inputs(batch, config)
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
        """The item's grid: ``grid_len`` ints in ``1..2**20``, read without sizing anything.

        Raises:
            ``error``: no grid field, or not such ints.
        """
        grid_field = self.adapter.grid_field
        try:
            values = item[grid_field].data.reshape(-1)[: self.adapter.grid_len + 1].tolist()
            grid = tuple(int(g) for g in values)
            if len(grid) != self.adapter.grid_len or min(grid) < 1 or max(grid) >= 1 << 20:
                raise ValueError(f"{grid_field} {list(grid)} is not {self.adapter.grid_len} ints in 1..2^20")
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise error(f"{what}: {e}", ref=ref) from e
        return grid

    def check(self, item: Any, error: type[MMRefError], what: str, ref: str | None = None) -> CheckedItem:
        """Check ``item`` (a decoded ``MultiModalKwargsItem``) against the served layout.

        Allocates nothing for the item's claimed grid: the rebuild slices views of the item's own
        tensors, whose size the request or file already paid for.

        Raises:
            ``error``: naming the first field that differs (no values, no reprs).
        """
        grid_field = self.adapter.grid_field
        if set(item) != set(self.reference):
            raise error(f"{what} has fields {sorted(item)}; the served model's item has "
                        f"{sorted(self.reference)}", ref=ref)  # fmt: skip
        for key, (kind, dtype, row_shape) in self.reference.items():
            elem = item[key]
            if type(elem.field) is not kind or _row_shape(elem) != row_shape:
                raise error(
                    f"{what} field {key!r} is {type(elem.field).__name__} {list(elem.data.shape)}; "
                    f"the served model takes {kind.__name__} with rows {list(row_shape)}",
                    ref=ref,
                )
            if key != "pixel_values" and elem.data.dtype != dtype:
                raise error(f"{what} field {key!r} is {elem.data.dtype}, not {dtype}", ref=ref)
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
    from vllm.multimodal.inputs import MultiModalFlatField

    return isinstance(field, MultiModalFlatField)


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
