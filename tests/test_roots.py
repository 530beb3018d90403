"""protocol.roots with local folders: root configuration, the resolution rules, confinement, the
copied store (a v1 ref whose file:// path is elsewhere), v2 offload and resolve through an adapter.
Object-store roots against a real S3 endpoint: tests/test_roots_s3.py."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil

import pytest
import torch

from helpers import photo_bytes
from protocol.adapters import offload_image
from protocol.errors import (
    AssetNotFound,
    AssetOutsideRoot,
    AssetTooLarge,
    FingerprintMismatch,
    GridMismatch,
    HashMismatch,
    InvalidRef,
    StoreUnavailable,
    UnsupportedFamily,
)
from protocol.refs import ContentRef, RawRefBody, format_content_ref, parse_ref
from protocol.roots import (
    AssetRoots,
    LocalRoot,
    ObjectRoot,
    StoreClientConfig,
    open_root,
    parse_roots_spec,
    put_content,
)
from protocol.store import AssetStore


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return photo_bytes("coffee", size=(96, 64))


def content_ref(data: bytes, ext: str = ".jpg") -> ContentRef:
    return ContentRef(sha256=hashlib.sha256(data).hexdigest(), ext=ext, family="qwen2_vl", grid=(1, 4, 6))


# --- configuration --------------------------------------------------------------------------------


def test_roots_spec_is_comma_separated_or_json():
    assert parse_roots_spec(" /a , s3://b/p ,, ") == ["/a", "s3://b/p"]
    assert parse_roots_spec('["/a,b", "gs://c"]') == ["/a,b", "gs://c"]
    assert parse_roots_spec("") == []
    with pytest.raises(ValueError):
        parse_roots_spec('["/a", 3]')


def test_local_roots_are_absolute_paths_or_file_uris(tmp_path):
    assert isinstance(open_root(str(tmp_path)), LocalRoot)
    assert open_root(tmp_path.as_uri()).url == str(tmp_path)
    for bad in ("relative/dir", "file://host/x", "file:///a?q=1", "ftp://x/y"):
        with pytest.raises(ValueError):
            open_root(bad)


@pytest.mark.parametrize(
    "url",
    [
        "s3://key:secret@bucket/prefix",  # credentials never in a root (nor, so, in a log line)
        "s3://bucket@host/prefix",
        "s3://bucket/prefix?versionId=1",
        "s3://bucket/prefix#x",
        "s3://bucket/../other",
        "s3://bucket/a/./b",
        "s3://bucket/pre%2e%2e",
        "s3://bucket/pre fix",
        "s3://",
        "s3://-bucket/p",
        "memory:///",
        "file+s3://b/p",
    ],
)
def test_object_root_urls_off_the_rules_are_refused(url):
    with pytest.raises(ValueError) as info:
        ObjectRoot(url)
    assert "secret" not in str(info.value)


def test_store_client_config_bounds_a_read():
    client = StoreClientConfig(timeout_s=0.5, max_retries=1, retry_timeout_s=2.0)
    assert client.deadline_s() == pytest.approx(2.0)  # 2 attempts x 0.5 s + 1 backoff <= 1 s
    opts = client.obstore_options()
    assert opts["retry_config"]["max_retries"] == 1 and opts["client_options"]["allow_http"] is False
    assert StoreClientConfig.from_env({"MMREF_STORE_TIMEOUT_S": "3", "MMREF_STORE_ALLOW_HTTP": "1"}) == (
        StoreClientConfig(timeout_s=3.0, allow_http=True)
    )
    assert StoreClientConfig.from_env({"MMREF_STORE_HOLD_DOWN_S": "0"}).hold_down_s == 0.0
    for bad in ({"timeout_s": 0}, {"max_retries": -1}, {"hold_down_s": -1}):
        with pytest.raises(ValueError):
            StoreClientConfig(**bad)


def test_from_env_reads_the_roots_and_the_cache(tmp_path):
    env = {
        "MMREF_ASSET_ROOTS": f"{tmp_path / 'a'},{(tmp_path / 'b').as_uri()}",
        "MMREF_READ_CACHE_DIR": str(tmp_path / "cache"),
        "MMREF_READ_CACHE_BYTES": "4096",
    }
    roots = AssetRoots.from_env(env)
    assert roots.describe() == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert roots.cache is not None and roots.cache.max_bytes == 4096
    assert AssetRoots.from_env({}).roots == [] and AssetRoots.from_env({}).cache is None


# --- resolution rules -------------------------------------------------------------------------------


def test_the_first_root_holding_the_right_bytes_wins(tmp_path, jpeg):
    a, b, c = (tmp_path / n for n in "abc")
    ref = content_ref(jpeg)
    put_content(AssetStore(c), jpeg)
    (b / "images").mkdir(parents=True)
    (b / ref.key).write_bytes(jpeg[:-1] + b"?")  # other bytes under the key: keep looking
    roots = AssetRoots([LocalRoot(a), LocalRoot(b), LocalRoot(c)])  # a: does not exist, holds nothing
    data, sha = roots.read_image(ref)
    assert data == jpeg and sha == ref.sha256


def test_nothing_found_is_404_and_only_other_bytes_is_409(tmp_path, jpeg):
    ref = content_ref(jpeg)
    empty = AssetRoots([LocalRoot(tmp_path / "a"), LocalRoot(tmp_path / "b")])
    with pytest.raises(AssetNotFound) as info:
        empty.read_image(ref, ref="the-ref")
    assert info.value.http_status == 404 and info.value.ref == "the-ref"
    with pytest.raises(AssetNotFound, match="no asset roots"):
        AssetRoots([]).read_image(ref)
    (tmp_path / "b" / "images").mkdir(parents=True)
    (tmp_path / "b" / ref.key).write_bytes(b"x" * len(jpeg))
    with pytest.raises(HashMismatch) as info:
        empty.read_image(ref)
    assert info.value.http_status == 409


def test_a_size_over_the_limit_and_a_path_out_of_the_root_raise_at_once(tmp_path, jpeg):
    ref = content_ref(jpeg)
    put_content(AssetStore(tmp_path / "b"), jpeg)
    with pytest.raises(AssetTooLarge):
        AssetRoots([LocalRoot(tmp_path / "b")]).read_image(ref, max_bytes=len(jpeg) - 1)
    (tmp_path / "a" / "images").mkdir(parents=True)
    (tmp_path / "secret.jpg").write_bytes(jpeg)
    (tmp_path / "a" / ref.key).symlink_to(tmp_path / "secret.jpg")
    with pytest.raises(AssetOutsideRoot):  # refused, never worked around by the next root
        AssetRoots([LocalRoot(tmp_path / "a"), LocalRoot(tmp_path / "b")]).read_image(ref)


def test_one_asset_store_reads_v2_refs_at_their_key(tmp_path, jpeg):
    store = AssetStore(tmp_path)
    store.put_image(jpeg)  # today's writer: the same key
    assert store.read_image(content_ref(jpeg)) == (jpeg, hashlib.sha256(jpeg).hexdigest())
    with pytest.raises(AssetNotFound):
        store.read_image(content_ref(jpeg, ".png"))


def _failing_open(monkeypatch, under, code: int) -> None:
    """``os.open`` raises ``OSError(code)`` for paths under ``under``; the real call elsewhere (a
    0600 file of another user cannot be made as root, nor EMFILE on demand)."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if str(path).startswith(f"{under}{os.sep}"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE])
