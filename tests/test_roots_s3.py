"""Object-store roots against a real S3 endpoint: moto's standalone server as its own process on
127.0.0.1 (``helpers.MotoS3``: the S3 wire protocol, request signing and error codes over HTTP),
driven by obstore's real S3 client. No mock of S3 anywhere.

Offload from one process, resolve in another with each party's own roots (S3 only, a local mount
first, the read-through cache); the faults of issue 28: endpoint down (503), object deleted (404),
object replaced by other bytes (409), slow endpoint (503 within the configured deadline).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from helpers import REPO, DelayProxy, photo_bytes
from protocol.errors import AssetNotFound, AssetTooLarge, HashMismatch, StoreUnavailable
from protocol.read_cache import ReadCache
from protocol.refs import ContentRef, parse_ref
from protocol.roots import AssetRoots, LocalRoot, ObjectRoot, StoreClientConfig, put_content
from protocol.store import AssetStore
from protocol.structs import RawMMRef

if sys.version_info < (3, 11):
    pytest.skip("obstore (the fleet extra) needs Python >= 3.11", allow_module_level=True)
import obstore  # a dev dependency on 3.11+: a missing install fails here, not skips

pytestmark = pytest.mark.timeout(300)

FAST = StoreClientConfig(
    timeout_s=0.5, connect_timeout_s=0.5, max_retries=1, retry_timeout_s=2.0, allow_http=True
)
"""The fault tests' client: one read of one root ends within FAST.deadline_s() = 2 s."""
SLACK_S = 1.5
"""What a deadline check allows on top of the configured bound (a shared 2-core machine)."""


@pytest.fixture(scope="module")
def s3(moto_s3):
    """A fresh bucket; the AWS chain variables set for this process while the module runs."""
    bucket = f"mmref-{uuid.uuid4().hex[:12]}"
    url = moto_s3.make_bucket(bucket)
    with moto_s3.environment():
        yield moto_s3, bucket, url


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return photo_bytes("astronaut", size=(128, 96))


def bucket_store(url: str):
    """The whole bucket through obstore (signed requests, the AWS chain): the tests' hands for
    deleting, replacing and listing objects behind the roots' backs."""
    from obstore.store import from_url

    return from_url(url, client_options={"allow_http": True})


def bucket_of(url: str) -> str:
    """The bucket name of a root URL: what a refusal must not name (docs/SECURITY.md)."""
    return url.split("://", 1)[1].split("/", 1)[0]


def root(url: str, *, client: StoreClientConfig = FAST, endpoint: str | None = None) -> ObjectRoot:
    return ObjectRoot(url, client, endpoint=endpoint)


def unique_image(tag: str) -> bytes:
    """A real JPEG no other test stored (its own content key)."""
    from PIL import Image

    base = photo_bytes("chelsea", size=(64, 48))
    im = Image.open(io.BytesIO(base)).convert("RGB")
    im.putpixel((0, 0), tuple(hashlib.sha256(tag.encode()).digest()[:3]))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def content_of(data: bytes, ext: str) -> ContentRef:
    return ContentRef(sha256=hashlib.sha256(data).hexdigest(), ext=ext, family="qwen2_vl", grid=(1, 4, 6))


# --- offload in one process, resolve in another, each party with its own roots ------------------

