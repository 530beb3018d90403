"""``vllm_plugin.weights`` without a server: what binds a request to
the served weights (docs/WEIGHT-UPDATES.md). The real-server behaviour: tests/test_weight_updates.py."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.outputs import WeightVersionSpan

from vllm_plugin.weights import (
    ENGINE_HASH_PREFIX,
    ContentHandle,
    ContentKey,
    binding_digest,
    engine_hash,
    parse_handle,
    served_by,
    version_salt,
)

IMAGE = ContentKey("image", "ab" * 32, ".jpg", "f" * 32, "raw")
FEATURE = ContentKey("feature", "ab" * 32, "", "f" * 32, "raw")


def test_engine_hash_binds_content_and_version():
    for key in (IMAGE, FEATURE):
        h = engine_hash(key, "step-1")
        assert h.startswith(ENGINE_HASH_PREFIX) and h == engine_hash(key, "step-1")
        assert h != engine_hash(key, "step-2")
        assert h != engine_hash(dataclasses.replace(key, sha256="cd" * 32), "step-1")
        assert h != engine_hash(dataclasses.replace(key, fingerprint="e" * 32), "step-1")
    assert engine_hash(IMAGE, "1") != engine_hash(dataclasses.replace(IMAGE, pixel_mode="normalized"), "1")
    assert engine_hash(IMAGE, "1") != engine_hash(dataclasses.replace(IMAGE, ext=".png"), "1")
    # the binding's fields are framed: a split elsewhere is another digest
    assert binding_digest("f1", "raw", "2") != binding_digest("f", "1raw", "2")


def test_an_image_hash_names_its_content_and_binding_a_feature_hash_does_not():
    h = engine_hash(IMAGE, "step-1")
    binding = binding_digest(IMAGE.fingerprint, IMAGE.pixel_mode, "step-1")
    assert h == f"mmref-{'ab' * 32}.jpg-{binding}" and len(h) == 107
    assert parse_handle(h) == ContentHandle("ab" * 32, ".jpg", binding)
    opaque = engine_hash(FEATURE, "step-1")
    assert len(opaque) == len(ENGINE_HASH_PREFIX) + 64 and parse_handle(opaque) is None
    for other in ("mmref-in-step", h + "0", h.replace(".jpg", ".bmp"), h.upper(), "x" + h[1:], h[:-1]):
        assert parse_handle(other) is None, other


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