def test_a_file_the_first_root_cannot_open_is_read_from_the_next(tmp_path, jpeg, monkeypatch, code):
    """Permission denied (a 0600 file of another user), too many open files: the next root serves
    the image (docs/PROTOCOL.md §2.5); it used to be 403 ``outside_root`` at once. With no other
    root holding it: 503 ``store_unavailable`` (the image may exist), naming no root."""
    ref = content_ref(jpeg)
    for name in ("a", "b"):
        put_content(AssetStore(tmp_path / name), jpeg)
    _failing_open(monkeypatch, tmp_path / "a", code)
    assert AssetRoots([LocalRoot(tmp_path / "a"), LocalRoot(tmp_path / "b")]).read_image(ref)[0] == jpeg
    with pytest.raises(StoreUnavailable) as info:
        AssetRoots([LocalRoot(tmp_path / "a"), LocalRoot(tmp_path / "c")]).read_image(ref, ref="r")
    assert (info.value.http_status, info.value.ref) == (503, "r")
    assert str(tmp_path) not in info.value.message and "2 roots tried (2 local folders)" in info.value.message


def test_refusals_name_no_root_only_how_many_were_tried(tmp_path, jpeg, caplog):
    """docs/SECURITY.md: no server-side path beyond the offending ref. A refusal counts the roots
    tried and their kind; which roots goes to the log."""
    ref = content_ref(jpeg)
    a, b = tmp_path / "root-a", tmp_path / "root-b"
    roots = AssetRoots([LocalRoot(a), LocalRoot(b)])
    with pytest.raises(AssetNotFound) as missing:
        roots.read_image(ref)
    (b / "images").mkdir(parents=True)
    (b / ref.key).write_bytes(b"x" * len(jpeg))
    with caplog.at_level(logging.WARNING, logger="protocol.roots"), pytest.raises(HashMismatch) as other:
        roots.read_image(ref)
    (a / "images").mkdir(parents=True)
    (tmp_path / "secret.jpg").write_bytes(jpeg)
    (a / ref.key).symlink_to(tmp_path / "secret.jpg")
    with pytest.raises(AssetOutsideRoot) as outside:
        roots.read_image(ref)
    with pytest.raises(AssetOutsideRoot) as outside_one_store:
        AssetStore(a).read_image(ref)
    assert "none of the 2 roots tried (2 local folders)" in missing.value.message
    assert "other bytes in 1 of the 2 roots tried" in other.value.message
    assert ref.key in outside.value.message and ref.key in outside_one_store.value.message
    for error in (missing, other, outside, outside_one_store):
        assert str(tmp_path) not in error.value.message, error.value.message
    assert any(str(b) in r.getMessage() for r in caplog.records)  # the operator still learns which


