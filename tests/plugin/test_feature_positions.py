"""``vllm_plugin.feature_positions`` without a server: a ``features`` request's positions read
from vLLM's fields, the reads they cost and the reserved ``mmref-`` namespace (the checks that
resolve, decode or ask the engine run against real servers: ``tests/plugin/test_route_attacks.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protocol.errors import InvalidRequest
from vllm_plugin.feature_positions import Position, PositionChecks, positions
from vllm_plugin.weights import ContentKey, engine_hash

HANDLE = engine_hash(ContentKey("image", "ab" * 32, ".jpg", "f" * 16, "raw"), "v0")
"""A content-named image hash (``weights.parse_handle`` reads it)."""
REF = "mmraw:" + "A" * 40


def features(hashes: list[str], kwargs: list | None, metadata: list | None = None) -> SimpleNamespace:
    """vLLM's ``MultiModalFeatures`` for one image modality (the fields positions read)."""
    ranges = [SimpleNamespace(offset=10 * i, length=4) for i in range(len(hashes))]
    return SimpleNamespace(
        mm_placeholders={"image": ranges},
        kwargs_data=None if kwargs is None else {"image": kwargs},
        mm_metadata=None if metadata is None else {"image": metadata},
    )


@pytest.fixture
def checks() -> PositionChecks:
    adapter = SimpleNamespace(vllm_modality="image")
    return PositionChecks(
        SimpleNamespace(adapter=adapter), object(), placeholder_token_id=5, ec_transfer=False
    )


def test_positions_read_vllms_fields_in_order_absent_fields_as_null_slots():
    found = positions(features(["a", "b"], None), "image", ["a", "b"])
    assert [(p.index, p.mm_hash, p.slot, p.metadata) for p in found] == [
        (0, "a", None, None),
        (1, "b", None, None),
    ]
    assert [p.placeholder.offset for p in found] == [0, 10]
    found = positions(features(["a", "b"], [REF, "item"], [None, "meta"]), "image", ["a", "b"])
    assert [(p.slot, p.metadata) for p in found] == [(REF, None), ("item", "meta")]


def test_each_ref_and_each_content_named_null_slot_costs_a_read(checks):
    found = positions(
        features(["a", "b", HANDLE, "opaque"], [REF, "item", None, None]),
        "image",
        ["a", "b", HANDLE, "opaque"],
    )
    assert checks.reads(found) == 2  # the ref, the handle; not the inline item, nor an opaque hash


@pytest.mark.parametrize(("slot", "metadata"), [("item", None), (None, "meta")])
def test_an_item_the_server_does_not_resolve_may_not_claim_a_reserved_hash(checks, slot, metadata):
    found = [Position(0, "x", None, None, None), Position(1, HANDLE, slot, metadata, None)]
    with pytest.raises(InvalidRequest, match=r"^image item 1: hashes starting with 'mmref-' are reserved"):
        checks.check_reserved(found)


def test_a_ref_or_a_null_slot_may_carry_a_reserved_hash(checks):
    checks.check_reserved([Position(0, HANDLE, REF, None, None), Position(1, HANDLE, None, None, None)])
