"""The bench model: the tiny random-weight Qwen2-VL with the REAL Qwen2-VL image-size limits.

``scripts/make_tiny_models.py`` caps images at 64 merged tokens so tests run fast. The benches
need images processed at real cost, so this copies that model and rewrites the image
processor's size limits to the released Qwen2-VL-*-Instruct ``preprocessor_config.json``
(``min_pixels`` 3136 = 56*56, ``max_pixels`` 12845056 = 28*28*16384; patch 14, merge 2,
temporal patch 2, CLIP mean/std, bicubic). A 1024x768 photo then becomes grid ``[1, 54, 74]``:
3996 patches of 1176 values, 999 placeholder tokens, exactly as for the real model. The
language model stays tiny (2 layers, hidden 64), with the released model's 32768 positions
(``max_position_embeddings``; the tiny recipe's 4096 would not fit a multi-turn prompt of six
1024x768 images).

Cached under ``<repo>/.cache/bench_models/qwen2_vl_realsize`` (rebuilt when the source model's
recipe or the limits change). :func:`qwen2_vl_2b_config` is the full-size Qwen2-VL-2B config
(published shapes, for random weights on a GPU and for the FLOP cost model).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from _common import REPO

__all__ = [
    "REAL_MAX_PIXELS",
    "REAL_MAX_POSITIONS",
    "REAL_MIN_PIXELS",
    "ensure_bench_model",
    "qwen2_vl_2b_config",
]

REAL_MIN_PIXELS = 56 * 56
REAL_MAX_PIXELS = 28 * 28 * 16384
"""Qwen2-VL-*-Instruct ``preprocessor_config.json``: min_pixels 3136, max_pixels 12845056."""
REAL_MAX_POSITIONS = 32768
"""Qwen2-VL-*-Instruct ``config.json``: ``max_position_embeddings``."""

ROOT = REPO / ".cache" / "bench_models"
MARKER = "bench_model.json"


def _real_size(section: dict) -> dict:
    out = dict(section)
    out["size"] = {"shortest_edge": REAL_MIN_PIXELS, "longest_edge": REAL_MAX_PIXELS}
    return out


def ensure_bench_model() -> Path:
    """Return the real-size tiny Qwen2-VL folder, building it from ``ensure_tiny_model`` if needed."""
    from make_tiny_models import ensure_tiny_model

    source = ensure_tiny_model("qwen2_vl")
    recipe = json.loads((source / "tiny_model_recipe.json").read_text())
    want = {
        "source_recipe": recipe["recipe_hash"],
        "min_pixels": REAL_MIN_PIXELS,
        "max_pixels": REAL_MAX_PIXELS,
        "max_position_embeddings": REAL_MAX_POSITIONS,
    }
    target = ROOT / "qwen2_vl_realsize"
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return target
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and json.loads(marker.read_text()) == want:
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".realsize-", dir=ROOT))
        try:
            shutil.copytree(source, tmp, dirs_exist_ok=True)
            pre = json.loads((tmp / "preprocessor_config.json").read_text())
            (tmp / "preprocessor_config.json").write_text(json.dumps(_real_size(pre), indent=2) + "\n")
            proc = json.loads((tmp / "processor_config.json").read_text())
            proc["image_processor"] = _real_size(proc["image_processor"])
            (tmp / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")
            config = json.loads((tmp / "config.json").read_text())
            config["text_config"]["max_position_embeddings"] = REAL_MAX_POSITIONS
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            (tmp / MARKER).write_text(json.dumps(want, indent=2) + "\n")
            tmp.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


IMAGE_TOKEN, V_START, V_END = 151655, 151652, 151653  # Qwen2-VL's ids (the 2B-shaped config)


def qwen2_vl_2b_config():
    """Qwen2-VL-2B-Instruct's published shapes (config.json), random weights."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 32,
            "embed_dim": 1280,
            "hidden_size": 1536,
            "mlp_ratio": 4,
            "num_heads": 16,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
    )


if __name__ == "__main__":
    print(ensure_bench_model())