# --- v1 refs: today's path first, then by content ------------------------------------------------


@pytest.fixture
def copied_store(tmp_path, jpeg, qwen2_vl_adapter):
    """A v1 ref made under ``out/run_7/assets``, and the whole output folder copied to ``moved/``."""
    out = tmp_path / "out"
    item = offload_image(jpeg, out / "run_7" / "assets", qwen2_vl_adapter)
    shutil.copytree(out, tmp_path / "moved")
    shutil.rmtree(out)
    return item, tmp_path / "moved"


def test_v1_refs_resolve_as_today_under_the_legacy_root(tmp_path, jpeg, qwen2_vl_adapter):
    item = offload_image(jpeg, tmp_path / "run_1" / "assets", qwen2_vl_adapter)
    body = parse_ref(item.ref)
    assert isinstance(body, RawRefBody)
    assert AssetRoots([], legacy_root=tmp_path).read_image(body)[0] == jpeg


def test_a_copied_store_serves_its_v1_refs(copied_store, jpeg):
    """The issue's case: the store copied to another path -> outside_root. Still so for one
    AssetStore; resolved by content under the roots."""
    item, moved = copied_store
    body = parse_ref(item.ref)
    with pytest.raises(AssetOutsideRoot):
        AssetStore(moved).read_hashed(body.raw_image_uri, body.mm_hash)
    assert AssetRoots([], legacy_root=moved).read_image(body)[0] == jpeg  # run_7/assets/images/...
    assert AssetRoots([LocalRoot(moved / "run_7" / "assets")]).read_image(body)[0] == jpeg  # images/...


def test_v1_refs_still_refuse_what_they_refused(copied_store, tmp_path):
    item, moved = copied_store
    body = parse_ref(item.ref)
    roots = AssetRoots([LocalRoot(moved / "run_7" / "assets")], legacy_root=moved)
    for uri in ("file:///etc/hostname", f"file://{moved}/../../../etc/hostname"):
        with pytest.raises(AssetOutsideRoot):
            roots.read_image(RawRefBody(**{**_fields(body), "raw_image_uri": uri}))
    renamed = body.raw_image_uri.replace(body.mm_hash[:16], "0" * 16)  # a name that is not its hash
    with pytest.raises(AssetOutsideRoot):
        roots.read_image(RawRefBody(**{**_fields(body), "raw_image_uri": renamed}))
    with pytest.raises(HashMismatch):  # found by its name, but the ref claims other bytes
        roots.read_image(RawRefBody(**{**_fields(body), "mm_hash": body.mm_hash[:16] + "0" * 16}))
    with pytest.raises(InvalidRef):
        roots.read_image(RawRefBody(**{**_fields(body), "raw_image_uri": "http://x/images/a.jpg"}))
    with pytest.raises(AssetNotFound):  # no legacy root: not found by content either
        AssetRoots([LocalRoot(tmp_path / "empty")]).read_image(body)


def _fields(body: RawRefBody) -> dict:
    return {f: getattr(body, f) for f in body.__struct_fields__}


# --- through the adapter: offload v2, resolve by content -----------------------------------------


