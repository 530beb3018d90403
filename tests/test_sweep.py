"""TTL sweep: expired feature files go, fresh ones and every image stay, readers are not broken."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import photo_bytes
from protocol.features import feature_path, read_feature_item, run_asset_root, write_feature_item
from protocol.refs import FileRef
from protocol.store import AssetStore
from protocol.sweep import TEMP_GRACE_S, sweep_features

FP = "ab" * 16


def feature(output_root, mm_hash, run_id="r1", payload=b"payload"):
    ref = FileRef(run_id=run_id, fingerprint=FP, modality="image", mm_hash=mm_hash)
    write_feature_item(run_asset_root(output_root, run_id), ref, payload, placeholder_length=4)
    return ref, feature_path(run_asset_root(output_root, run_id), ref)


def test_removes_only_expired_features_never_images(tmp_path):
    store = AssetStore(run_asset_root(tmp_path, "r1"))
    image = store.put_image(photo_bytes("coffee"))
    os.utime(image.path, (0, 0))  # ancient image: still never swept
    _, old = feature(tmp_path, "aa" * 32)
    _, fresh = feature(tmp_path, "bb" * 32)
    _, other_run_old = feature(tmp_path, "cc" * 32, run_id="r2")
    abandoned_tmp = old.parent / ".tmp-crashed.msgpack"
    abandoned_tmp.write_bytes(b"half")
    now = time.time()
    for path in (old, other_run_old, abandoned_tmp):
        os.utime(path, (now - 4000, now - 4000))

    dry = sweep_features(tmp_path, ttl_s=1800, now=now, dry_run=True)
    assert dry.removed == 3 and old.exists()
    report = sweep_features(tmp_path, ttl_s=1800, now=now)
    assert sorted(report.removed_paths) == sorted([old, other_run_old, abandoned_tmp])
    assert report.kept == 1 and fresh.exists() and image.path.exists()
    assert sweep_features(tmp_path, ttl_s=1800, now=now).removed == 0  # idempotent


def test_rewriting_refreshes_mtime_so_features_in_use_survive(tmp_path):
    _, path = feature(tmp_path, "dd" * 32)
    now = time.time()
    os.utime(path, (now - 4000, now - 4000))
    feature(tmp_path, "dd" * 32)  # the idempotent writer touches it
    assert sweep_features(tmp_path, ttl_s=1800).removed == 0 and path.exists()


def test_sweep_is_safe_while_readers_run(tmp_path):
    refs = [feature(tmp_path, f"{i:02x}" * 32, payload=os.urandom(200_000))[0] for i in range(40)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            for ref in refs:
                try:
                    read_feature_item(tmp_path, ref, fingerprint=FP)
                except FileNotFoundError:  # AssetNotFound: swept, the typed outcome readers expect
                    pass
                except BaseException as e:  # anything else (a torn read, a crash) fails the test
                    errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    report = sweep_features(tmp_path, ttl_s=0, now=time.time() + 10)
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(10)
    assert report.removed == 40 and not errors


def test_a_ttl_0_sweep_never_breaks_concurrent_writers(tmp_path):
    """``--ttl 0`` removes every finished feature file but no temp file a writer is still filling
    (it took all 30 concurrent writes down with a raw FileNotFoundError); a crashed writer's temp
    file still goes once it is older than the grace period."""
    _, first = feature(tmp_path, "ff" * 32)
    crashed = first.parent / ".tmp-crashed.msgpack"
    crashed.write_bytes(b"half")
    os.utime(crashed, (time.time() - TEMP_GRACE_S - 60,) * 2)
    in_progress = first.parent / ".tmp-writing.msgpack"  # a write that has just started
    in_progress.write_bytes(b"half")
    stop = threading.Event()
    removed = []

    def sweeper():
        while not stop.is_set():
            removed.extend(sweep_features(tmp_path, ttl_s=0).removed_paths)

    thread = threading.Thread(target=sweeper)
    thread.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            payload = os.urandom(4 << 20)  # a few ms per write: a wide window for the sweeper
            list(pool.map(lambda i: feature(tmp_path, f"{i:02x}" * 32, payload=payload), range(30)))
    finally:
        stop.set()
        thread.join(30)
    assert crashed in removed and not crashed.exists()
    assert in_progress.exists()
    assert not any(p.name.startswith(".tmp-") for p in removed if p != crashed)


def _old_file(path: Path, name: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_bytes(b"not the store's")
    os.utime(path / name, (0, 0))
    return path / name


@pytest.mark.parametrize(
    "planted",
    [
        "run_a/assets/mm_features/v1/vllm-mmitem",
        "run_a/assets/mm_features/v1",
        "run_a/assets/mm_features",
        "run_a/assets",
        "run_a",
    ],
)
def test_a_symlink_anywhere_down_to_the_feature_folder_is_never_followed(tmp_path, planted):
    """A writer of the store plants a symlink at one step of ``run_X/assets/mm_features/v1/
    vllm-mmitem`` pointing at another folder: nothing there is swept (it used to delete old
    ``*.msgpack`` and ``.tmp-*`` files outside the store). The real run beside it still is."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    _, swept = feature(out, "aa" * 32, run_id="real")
    os.utime(swept, (0, 0))
    tail = Path("run_a/assets/mm_features/v1/vllm-mmitem").relative_to(planted)
    targets = [_old_file(victim / tail, "x.msgpack"), _old_file(victim / tail, ".tmp-y")]
    (out / planted).parent.mkdir(parents=True, exist_ok=True)
    (out / planted).symlink_to(victim, target_is_directory=True)
    report = sweep_features(out, ttl_s=0)
    assert report.removed_paths == [swept] and all(t.exists() for t in targets)
    # the same plant in an asset root given directly
    if planted.startswith("run_a/assets/"):
        assert sweep_features(out / "run_a" / "assets", ttl_s=0).scanned == 0
        assert all(t.exists() for t in targets)


def test_cli(tmp_path):
    _, path = feature(tmp_path, "ee" * 32)
    os.utime(path, (0, 0))
    out = subprocess.run(
        [sys.executable, "-m", "protocol.sweep", str(tmp_path), "--ttl", "60"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "removed 1" in out.stdout and not path.exists()
