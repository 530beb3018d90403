"""``vllm_plugin.weights`` without a server: what binds a request to
the served weights (docs/WEIGHT-UPDATES.md). The real-server behaviour: tests/test_weight_updates.py."""

from __future__ import annotations

import pytest
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.outputs import WeightVersionSpan

from vllm_plugin.weights import ENGINE_HASH_PREFIX, engine_hash, served_by, version_salt

KEY = "mmref:v1:" + "ab" * 32 + ":fp:raw"


def test_engine_hash_binds_content_and_version():
    h = engine_hash(KEY, "step-1")
    assert h.startswith(ENGINE_HASH_PREFIX) and len(h) == len(ENGINE_HASH_PREFIX) + 64
    assert h == engine_hash(KEY, "step-1")
    assert h != engine_hash(KEY, "step-2")
    assert h != engine_hash(KEY.replace("ab", "cd", 1), "step-1")
    # the NUL separator: a key/version split elsewhere is another hash
    assert engine_hash(KEY + "1", "2") != engine_hash(KEY, "12")


@pytest.mark.parametrize("client_salt", [None, "salt-1", "x" * 128, "null"])
def test_version_salt_is_a_salt_vllm_accepts(client_salt):
    salt = version_salt(client_salt, "step-1")
    validate_cache_salt(salt)  # raises on a salt vLLM refuses
    assert len(salt) == 70 and salt != version_salt(client_salt, "step-2")


def test_version_salt_keeps_client_salts_apart():
    salts = {version_salt(s, "v") for s in (None, "null", "a", "b", "")}
    assert len(salts) == 5


def _response(*spans: tuple[str, ...] | None) -> GenerateTokensResponse:
    """One choice per argument, with one ``weight_versions`` span per version named."""
    choices = [
        GenerateTokensChoice(
            index=i,
            token_ids=[1, 2],
            weight_versions=[WeightVersionSpan(v, k, k + 1) for k, v in enumerate(s)] if s else None,
        )
        for i, s in enumerate(spans)
    ]
    return GenerateTokensResponse(choices=choices)


def test_served_by_needs_every_span_of_every_choice_under_the_version():
    assert served_by(_response(("v1",), ("v1", "v1")), "v1")
    assert not served_by(_response(("v1",), ("v0",)), "v1")  # one choice prefilled under other weights
    assert not served_by(_response(("v1", "v2")), "v1")  # weights changed mid-generation: a mix
    assert served_by(_response(None), "v1")  # no token sampled: nothing to compare
    assert served_by(_response(), "v1")