def test_v2_offload_and_resolve_give_the_v1_pixels(tmp_path, jpeg, qwen2_vl_adapter):
    v1 = offload_image(jpeg, tmp_path / "store", qwen2_vl_adapter)
    v2 = offload_image(jpeg, tmp_path / "store", qwen2_vl_adapter, form="v2")
    ref = parse_ref(v2.ref)
    assert isinstance(ref, ContentRef) and len(v2.ref) <= 160
    assert (v2.sha256, v2.grid, v2.num_placeholders) == (v1.sha256, v1.grid, v1.num_placeholders)
    assert ref.fingerprint == qwen2_vl_adapter.fingerprint and list(ref.grid) == v2.grid
    copy = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "store", copy)
    want = qwen2_vl_adapter.resolve_raw(parse_ref(v1.ref), AssetStore(tmp_path / "store"), ref=v1.ref)
    got = qwen2_vl_adapter.resolve_raw(ref, AssetRoots([LocalRoot(copy)]), ref=v2.ref)
    assert got.sha256 == want.sha256 == v1.sha256
    for name, tensor in want.tensors.items():
        assert torch.equal(got.tensors[name], tensor)


def test_v1_offload_needs_a_local_store(tmp_path, jpeg, qwen2_vl_adapter):
    with pytest.raises(ValueError, match="v1 refs name a local file"):
        qwen2_vl_adapter.offload(jpeg, AssetRoots([LocalRoot(tmp_path)]))
    with pytest.raises(ValueError, match="form"):
        qwen2_vl_adapter.offload(jpeg, AssetStore(tmp_path), form="v3")  # type: ignore[arg-type]
    v1 = offload_image(jpeg, tmp_path.as_uri(), qwen2_vl_adapter)  # a file:// root works for v1
    assert parse_ref(v1.ref).raw_image_uri.startswith(tmp_path.as_uri())


def test_check_ref_bounds_a_v2_grid_like_a_v1_payload(tmp_path, jpeg, qwen2_vl_adapter):
    good = parse_ref(offload_image(jpeg, tmp_path, qwen2_vl_adapter, form="v2").ref)
    assert qwen2_vl_adapter.check_ref(good) == good.grid
    with pytest.raises(InvalidRef):
        qwen2_vl_adapter.check_ref(ContentRef(**{**_fields(good), "grid": (4, 6)}))
    with pytest.raises(GridMismatch):
        qwen2_vl_adapter.check_ref(ContentRef(**{**_fields(good), "grid": (1, 2048, 2048)}))
    with pytest.raises(UnsupportedFamily):
        qwen2_vl_adapter.check_ref(ContentRef(**{**_fields(good), "family": "kimi_vl"}))
    with pytest.raises(FingerprintMismatch):
        qwen2_vl_adapter.check_ref(ContentRef(**{**_fields(good), "fingerprint": "f" * 32}))
    assert format_content_ref(good).count(":") == 5


def test_a_v2_ref_sent_where_feature_files_are_read_is_invalid_not_a_crash(tmp_path, jpeg):
    """Until the server resolves v2 refs through roots, its mmfile path refuses them with a typed
    invalid_ref (400), never an AttributeError (500)."""
    from protocol.features import read_feature_item

    ref = content_ref(jpeg)
    with pytest.raises(InvalidRef):
        read_feature_item(tmp_path, ref, fingerprint="a" * 32, ref_string=format_content_ref(ref))  # type: ignore[arg-type]


def test_the_trainer_of_this_release_materializes_v2_refs_under_one_store_root(
    tmp_path, jpeg, qwen2_vl_adapter
):
    """Before its roots integration, ``materialize`` with a store root as its source already resolves v2
    refs (``AssetStore.read_image`` at their key) to the v1 pixels."""
    from protocol.structs import MMRefs, TrainingSample
    from trainer_lib import MaterializeOptions, materialize

    store = tmp_path / "store"
    refs = {form: offload_image(jpeg, store, qwen2_vl_adapter, form=form) for form in ("v1", "v2")}
    out = {}
    for form, item in refs.items():
        sample = TrainingSample(
            input_ids=list(range(8)),
            loss_mask=[True] * 8,
            advantages=[0.0] * 8,
            inference_logprobs=[0.0] * 8,
            mm_refs=MMRefs(items=[item]),
        )
        out[form] = materialize([sample], qwen2_vl_adapter, store, MaterializeOptions(policy="error"))
    assert out["v2"].stats.processed == 1
    for name, tensor in out["v1"].features.items():
        assert torch.equal(out["v2"].features[name], tensor)
