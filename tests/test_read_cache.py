"""protocol.read_cache: the node's read-through cache (byte cap, LRU by mtime, checked hits, atomic
writes, several processes on one folder)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, photo_bytes
from protocol.errors import AssetNotFound
from protocol.read_cache import LOW_WATER, ReadCache
from protocol.roots import AssetRoots, LocalRoot, put_content
from protocol.store import AssetStore


def blob(i: int, n: int = 1000) -> tuple[str, bytes]:
    data = hashlib.sha256(str(i).encode()).digest() * (n // 32) + bytes(n % 32)
    return hashlib.sha256(data).hexdigest(), data


def test_put_then_get_returns_the_bytes_and_counts_them(tmp_path):
    cache = ReadCache(tmp_path / "c", 10_000)
    sha, data = blob(0)
    assert cache.get(sha, max_bytes=1 << 20) is None
    assert cache.put(sha, data) is True
    assert cache.put(sha, data) is False  # already held
    assert cache.get(sha, max_bytes=1 << 20) == data
    assert cache.usage() == len(data) == int((cache.folder / ".usage").read_text())
    assert cache.path_of(sha) == cache.folder / "objects" / sha[:2] / sha


def test_a_hit_is_checked_and_a_bad_file_is_a_miss_and_removed(tmp_path):
    cache = ReadCache(tmp_path / "c", 10_000)
    sha, data = blob(1)
    cache.put(sha, data)
    path = cache.path_of(sha)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped on disk
    assert cache.get(sha, max_bytes=1 << 20) is None
    assert not path.exists()
    assert int((cache.folder / ".usage").read_text()) == 0


def test_a_bad_file_that_cannot_be_removed_is_still_a_miss(tmp_path, monkeypatch):
    """A cached file failing its check whose removal fails (``.lock`` not openable by this user:
    another user's 0600 cache) is a miss, never a raw PermissionError: the read falls through to
    the roots (the cache is optional, as failed puts already are)."""
    jpeg = photo_bytes("coffee", size=(32, 24))
    sha = hashlib.sha256(jpeg).hexdigest()
    cache = ReadCache(tmp_path / "c", 1 << 20)
    cache.put(sha, jpeg)
    cache.path_of(sha).write_bytes(jpeg[:-1] + b"?")  # on disk, other bytes under its name
    lock = cache.folder / ".lock"
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if str(path) == str(lock):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    assert cache.get(sha, max_bytes=1 << 20) is None
    assert cache.path_of(sha).exists()  # left in place, still checked (and a miss) on every read
    root = tmp_path / "root"
    put_content(AssetStore(root), jpeg)
    roots = AssetRoots([LocalRoot(root)], cache=cache)
    assert roots.read_content(sha, ".jpg") == (jpeg, sha)
    with pytest.raises(AssetNotFound):  # no root holds it: the roots' own answer, typed
        AssetRoots([LocalRoot(tmp_path / "empty")], cache=cache).read_content(sha, ".jpg")


def test_symlinks_fifos_and_oversize_files_are_misses(tmp_path):
    cache = ReadCache(tmp_path / "c", 10_000)
    sha, data = blob(2)
    target = tmp_path / "elsewhere"
    target.write_bytes(data)
    cache.path_of(sha).parent.mkdir(parents=True)
    cache.path_of(sha).symlink_to(target)
    assert cache.get(sha, max_bytes=1 << 20) is None
    sha2, data2 = blob(3)
    cache.put(sha2, data2)
    assert cache.get(sha2, max_bytes=len(data2) - 1) is None  # the caller's limit holds
    assert cache.get(sha2, max_bytes=len(data2)) == data2
    fifo_sha = hashlib.sha256(b"fifo").hexdigest()
    cache.path_of(fifo_sha).parent.mkdir(exist_ok=True)
    os.mkfifo(cache.path_of(fifo_sha))
    assert cache.get(fifo_sha, max_bytes=1 << 20) is None  # O_NONBLOCK: never blocks on a FIFO


def test_ids_are_checked(tmp_path):
    cache = ReadCache(tmp_path / "c", 10)
    for bad in ("../" + "a" * 61, "A" * 64, "a" * 63):
        with pytest.raises(ValueError):
            cache.get(bad, max_bytes=1)
    with pytest.raises(ValueError):
        ReadCache(tmp_path / "d", 0)


def test_the_cap_holds_and_the_least_recently_used_go_first(tmp_path):
    cache = ReadCache(tmp_path / "c", 10_000)
    blobs = [blob(i) for i in range(9)]  # 9,000 bytes
    for k, (sha, data) in enumerate(blobs):
        cache.put(sha, data)
        os.utime(cache.path_of(sha), ns=(k * 10**9, k * 10**9))  # put order = age order
    assert cache.get(blobs[0][0], max_bytes=1 << 20) == blobs[0][1]  # the oldest, used again: now newest
    sha, data = blob(100, 2500)  # 11,500 > cap: evict down to LOW_WATER x cap
    cache.put(sha, data)
    assert cache.usage() <= LOW_WATER * cache.max_bytes
    held = {s for s, _ in blobs if cache.path_of(s).exists()}
    assert blobs[0][0] in held and cache.path_of(sha).exists()
    assert blobs[1][0] not in held and blobs[2][0] not in held  # the least recently used
    assert int((cache.folder / ".usage").read_text()) == cache.usage()


def test_an_image_over_the_cap_is_not_cached(tmp_path):
    cache = ReadCache(tmp_path / "c", 500)
    sha, data = blob(5)
    assert cache.put(sha, data) is False
    assert cache.usage() == 0


def test_abandoned_temp_files_are_swept_by_an_eviction(tmp_path):
    cache = ReadCache(tmp_path / "c", 1500)
    sha, data = blob(6)
    cache.put(sha, data)
    tmp = cache.path_of(sha).parent / ".tmp-0123456789abcdef"
    tmp.write_bytes(b"half")
    os.utime(tmp, (0, 0))
    cache.put(*blob(7))  # 2,000 > 1,500: an eviction
    assert not tmp.exists()


_RACER = textwrap.dedent(
    """
    import hashlib, sys
    sys.path.insert(0, {repo!r})
    from protocol.read_cache import ReadCache
    cache = ReadCache({folder!r}, {cap})
    seed = int(sys.argv[1])
    for round in range(60):
        i = round % 12 if round % 2 else seed * 1000 + round  # shared keys and own keys
        data = hashlib.sha256(str(i).encode()).digest() * 40
        sha = hashlib.sha256(data).hexdigest()
        got = cache.get(sha, max_bytes=1 << 20)
        assert got is None or got == data, "a hit returned other bytes"
        cache.put(sha, data)
    """
)


def test_processes_racing_on_one_folder_keep_the_cap_and_every_file_whole(tmp_path):
    folder, cap = tmp_path / "c", 20_000  # 1,280-byte files: ~15 fit
    script = _RACER.format(repo=str(REPO), folder=str(folder), cap=cap)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(seed)]) for seed in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    cache = ReadCache(folder, cap)
    assert cache.usage() <= cap
    assert int((folder / ".usage").read_text()) == cache.usage()  # every put counted under the lock
    for shard in (folder / "objects").iterdir():
        for path in shard.iterdir():
            assert not path.name.startswith(".tmp-")  # no write left half-done
            assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name