_OFFLOADER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    from helpers import photo_bytes
    from protocol.adapters import load_adapter, offload_image
    from protocol.roots import AssetRoots
    adapter = load_adapter({model!r})
    item = offload_image(photo_bytes("astronaut", size=(128, 96)), AssetRoots.from_env(), adapter, form="v2")
    print(json.dumps({{"ref": item.ref, "sha256": item.sha256, "grid": item.grid}}))
    """
)


def test_offload_in_one_process_resolve_in_another_from_s3_a_local_mount_or_the_cache(
    s3, jpeg, qwen2_vl_adapter, qwen2_vl_dir, tmp_path
):
    moto, bucket, url = s3
    env = {**os.environ, **moto.env(), "MMREF_ASSET_ROOTS": f"{url}/fleet", "HF_HUB_OFFLINE": "1"}
    script = _OFFLOADER.format(repo=str(REPO), tests=str(REPO / "tests"), model=str(qwen2_vl_dir))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    made = json.loads(out.stdout.strip().splitlines()[-1])
    ref = parse_ref(made["ref"])
    assert isinstance(ref, ContentRef) and ref.sha256 == made["sha256"] and len(made["ref"]) <= 160
    assert "s3" not in made["ref"] and bucket not in made["ref"]  # a ref names no place

    # the object is where the layout says, under the root's prefix
    assert bytes(obstore.get(bucket_store(url), f"fleet/{ref.key}").bytes()) == jpeg

    # the oracle: the same bytes resolved from a local store
    local = AssetStore(tmp_path / "oracle")
    local.put_image(jpeg)
    want = qwen2_vl_adapter.resolve_raw(ref, local, ref=made["ref"])

    cache = ReadCache(tmp_path / "cache", 1 << 20)
    parties = {
        "S3 only": AssetRoots([root(f"{url}/fleet")]),
        "empty local mount, then S3, with the cache": AssetRoots(
            [LocalRoot(tmp_path / "not-mounted"), root(f"{url}/fleet")], cache=cache
        ),
        "a local mount holding a copy": AssetRoots([LocalRoot(tmp_path / "oracle")]),
    }
    for name, roots in parties.items():
        got = qwen2_vl_adapter.resolve_raw(ref, roots, ref=made["ref"])
        assert got.sha256 == want.sha256, name
        assert all(torch.equal(got.tensors[k], v) for k, v in want.tensors.items()), name
    assert cache.get(ref.sha256, max_bytes=1 << 20) == jpeg  # read through once, held now


def test_a_cached_image_is_served_without_asking_the_store(s3, tmp_path):
    moto, _, url = s3
    data = unique_image("cached")
    proxy = DelayProxy(moto.port)
    roots = AssetRoots([root(f"{url}/c", endpoint=proxy.url)], cache=ReadCache(tmp_path / "cache", 1 << 20))
    ref = content_of(data, put_content(roots, data).ext)
    assert roots.read_image(ref)[0] == data  # a miss: through the proxy, into the cache
    proxy.close()
    assert roots.read_image(ref)[0] == data  # the endpoint is down; the node's cache answers


# --- writes: create-if-absent, many writers racing on one image --------------------------------


def test_racing_writers_store_one_object_and_all_succeed(s3):
    _, _, url = s3
    data = unique_image("race")
    results: list = []

    def offload() -> None:
        results.append(put_content(root(f"{url}/race"), data))

    threads = [threading.Thread(target=offload) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and len({(r.sha256, r.key) for r in results}) == 1
    assert sum(r.written for r in results) >= 1
    again = put_content(root(f"{url}/race"), data)
    assert again.written is False  # HEAD found it: nothing uploaded
    listed = [m["path"] for batch in obstore.list(root(f"{url}/race")._store) for m in batch]
    assert listed == [results[0].key]


def test_another_object_under_the_key_is_refused_at_the_writer(s3):
    _, _, url = s3
    data = unique_image("squatted")
    key = content_of(data, ".png").key
    obstore.put(bucket_store(url), f"squat/{key}", b"not this image")
    with pytest.raises(HashMismatch, match="another object"):
        put_content(root(f"{url}/squat"), data)


# --- faults --------------------------------------------------------------------------------------


def test_endpoint_down_is_503_within_the_deadline_and_the_next_root_still_serves(s3, tmp_path):
    moto, _, url = s3
    data = unique_image("down")
    proxy = DelayProxy(moto.port)
    via_proxy = root(f"{url}/down", endpoint=proxy.url)
    ref = content_of(data, put_content(via_proxy, data).ext)
    proxy.close()
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        AssetRoots([via_proxy]).read_image(ref, ref="r")
    assert time.monotonic() - start < FAST.deadline_s() + SLACK_S
    assert (info.value.http_status, info.value.code, info.value.ref) == (503, "store_unavailable", "r")
    assert isinstance(info.value, ConnectionError)
    assert "mmref-test-secret" not in str(info.value) and "mmref-test-key" not in str(info.value)
    assert bucket_of(url) not in info.value.message and proxy.url not in info.value.message  # logged only
    assert "1 of the 1 root tried (1 object store) could not be asked" in info.value.message
    # a later root holding the bytes serves them: an unreachable root is skipped, not fatal
    mirror = AssetStore(tmp_path / "mirror")
    mirror.put_image(data)
    assert AssetRoots([via_proxy, LocalRoot(mirror.root)]).read_image(ref)[0] == data
    # the bytes are in no reachable root: still 503 (they may exist), not 404
    with pytest.raises(StoreUnavailable):
        AssetRoots([via_proxy, LocalRoot(tmp_path / "empty")]).read_image(ref)


def test_a_root_found_down_is_held_down_then_asked_again(s3):
    """A read that finds the endpoint down holds the root down: the reads after it (those queued
    behind it in a server's worker pool) fail at once instead of each paying the deadline; once
    the hold-down has passed the root is asked again and serves. ``hold_down_s=0``: each read asks."""
    import dataclasses

    moto, _, url = s3
    data = unique_image("held down")
    proxy = DelayProxy(moto.port)
    client = dataclasses.replace(FAST, hold_down_s=1.5)
    via_proxy = root(f"{url}/held", client=client, endpoint=proxy.url)
    ref = content_of(data, put_content(via_proxy, data).ext)
    proxy.close()
    with pytest.raises(StoreUnavailable):
        AssetRoots([via_proxy]).read_image(ref)
    start = time.monotonic()
    for _ in range(5):
        with pytest.raises(StoreUnavailable):
            AssetRoots([via_proxy]).read_image(ref)
    assert time.monotonic() - start < 0.5  # five reads, no request among them
    proxy.reopen()
    with pytest.raises(StoreUnavailable):  # still held down, endpoint back or not
        AssetRoots([via_proxy]).read_image(ref)
    time.sleep(1.5)
    assert AssetRoots([via_proxy]).read_image(ref)[0] == data  # asked again: served
    proxy.close()
    # a root that answered another request while this one failed is up: one failing object
    # (a slow large body, a 5xx for one key) holds nothing down
    answering = root(f"{url}/held", client=client, endpoint=proxy.url)
    answering._last_ok = time.monotonic() + 60  # an answer after the failing read began
    with pytest.raises(StoreUnavailable):
        AssetRoots([answering]).read_image(ref)
    proxy.reopen()
    assert AssetRoots([answering]).read_image(ref)[0] == data  # not held down
    proxy.close()
    never = root(f"{url}/held", client=dataclasses.replace(FAST, hold_down_s=0.0), endpoint=proxy.url)
    with pytest.raises(StoreUnavailable):
        AssetRoots([never]).read_image(ref)
    proxy.reopen()
    assert AssetRoots([never]).read_image(ref)[0] == data  # asked again at once
    proxy.close()


def test_a_slow_endpoint_is_503_within_the_configured_timeout(s3):
    moto, _, url = s3
    data = unique_image("slow")
    ref = content_of(data, put_content(root(f"{url}/slow"), data).ext)
    proxy = DelayProxy(moto.port, delay_s=30.0)  # every answer held 30 s
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            AssetRoots([root(f"{url}/slow", endpoint=proxy.url)]).read_image(ref)
        elapsed = time.monotonic() - start
    finally:
        proxy.close()
    assert FAST.timeout_s <= elapsed < FAST.deadline_s() + SLACK_S  # gave up on time, no hung request


def test_a_deleted_object_is_404(s3):
    _, _, url = s3
    data = unique_image("deleted")
    ref = content_of(data, put_content(root(f"{url}/del"), data).ext)
    obstore.delete(bucket_store(url), f"del/{ref.key}")
    with pytest.raises(AssetNotFound) as info:
        AssetRoots([root(f"{url}/del")]).read_image(ref)
    assert info.value.http_status == 404
    assert bucket_of(url) not in info.value.message and "1 root tried (1 object store)" in info.value.message


def test_an_object_replaced_by_other_bytes_is_409_and_never_cached(s3, tmp_path):
    _, _, url = s3
    data = unique_image("replaced")
    ref = content_of(data, put_content(root(f"{url}/rep"), data).ext)
    other = unique_image("the other one")
    obstore.put(bucket_store(url), f"rep/{ref.key}", other)  # same key, other bytes
    cache = ReadCache(tmp_path / "cache", 1 << 20)
    with pytest.raises(HashMismatch) as info:
        AssetRoots([root(f"{url}/rep")], cache=cache).read_image(ref)
    assert info.value.http_status == 409 and bucket_of(url) not in info.value.message
    assert cache.usage() == 0


def test_an_object_over_the_limit_is_refused_from_its_size(s3):
    _, _, url = s3
    data = unique_image("large")
    ref = content_of(data, put_content(root(f"{url}/big"), data).ext)
    with pytest.raises(AssetTooLarge) as info:
        AssetRoots([root(f"{url}/big")]).read_image(ref, max_bytes=len(data) - 1)
    assert bucket_of(url) not in info.value.message and ref.key in info.value.message


def test_no_ref_reaches_outside_the_root_prefix(s3):
    _, _, url = s3
    data = unique_image("confined")
    ref = content_of(data, ".png")
    # the image exists in the bucket, but at other prefixes than the root's
    for where in (f"other/{ref.key}", f"fleetx/{ref.key}", ref.key):
        obstore.put(bucket_store(url), where, data)
    with pytest.raises(AssetNotFound):
        AssetRoots([root(f"{url}/fleet")]).read_image(ref)
    assert AssetRoots([root(url)]).read_image(ref)[0] == data  # a bucket-level root: images/ at its top


def test_v1_refs_resolve_by_content_from_s3_when_their_path_is_gone(s3, jpeg, qwen2_vl_adapter, tmp_path):
    """A v1 ref made on a rollout node; the reader has no such path, only the bucket."""
    _, _, url = s3
    from protocol.adapters import offload_image

    item: RawMMRef = offload_image(jpeg, tmp_path / "node" / "run_3" / "assets", qwen2_vl_adapter)
    put_content(root(f"{url}/v1"), jpeg)
    body = parse_ref(item.ref)
    roots = AssetRoots([root(f"{url}/v1")], legacy_root=tmp_path / "reader")
    (tmp_path / "reader").mkdir()
    assert roots.read_image(body)[0] == jpeg
