"""protocol.store: the content-addressed asset store on a real disk (docs/PROTOCOL.md, "Asset store")."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import photo_bytes
from protocol.errors import (
    AssetNotFound,
    AssetOutsideRoot,
    AssetTooLarge,
    HashMismatch,
    ImageUnreadable,
    InvalidRef,
    StoreUnavailable,
)
from protocol.refs import file_uri_to_path
from protocol.store import AssetStore, StoredImage, atomic_write

SMALL = (64, 48)


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return photo_bytes("astronaut", "JPEG", SMALL)


@pytest.fixture
def store(tmp_path) -> AssetStore:
    return AssetStore(tmp_path / "run_1" / "assets")


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# ---------------------------------------------------------------------------------------------------------
# put_image
# ---------------------------------------------------------------------------------------------------------


def test_put_image_layout(store, jpeg):
    stored = store.put_image(jpeg)
    digest = hashlib.sha256(jpeg).hexdigest()
    assert stored == StoredImage(
        sha256=digest,
        path=store.root / "images" / f"{digest[:16]}.jpg",
        media_type="image/jpeg",
        nbytes=len(jpeg),
    )
    assert stored.mm_hash == digest[:32]
    assert stored.path.read_bytes() == jpeg
    assert _names(store.images_dir) == [f"{digest[:16]}.jpg"]


@pytest.mark.parametrize(
    "fmt,media_type,ext",
    [
        ("JPEG", "image/jpeg", ".jpg"),
        ("PNG", "image/png", ".png"),
        ("WEBP", "image/webp", ".webp"),
        ("GIF", "image/gif", ".gif"),
        ("BMP", "image/bmp", ".img"),
        ("TIFF", "image/tiff", ".img"),
    ],
)
def test_put_image_extension_per_media_type(store, fmt, media_type, ext):
    data = photo_bytes("coffee", fmt, SMALL)
    stored = store.put_image(data)
    assert stored.media_type == media_type
    assert stored.path.name == hashlib.sha256(data).hexdigest()[:16] + ext
    assert stored.path.read_bytes() == data


def test_put_image_is_idempotent_and_refreshes_mtime(store, jpeg):
    first = store.put_image(jpeg)
    old = time.time() - 7200
    os.utime(first.path, (old, old))
    inode = first.path.stat().st_ino
    second = store.put_image(jpeg)
    assert second == first
    assert first.path.stat().st_mtime > old + 3600  # refreshed: the TTL sweeper must not take it
    assert first.path.stat().st_ino == inode  # kept, not rewritten
    assert _names(store.images_dir) == [first.path.name]


def test_put_image_from_a_path(store, tmp_path, jpeg):
    src = tmp_path / "upload.bin"
    src.write_bytes(jpeg)
    assert store.put_image(src) == store.put_image(str(src)) == store.put_image(jpeg)


def test_different_images_get_different_files(store):
    a = store.put_image(photo_bytes("astronaut", "PNG", SMALL))
    b = store.put_image(photo_bytes("chelsea", "PNG", SMALL))
    assert a.path != b.path and a.sha256 != b.sha256
    assert _names(store.images_dir) == sorted([a.path.name, b.path.name])


@pytest.mark.parametrize(
    "data", [b"", b"not an image at all", b"%PDF-1.7\n", random.Random(0).randbytes(256)], ids=repr
)
def test_put_image_rejects_non_images_and_writes_nothing(store, data):
    with pytest.raises(ImageUnreadable):
        store.put_image(data)
    assert not store.images_dir.exists() or _names(store.images_dir) == []


def test_file_mode_honours_the_umask(store, jpeg):
    mode = stat.S_IMODE(store.put_image(jpeg).path.stat().st_mode)
    assert mode == 0o666 & ~_current_umask()
    assert mode != 0o600  # mkstemp's private mode must not leak: other users (the server) read these


@pytest.mark.parametrize("mask", [0o077, 0o002])
def test_file_mode_follows_a_umask_set_after_import(store, jpeg, mask):
    old = os.umask(mask)
    try:
        path = store.put_image(jpeg).path
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask


def test_relative_root_gives_absolute_file_uris(tmp_path, monkeypatch, jpeg):
    monkeypatch.chdir(tmp_path)
    store = AssetStore(Path("outputs") / "run_7" / "assets")
    assert store.root.is_absolute()
    stored = store.put_image(jpeg)
    assert stored.path.is_absolute()
    assert stored.uri.startswith("file:///")
    assert not stored.uri.startswith("file://outputs")
    expected = tmp_path.resolve() / "outputs" / "run_7" / "assets" / "images" / stored.path.name
    assert file_uri_to_path(stored.uri) == str(expected)
    monkeypatch.chdir("/")  # the URI keeps working from anywhere
    assert store.read_hashed(stored.uri, stored.mm_hash)[0] == jpeg


def test_uri_round_trips_odd_characters(tmp_path, jpeg):
    store = AssetStore(tmp_path / "out dir #1" / "run_ü" / "assets")
    stored = store.put_image(jpeg)
    assert "%20" in stored.uri and "%23" in stored.uri
    assert store.read_hashed(stored.uri, stored.mm_hash)[0] == jpeg


def test_atomic_write_leaves_no_temp_files(store):
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        store.put_image(photo_bytes(name, "PNG", SMALL))
        store.put_image(photo_bytes(name, "PNG", SMALL))
    names = _names(store.images_dir)
    assert len(names) == 4
    assert all(not n.startswith(".") and "tmp" not in n for n in names)


def test_atomic_write_cleans_up_after_a_failed_write(tmp_path):
    target = tmp_path / "d" / "x.bin"
    with pytest.raises(TypeError):
        atomic_write(target, "str is not bytes")  # fails inside the write, after mkstemp
    assert not target.exists()
    assert _names(target.parent) == []


def test_atomic_write_reports_whether_it_wrote(tmp_path):
    target = tmp_path / "x.bin"
    assert atomic_write(target, b"one") is True
    assert atomic_write(target, b"one") is False  # the very bytes are there: kept
    assert atomic_write(target, b"two") is True  # anything else found there is not trusted
    assert target.read_bytes() == b"two"


def test_put_image_repairs_what_it_finds_damaged(store, tmp_path, jpeg):
    """A stored image that was truncated, overwritten, or swapped for a symlink is rewritten by the
    next put of the original bytes (the writer verifies, it does not trust the name)."""
    stored = store.put_image(jpeg)
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(b"not yours")
    damage = {
        "truncated": lambda p: p.write_bytes(jpeg[: len(jpeg) // 2]),
        "replaced": lambda p: p.write_bytes(photo_bytes("coffee", "JPEG", SMALL)),
        "same size, one byte flipped": lambda p: p.write_bytes(jpeg[:-1] + bytes([jpeg[-1] ^ 1])),
        "emptied": lambda p: p.write_bytes(b""),
        "a symlink": lambda p: (p.unlink(), p.symlink_to(outside)),
    }
    for name, hurt in damage.items():
        hurt(stored.path)
        with pytest.raises((HashMismatch, AssetOutsideRoot)):
            store.read_hashed(stored.uri, stored.mm_hash)
        assert store.put_image(jpeg) == stored, name
        assert not stored.path.is_symlink() and stored.path.read_bytes() == jpeg, name
        assert store.read_hashed(stored.uri, stored.mm_hash)[0] == jpeg, name
    assert outside.read_bytes() == b"not yours"
    assert _names(store.images_dir) == [stored.path.name]  # no temp files left


def test_concurrent_puts_of_one_image(store, jpeg):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: store.put_image(jpeg), range(32)))
    assert len(set(results)) == 1
    assert _names(store.images_dir) == [results[0].path.name]
    assert results[0].path.read_bytes() == jpeg


# ---------------------------------------------------------------------------------------------------------
# read_hashed
# ---------------------------------------------------------------------------------------------------------


def test_read_hashed_good(store, jpeg):
    stored = store.put_image(jpeg)
    assert store.read_hashed(stored.uri, stored.mm_hash) == (jpeg, stored.sha256)  # the full digest
    assert store.read_hashed(stored.uri, stored.sha256)[0] == jpeg
    assert store.read_hashed(stored.uri, stored.sha256[:16])[0] == jpeg
    localhost = stored.uri.replace("file://", "file://localhost", 1)
    assert store.read_hashed(localhost, stored.mm_hash)[0] == jpeg


def test_read_hashed_hash_mismatch(store, jpeg):
    stored = store.put_image(jpeg)
    other = hashlib.sha256(jpeg + b"x").hexdigest()
    with pytest.raises(HashMismatch) as info:
        store.read_hashed(stored.uri, other[:32], ref="mmraw:x")
    assert info.value.ref == "mmraw:x"
    with pytest.raises(HashMismatch):
        store.read_hashed(stored.uri, stored.sha256 + "00")  # longer than any sha256


def test_read_hashed_detects_a_changed_file(store, jpeg):
    stored = store.put_image(jpeg)
    stored.path.write_bytes(jpeg[:-1] + bytes([jpeg[-1] ^ 1]))
    with pytest.raises(HashMismatch):
        store.read_hashed(stored.uri, stored.mm_hash)


def test_read_hashed_missing(store, jpeg):
    stored = store.put_image(jpeg)
    missing = (store.images_dir / ("0" * 16 + ".jpg")).as_uri()
    with pytest.raises(AssetNotFound) as info:
        store.read_hashed(missing, "0" * 32, ref="mmraw:y")
    assert info.value.ref == "mmraw:y"
    with pytest.raises(AssetNotFound):  # a directory inside the root is not an asset
        store.read_hashed(store.images_dir.as_uri(), stored.mm_hash)
    stored.path.unlink()
    with pytest.raises(FileNotFoundError):  # the builtin still catches it
        store.read_hashed(stored.uri, stored.mm_hash)


def test_read_hashed_rejects_dotdot_traversal(store, tmp_path, jpeg):
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(jpeg)
    store.put_image(jpeg)
    sha = hashlib.sha256(jpeg).hexdigest()
    uri = (store.images_dir / ".." / ".." / ".." / "secret.jpg").as_uri()
    assert "/../" in uri
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed(uri, sha[:32])
    # A missing file outside the root is also "outside": no existence oracle beyond the root.
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed((store.images_dir / ".." / ".." / ".." / "nope.jpg").as_uri(), sha[:32])
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed(f"file://{store.root}/images/%2e%2e/%2e%2e/%2e%2e/secret.jpg", sha[:32])


def test_read_hashed_rejects_absolute_paths_outside(store, tmp_path, jpeg):
    outside = tmp_path / "elsewhere.jpg"
    outside.write_bytes(jpeg)
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed(outside.as_uri(), hashlib.sha256(jpeg).hexdigest()[:32])


def test_read_hashed_rejects_a_sibling_with_the_same_prefix(store, jpeg):
    sibling = store.root.parent / (store.root.name + "2") / "images" / "x.jpg"
    sibling.parent.mkdir(parents=True)
    sibling.write_bytes(jpeg)
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed(sibling.as_uri(), hashlib.sha256(jpeg).hexdigest()[:32])


def test_read_hashed_rejects_a_symlink_pointing_outside(store, tmp_path, jpeg):
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(jpeg)
    store.images_dir.mkdir(parents=True)
    link = store.images_dir / "aaaaaaaaaaaaaaaa.jpg"
    link.symlink_to(outside)
    sha = hashlib.sha256(jpeg).hexdigest()
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed(link.as_uri(), sha[:32])
    # A symlinked directory inside the root that leads outside is refused as well.
    (store.root / "escape").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(AssetOutsideRoot):
        store.read_hashed((store.root / "escape" / "secret.jpg").as_uri(), sha[:32])


def test_read_hashed_allows_a_symlink_inside_the_root(store, jpeg):
    stored = store.put_image(jpeg)
    link = store.root / "alias.jpg"
    link.symlink_to(stored.path)
    assert store.read_hashed(link.as_uri(), stored.mm_hash)[0] == jpeg
    relative = store.images_dir / "relative_alias.jpg"
    relative.symlink_to(stored.path.name)
    assert store.read_hashed(relative.as_uri(), stored.mm_hash)[0] == jpeg


def test_store_opened_through_a_symlinked_root(tmp_path, jpeg):
    real = tmp_path / "real_assets"
    real.mkdir()
    (tmp_path / "link_assets").symlink_to(real, target_is_directory=True)
    store = AssetStore(tmp_path / "link_assets")
    assert store.root == real.resolve()
    stored = store.put_image(jpeg)
    via_link = (tmp_path / "link_assets" / "images" / stored.path.name).as_uri()
    assert store.read_hashed(via_link, stored.mm_hash)[0] == jpeg
    assert store.read_hashed(stored.uri, stored.mm_hash)[0] == jpeg


def test_read_hashed_size_limit(store, jpeg):
    stored = store.put_image(jpeg)
    assert store.read_hashed(stored.uri, stored.mm_hash, max_bytes=len(jpeg))[0] == jpeg
    with pytest.raises(AssetTooLarge) as info:
        store.read_hashed(stored.uri, stored.mm_hash, max_bytes=len(jpeg) - 1, ref="mmraw:z")
    assert info.value.ref == "mmraw:z"
    assert info.value.http_status == 413


@pytest.mark.parametrize(
    "uri",
    [
        "http://example.com/a.jpg",
        "data:image/jpeg;base64,/9j/4AAQ",
        "ftp://host/a.jpg",
        "file://otherhost/a.jpg",
        "file:images/a.jpg",
        "images/a.jpg",
        "file:///a%00.jpg",
    ],
)
def test_read_hashed_rejects_non_file_uris(store, jpeg, uri):
    stored = store.put_image(jpeg)
    with pytest.raises(InvalidRef):
        store.read_hashed(uri, stored.mm_hash)


@pytest.mark.timeout(30)
def test_fifos_long_names_and_messages_never_block_crash_or_leak(store, jpeg):
    """A FIFO in the root (a reader would block forever on it), a 300-character file name
    (ENAMETOOLONG) and an escaping path: typed errors, and no message names the asset root."""
    fifo = store.images_dir / "feedfeedfeedfeed.jpg"
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    with pytest.raises(AssetNotFound):
        store.read_confined(fifo, max_bytes=1024)
    with pytest.raises(AssetNotFound):
        store.read_hashed(fifo.as_uri(), "a" * 16)
    with pytest.raises(AssetNotFound) as long_name:
        store.read_hashed((store.images_dir / ("a" * 300 + ".jpg")).as_uri(), "a" * 16)
    with pytest.raises(AssetOutsideRoot) as outside:
        store.confine(store.root / ".." / "elsewhere.jpg")
    assert "File name too long" in str(long_name.value)
    message = str(outside.value)  # the ref's own path, not the root nor where it resolves to
    assert (
        "resolves outside the asset root" in message
        and str(store.root.parent / "elsewhere.jpg") not in message
    )
    assert message.count(str(store.root)) == 1  # once, inside the given path ".../assets/../elsewhere.jpg"
    with pytest.raises(AssetTooLarge):
        store.read_confined(store.put_image(jpeg).path, max_bytes=10)


@pytest.mark.parametrize(
    "code,error",
    [
        (errno.ELOOP, AssetOutsideRoot),  # a symlink swapped in after confine(): O_NOFOLLOW
        (errno.ENOENT, AssetNotFound),  # swept or removed meanwhile
        (errno.ENXIO, AssetNotFound),  # a socket swapped in
        (errno.EACCES, StoreUnavailable),  # a 0600 file of another user: not outside the root
        (errno.EPERM, StoreUnavailable),
        (errno.EMFILE, StoreUnavailable),  # too many open files: retryable
        (errno.ENFILE, StoreUnavailable),
        (errno.EIO, StoreUnavailable),
    ],
    ids=errno.errorcode.get,
)
def test_an_open_that_fails_after_confine_is_typed_by_its_errno(store, jpeg, monkeypatch, code, error):
    """Only ELOOP is ``outside_root`` (403); every other failure of the open used to be too."""
    stored = store.put_image(jpeg)
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if str(path) == str(stored.path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(error) as info:
        store.read_hashed(stored.uri, stored.mm_hash, ref="r")
    assert type(info.value) is error and info.value.ref == "r"
