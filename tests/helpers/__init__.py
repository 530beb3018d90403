"""Shared test helpers, one module per concern; test files import them from here (``from helpers
import photo_bytes``), which re-exports every module's names. Importing the package puts
``scripts/`` (the tiny models, the server launcher) and ``bench/`` (``pack.py``'s refs) on
``sys.path`` first, for its modules and for the tests.

- :mod:`helpers.photos`: real photos (scikit-image);
- :mod:`helpers.servers`: the vLLM server launcher (:func:`served`), its flags, readers of answers;
- :mod:`helpers.rollouts`: rollouts, the trainer's recompute against the server, weight sets;
- :mod:`helpers.layout`: the package layout as data;
- :mod:`helpers.packing`: samples to pack (refs whose pixels are never read);
- :mod:`helpers.oracles`: vLLM's multimodal processor as the adapter tests' oracle;
- :mod:`helpers.forward`: the packed forward on tiny models and its oracles;
- :mod:`helpers.s3`: a real S3 endpoint and a proxy for its faults;
- :mod:`helpers.ranks`: ranks as processes for the multi-rank tests (:func:`join_ranks`).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (``tests/helpers/`` is two levels below it)."""
sys.path.insert(0, str(REPO / "scripts"))
sys.path.append(str(REPO / "bench"))  # bench/pack.py's refs (make_ref)

from make_tiny_models import ensure_tiny_model  # noqa: E402

from .forward import (  # noqa: E402
    Families,
    Family,
    chat,
    forward_backward,
    gradients,
    reference_logprobs,
    relative,
    run_packed,
    vllm_positions,
)
from .layout import package_modules, public_top_level_names  # noqa: E402
from .oracles import (  # noqa: E402
    KIMI_GRID_SIZES,
    QWEN_GRID_SIZES,
    Oracle,
    chat_ids,
    check_against_vllm,
    image_bytes,
    make_oracle,
    oracle_settings,
)
from .packing import (  # noqa: E402
    FAKE,
    IM_END,
    IM_START,
    PAD,
    SPEC,
    TOK,
    V_END,
    V_START,
    FakeAdapter,
    count,
    make_ref,
    make_sample,
)
from .photos import photo_array, photo_bytes  # noqa: E402
from .ranks import join_ranks  # noqa: E402
from .rollouts import jittered_weights, rollout, rollout_sample, server_mismatch  # noqa: E402
from .s3 import FIXTURE_ENV, DelayProxy, MotoS3  # noqa: E402
from .servers import (  # noqa: E402
    SERVER_ARGS,
    SERVER_CACHE_BUDGET,
    VLLMServer,
    dev_served,
    refusal,
    served,
    start_server,
    tokens_and_logprobs,
    warm_up,
)

__all__ = [
    "FAKE",
    "FIXTURE_ENV",
    "IM_END",
    "IM_START",
    "KIMI_GRID_SIZES",
    "PAD",
    "QWEN_GRID_SIZES",
    "REPO",
    "SERVER_ARGS",
    "SERVER_CACHE_BUDGET",
    "SPEC",
    "TOK",
    "V_END",
    "V_START",
    "DelayProxy",
    "FakeAdapter",
    "Families",
    "Family",
    "MotoS3",
    "Oracle",
    "VLLMServer",
    "chat",
    "chat_ids",
    "check_against_vllm",
    "count",
    "dev_served",
    "ensure_tiny_model",
    "forward_backward",
    "gradients",
    "image_bytes",
    "jittered_weights",
    "join_ranks",
    "make_oracle",
    "make_ref",
    "make_sample",
    "oracle_settings",
    "package_modules",
    "photo_array",
    "photo_bytes",
    "public_top_level_names",
    "reference_logprobs",
    "refusal",
    "relative",
    "rollout",
    "rollout_sample",
    "run_packed",
    "served",
    "server_mismatch",
    "start_server",
    "tokens_and_logprobs",
    "vllm_positions",
    "warm_up",
]
