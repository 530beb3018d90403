"""The distinct images of a batch collated as each is processed (``materialize``'s default layout).

:meth:`protocol.adapters.ImageAdapter.collate` concatenates finished images along dim 0: a second
copy of every pixel, made after the last image is processed, into freshly faulted memory, while
every image's own tensors are still held. :class:`FeatureWriter` sizes the collated tensors from
the refs' grids before any image is processed (:meth:`~protocol.adapters.ImageAdapter.pixel_shape`),
and each pool worker copies its image into its rows as soon as the processor returns it: the copy
runs on the pool beside the processing of the other images, and an image's own tensors can be
freed at once, so the processor's next output reuses their memory (a call 1.22x faster with 2
workers, 1.33x with 1, paired against a ``collate`` after the pool; peak RSS 0.74x -> 0.64x of
the batch's pixel bytes: docs/PERFORMANCE.md §3).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence

import torch

from protocol.adapters import ImageAdapter, ProcessedImage

__all__ = ["FeatureWriter"]


class FeatureWriter:
    """The collated features of ``grids`` (one image per key, in the mapping's order: row
    :attr:`index` ``[key]``), filled by :meth:`put` from any thread; :meth:`features` equals
    ``adapter.collate`` of the same images in that order.

    The tensors are allocated at the first :meth:`put`, with its dtypes and device (one
    processor, one layout); a later image of another dtype (float32 zero features beside uint8
    ``raw_pixels`` pixels) is cast on copy, exactly for zeros, and :meth:`features`
    returns the promoted dtype, as ``torch.cat`` does.
    """

    def __init__(self, adapter: ImageAdapter, grids: Mapping[Hashable, Sequence[int]]) -> None:
        self.index = {key: k for k, key in enumerate(grids)}
        """Each key's image row (``image_grid_thw`` row; ``image_index`` values)."""
        starts = [0]
        for grid in grids.values():
            starts.append(starts[-1] + adapter.pixel_shape(grid)[0])
        self._rows = {"pixel_values": starts, adapter.grid_field: list(range(len(grids) + 1))}
        self._out: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._put = [False] * len(grids)
        self._lock = threading.Lock()

    def put(self, key: Hashable, item: ProcessedImage) -> None:
        """Copy the image of ``key`` into its rows.

        Raises:
            ValueError: fields other than the adapter's, a tensor whose shape is not the one its
                grid gives, or a non-zero tensor of a wider dtype than the outputs'.
        """
        k = self.index[key]
        if item.tensors.keys() != self._rows.keys():
            raise ValueError(f"image {key}: fields {sorted(item.tensors)} != {sorted(self._rows)}")
        out = self._outputs(item)
        for field, src in item.tensors.items():
            dst = out[field][self._rows[field][k] : self._rows[field][k + 1]]
            if src.shape != dst.shape:
                got, want = tuple(src.shape), tuple(dst.shape)
                raise ValueError(f"image {key}: {field} {got}, its grid gives {want}")
            if torch.promote_types(src.dtype, dst.dtype) != dst.dtype:
                if src.any():
                    raise ValueError(f"image {key}: {field} {src.dtype} would be cast to {dst.dtype}")
                with self._lock:
                    self._dtypes[field] = torch.promote_types(self._dtypes[field], src.dtype)
            dst.copy_(src)
        self._put[k] = True

    def has(self, key: Hashable) -> bool:
        """Whether the image of ``key`` was :meth:`put` (KeyError: a key not in the grids)."""
        return self._put[self.index[key]]

    def _outputs(self, item: ProcessedImage) -> dict[str, torch.Tensor]:
        """The collated tensors, allocated at the first call after ``item``'s dtypes and device."""
        with self._lock:
            if not self._out:
                for field, t in item.tensors.items():
                    rows = self._rows[field][-1]
                    self._out[field] = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    self._dtypes[field] = t.dtype
            return self._out

    def features(self) -> dict[str, torch.Tensor]:
        """The collated tensors (Qwen-VL: ``pixel_values`` ``[sum(t*h*w), C*T*P*P]``,
        ``image_grid_thw`` int64 ``[N, 3]``).

        Raises:
            ValueError: an image not put.
        """
        missing = [key for key, k in self.index.items() if not self._put[k]]
        if missing:
            raise ValueError(f"images {missing} were not put")
        return {field: t.to(self._dtypes[field]) for field, t in self._out.items()}
