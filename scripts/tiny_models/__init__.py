"""Tiny random-weight Qwen and Kimi vision-language models, built offline (``make_tiny_models.py``).

- :mod:`tiny_models.qwen` — Qwen2-VL, Qwen2.5-VL, Qwen3-VL and what every Qwen family shares.
- :mod:`tiny_models.qwen3_5` — Qwen3.5, Qwen3.5-MoE (Qwen3.6's architecture) and Qwen3-VL-MoE.
- :mod:`tiny_models.kimi` — Kimi K2.5 and Kimi-VL (docs/KIMI.md).
- :mod:`tiny_models.build` — recipe hashes, the cache, atomic builds.

The directories load with ``HF_HUB_OFFLINE=1`` and without ``trust_remote_code`` (except
Kimi-VL) in transformers and in vLLM. Builds are cached: a directory whose marker file holds the
current recipe hash is reused as is.
"""

from tiny_models.build import (
    DEFAULT_ROOT,
    FAMILIES,
    REMOTE_CODE_FAMILIES,
    build_into,
    ensure_tiny_model,
    is_current,
    recipe_hash,
    write_model,
)
from tiny_models.qwen3_5 import SERVE_DTYPES

__all__ = [
    "DEFAULT_ROOT",
    "FAMILIES",
    "REMOTE_CODE_FAMILIES",
    "SERVE_DTYPES",
    "build_into",
    "ensure_tiny_model",
    "is_current",
    "recipe_hash",
    "write_model",
]
