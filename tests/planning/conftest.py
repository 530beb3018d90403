"""Fixtures shared by the planning tests."""

from __future__ import annotations

import importlib
import sys

import pytest

from helpers import REPO
from trainer_lib.planning.cost import CostModel


@pytest.fixture(scope="module")
def bench_mix():
    """``bench/pack.py``: the realistic mix, and the Qwen2-VL-2B cost model of its shapes."""
    sys.path.insert(0, str(REPO / "bench"))
    pack = importlib.import_module("pack")
    models = importlib.import_module("_models")
    return pack, CostModel.from_config(models.qwen2_vl_2b_config())
