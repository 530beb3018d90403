"""trainer_lib.materialize against the trainer's asset roots (issue 28, trainer half): a real S3
endpoint (moto's server as its own process, obstore's S3 client: ``helpers.MotoS3``), a local
mount, a store copied to another path, the node's read cache; every fault typed. The oracle is the
same photo materialized from a local store.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid

import pytest
import torch

from helpers import DelayProxy, chat, photo_bytes
from protocol.adapters import offload_image
from protocol.errors import AssetNotFound, HashMismatch, StoreUnavailable
from protocol.read_cache import ReadCache
from protocol.roots import AssetRoots, LocalRoot, ObjectRoot, StoreClientConfig
from protocol.store import AssetStore
from trainer_lib import (
    MaterializeConfig,
    MaterializeOptions,
    PackingSpec,
    materialize,
    materialize_micro_batch,
    pack_samples,
)

if sys.version_info < (3, 11):
    pytest.skip("obstore (the fleet extra) needs Python >= 3.11", allow_module_level=True)
import obstore

pytestmark = pytest.mark.timeout(300)

TOK = 261  # <|image_pad|> of the tiny Qwen2-VL
FAST = StoreClientConfig(
    timeout_s=0.5, connect_timeout_s=0.5, max_retries=1, retry_timeout_s=2.0, allow_http=True
)
"""One read of one root ends within FAST.deadline_s() = 2 s."""
SLACK_S = 2.0
STRICT = MaterializeOptions(policy="error")


@pytest.fixture(scope="module")
def s3(moto_s3):
    """A fresh bucket; the AWS chain variables of moto set for this process while the module runs."""
    with moto_s3.environment():
        yield moto_s3, moto_s3.make_bucket(f"mmref-mat-{uuid.uuid4().hex[:10]}")


def s3_root(url: str, endpoint: str | None = None) -> ObjectRoot:
    return ObjectRoot(url, FAST, endpoint=endpoint)


def offload_v2(data: bytes, url: str, adapter):
    """A photo offloaded to an S3 prefix as a content-named (v2) ref; the RawMMRef."""
    return offload_image(data, AssetRoots([s3_root(url)]), adapter, form="v2")


def oracle(samples, adapter, tmp_path, *datas: bytes) -> torch.Tensor:
    """The same photos' pixels from a local store (v1 refs made there: the path every party took
    before roots)."""
    store = AssetStore(tmp_path / "oracle")
    for data in datas:
        store.put_image(data)
    return materialize(samples, adapter, AssetRoots([LocalRoot(store.root)])).features["pixel_values"]


def test_materialize_micro_batch_from_s3_only_through_the_config_and_the_cache(
    s3, qwen2_vl_adapter, tmp_path, monkeypatch
):
    """MMREF_ASSET_ROOTS = the bucket only (no MMREF_ASSET_ROOT), the node cache on: the pixels are
    the local store's; with the endpoint down afterwards, the cache serves the same batch."""
    moto, bucket = s3
    data = photo_bytes("coffee", size=(96, 64))
    ref = offload_v2(data, f"{bucket}/fleet", qwen2_vl_adapter)
    samples = [chat([ref], "Describe.", f"a cup {k}", TOK) for k in range(3)]
    spec = PackingSpec(placeholder_token_id=TOK, pad_token_id=0, adapter=qwen2_vl_adapter)
    (mb,) = pack_samples(samples, spec, seq_len=4096).micro_batches
    proxy = DelayProxy(moto.port)
    monkeypatch.delenv("MMREF_ASSET_ROOT", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("MMREF_ASSET_ROOTS", f"{bucket}/fleet")
    monkeypatch.setenv("MMREF_READ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MMREF_STORE_TIMEOUT_S", "0.5")
    monkeypatch.setenv("MMREF_STORE_MAX_RETRIES", "1")
    config = MaterializeConfig(missing_policy="error")
    assert config.asset_root is None and config.image_source().describe() == [f"{bucket}/fleet"]
    assert config.store_client().timeout_s == 0.5 and config.store_client().allow_http
    want = oracle(samples, qwen2_vl_adapter, tmp_path, data)
    got = materialize_micro_batch(mb, spec, config)
    assert got.stats.processed == 1 and torch.equal(got.features["pixel_values"], want)
    assert ReadCache(tmp_path / "cache", 1 << 30).get(ref.sha256, max_bytes=1 << 20) == data
    proxy.close()
    again = materialize_micro_batch(mb, spec, config)  # the endpoint is down: the node's cache answers
    assert torch.equal(again.features["pixel_values"], want)


def test_materialize_from_a_local_mount_before_the_bucket(s3, qwen2_vl_adapter, tmp_path):
    """Roots in order: an empty mount, a mount holding a copy, the bucket; the copy serves (the
    bucket is never asked: its objects were deleted)."""
    _, bucket = s3
    data = photo_bytes("astronaut", size=(64, 96))
    ref = offload_v2(data, f"{bucket}/mount", qwen2_vl_adapter)
    mount = AssetStore(tmp_path / "mount")
    mount.put_image(data)
    obstore.delete(s3_root(bucket)._store, f"mount/images/{ref.sha256[:16]}.jpg")
    samples = [chat([ref], "What?", "a person", TOK)]
    roots = AssetRoots(
        [LocalRoot(tmp_path / "not-mounted"), LocalRoot(mount.root), s3_root(f"{bucket}/mount")]
    )
    got = materialize(samples, qwen2_vl_adapter, roots, STRICT)
    assert torch.equal(got.features["pixel_values"], oracle(samples, qwen2_vl_adapter, tmp_path, data))


def test_a_store_copied_to_another_path_serves_its_v1_refs(qwen2_vl_adapter, tmp_path):
    """Issue 28: v1 refs made under one output root, the store copied elsewhere and the original
    gone: materialize with the copy as its asset root (a folder, or MaterializeConfig) finds every
    image by content (before roots: AssetOutsideRoot)."""
    first = tmp_path / "node-a" / "outputs"
    photos = {n: photo_bytes(n, size=(80, 64)) for n in ("chelsea", "rocket")}
    refs = {n: offload_image(d, first / "run_1" / "assets", qwen2_vl_adapter) for n, d in photos.items()}
    samples = [
        chat([refs["chelsea"], refs["rocket"]], "Both?", "cat, rocket", TOK),
        chat([refs["rocket"]], "?", "r", TOK),
    ]
    want = materialize(samples, qwen2_vl_adapter, first, STRICT).features["pixel_values"]
    copy = tmp_path / "node-b" / "mnt" / "outputs"
    shutil.copytree(first, copy)
    shutil.rmtree(tmp_path / "node-a")
    for source in (copy, copy / "run_1" / "assets", MaterializeConfig(asset_root=copy).image_source()):
        got = materialize(samples, qwen2_vl_adapter, source, STRICT)
        assert got.stats.processed == 2 and torch.equal(got.features["pixel_values"], want), source


def test_an_unreachable_store_is_never_a_zero_loss_placeholder(s3, qwen2_vl_adapter, tmp_path):
    """Endpoint down or too slow: StoreUnavailable (503) under both policies, within the configured
    deadline, naming the roots checked: the image may exist, the step must be retried."""
    moto, bucket = s3
    data = photo_bytes("chelsea", size=(64, 64))
    ref = offload_v2(data, f"{bucket}/down", qwen2_vl_adapter)
    samples = [chat([ref], "?", "a cat", TOK)]
    down = DelayProxy(moto.port)
    down.close()
    slow = DelayProxy(moto.port, delay_s=30.0)
    try:
        for proxy in (down, slow):
            roots = AssetRoots([s3_root(f"{bucket}/down", endpoint=proxy.url)])
            for policy in ("placeholder_zero_loss", "error"):
                start = time.monotonic()
                with pytest.raises(StoreUnavailable) as info:
                    materialize(samples, qwen2_vl_adapter, roots, MaterializeOptions(policy=policy))
                assert time.monotonic() - start < FAST.deadline_s() + SLACK_S
                assert info.value.ref == ref.ref and info.value.http_status == 503
                assert f"trainer asset roots checked: {bucket}/down" in info.value.message
                assert "mmref-test-secret" not in info.value.message
    finally:
        slow.close()


@pytest.mark.parametrize("fault", ["deleted", "replaced"])
def test_a_deleted_or_replaced_object_is_typed_and_replaceable(s3, qwen2_vl_adapter, tmp_path, fault, caplog):
    """A deleted object is 404 AssetNotFound, one replaced by other bytes 409 HashMismatch: raised
    under ``error``; under ``placeholder_zero_loss`` zero features, that sample's loss zeroed, one
    WARNING naming the code and the bucket."""
    _, bucket = s3
    data = photo_bytes("rocket", size=(72, 64))
    prefix = f"{bucket}/{fault}"
    ref = offload_v2(data, prefix, qwen2_vl_adapter)
    key = f"{fault}/images/{ref.sha256[:16]}.jpg"
    if fault == "deleted":
        obstore.delete(s3_root(bucket)._store, key)
    else:
        obstore.put(s3_root(bucket)._store, key, photo_bytes("coffee", size=(72, 64)))
    error, code = (
        (AssetNotFound, "asset_not_found") if fault == "deleted" else (HashMismatch, "hash_mismatch")
    )
    roots = AssetRoots([s3_root(prefix)], cache=ReadCache(tmp_path / "cache", 1 << 20))
    samples = [chat([ref], "?", "a rocket", TOK), chat([], "hi", "hello", TOK)]
    with pytest.raises(error) as info:
        materialize(samples, qwen2_vl_adapter, roots, STRICT)
    assert info.value.code == code and prefix in info.value.message
    batch = materialize(samples, qwen2_vl_adapter, roots)
    assert batch.stats.failed_by_code == {code: 1} and [any(s.loss_mask) for s in batch.samples] == [
        False,
        True,
    ]
    assert torch.count_nonzero(batch.features["pixel_values"]) == 0
    assert any(code in r.getMessage() and prefix in r.getMessage() for r in caplog.records)
    assert roots.cache.usage() == 0  # other bytes are never cached
