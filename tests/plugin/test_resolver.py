"""``vllm_plugin.resolver`` in process (no server), with the tiny Qwen2-VL's own vLLM field config:
each ref is parsed and checked once per item (issue 45), on the miss and on the ``mm_refs`` form's
declared-grid check, with the refusals unchanged."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

import protocol.roots
import protocol.store
import vllm_plugin.resolver
from protocol.errors import InvalidRef, UnsupportedFamily
from protocol.refs import parse_ref
from vllm_plugin.config import PluginConfig
from vllm_plugin.engine_items import EngineItems
from vllm_plugin.feature_positions import PositionChecks
from vllm_plugin.resolution import FeatureForm
from vllm_plugin.resolver import MMRefResolver

pytestmark = pytest.mark.timeout(300)


class Counted:
    """A function that counts its calls (by the ``ref`` keyword, or the first argument)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs.get("ref", args[0] if args else None))
        return self.fn(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch, qwen2_vl_adapter) -> dict[str, Counted]:
    """The parse, the adapter's ref check and the ``file://`` URI read, counted where the server
    calls them."""
    spies = {
        "parse_ref": Counted(vllm_plugin.resolver.parse_ref),
        "check_ref": Counted(qwen2_vl_adapter.check_ref),
        "uri (roots)": Counted(protocol.roots.file_uri_to_path),
        "uri (store)": Counted(protocol.store.file_uri_to_path),
    }
    monkeypatch.setattr(vllm_plugin.resolver, "parse_ref", spies["parse_ref"])
    monkeypatch.setattr(qwen2_vl_adapter, "check_ref", spies["check_ref"])
    monkeypatch.setattr(protocol.roots, "file_uri_to_path", spies["uri (roots)"])
    monkeypatch.setattr(protocol.store, "file_uri_to_path", spies["uri (store)"])
    return spies


@pytest.fixture
def resolver(qwen2_vl_adapter, layout, output_root) -> MMRefResolver:
    """A resolver as ``startup.build_resolver`` makes it, over ``MMREF_ASSET_ROOT`` (v1 refs by path)."""
    config = PluginConfig(asset_root=output_root, max_workers=1)
    return MMRefResolver(qwen2_vl_adapter, config, layout=layout, raw_pixels=True)


def test_a_ref_is_parsed_and_checked_once_and_its_parse_travels(resolver, counted, photo_refs):
    ref = photo_refs["coffee"].ref
    item = asyncio.run(resolver.resolve(ref))
    assert item.body == parse_ref(ref)  # the parse the declared-grid check reads
    assert item.grid == tuple(photo_refs["coffee"].grid)
    # one parse, one adapter check (before the work is queued; not again in read_raw), and the
    # v1 file:// URI read once (by the roots; the legacy store is handed the path)
    assert {k: len(c.calls) for k, c in counted.items()} == {
        "parse_ref": 1,
        "check_ref": 1,
        "uri (roots)": 1,
        "uri (store)": 0,
    }
    assert asyncio.run(resolver.resolve(ref)) is item  # a hit: nothing parsed or checked
    assert len(counted["parse_ref"].calls) == len(counted["check_ref"].calls) == 1


def test_the_refs_form_checks_a_declared_ref_without_parsing_it_again(resolver, counted, photo_refs):
    pad = 151655  # any id: the prompt below is made of it
    form = FeatureForm(
        PositionChecks(resolver, EngineItems(object()), placeholder_token_id=pad, ec_transfer=False)
    )
    declared = photo_refs["chelsea"]
    ids = [1, *[pad] * declared.num_placeholders, 2]
    resolution = asyncio.run(form.from_refs([declared], ids, "v0"))
    assert len(resolution.slots) == 1 and len(counted["parse_ref"].calls) == 1
    forged = msgspec.structs.replace(declared, sha256="0" * 64)
    with pytest.raises(InvalidRef, match="RawMMRef sha256 and the ref's mm_hash disagree") as info:
        asyncio.run(form.from_refs([forged], ids, "v0"))  # the item is a hit; its parse travels
    assert info.value.ref == declared.ref
    assert len(counted["parse_ref"].calls) == len(counted["check_ref"].calls) == 1


def test_a_ref_the_check_refuses_is_refused_before_any_read(resolver, counted, photo_refs):
    body = parse_ref(photo_refs["rocket"].ref)
    other = msgspec.structs.replace(body, family="kimi_vl")
    ref = "mmraw:" + msgspec.json.encode(other).decode()
    with pytest.raises(UnsupportedFamily, match="is not the adapter's family") as info:
        asyncio.run(resolver.resolve(ref))
    assert info.value.ref == ref
    assert len(counted["check_ref"].calls) == 1 and counted["uri (roots)"].calls == []
