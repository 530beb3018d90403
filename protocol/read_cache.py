"""A bounded read-through cache of image bytes on local disk, shared by the processes of one node.

Object-store roots (:mod:`protocol.roots`) put every image they serve here, named by its full
sha256; the next read of the same image on this node takes it from disk instead of the network.
Layout under the cache folder::

    objects/<sha256[:2]>/<sha256>        the bytes, exactly as the store served them
    objects/<sha256[:2]>/.tmp-<16 hex>   a writer's temp file (renamed over the name when whole)
    .lock                                fcntl lock: puts and evictions, one process at a time
    .usage                               bytes held, as written under the lock (ASCII int)

- **Writes are atomic**: a temp file in the same folder, then ``os.replace`` under the lock; a
  reader sees a whole file or none. Two processes putting the same image: the second finds the
  name taken and drops its temp file.
- **Byte cap, LRU**: a put that takes ``.usage`` over ``max_bytes`` scans the folder and removes
  the least recently used files (oldest mtime) down to :data:`LOW_WATER` x ``max_bytes``. A hit
  refreshes the file's mtime (``os.utime`` on the open descriptor), so "recently used" holds
  across processes without a shared index. Eviction is ``unlink``: a reader holding the file
  keeps reading, a later one misses and reads through again.
- **Hits are checked**: the whole file's sha256 must equal its name before the bytes are returned
  (the same check as a read from a root; a file that fails is removed and counts as a miss).
  Opened ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-ed: a symlink, FIFO or oversize file is a miss.

The lock is ``fcntl.flock``: processes of one node sharing one local folder (not a network mount).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from protocol.refs import SHA256_RE
from protocol.store import TEMP_PREFIX, temp_file

__all__ = ["LOW_WATER", "TEMP_MAX_AGE_S", "ReadCache"]

LOW_WATER = 0.9
"""An eviction brings the cache down to this fraction of its cap (one scan per ~10% of the cap)."""
TEMP_MAX_AGE_S = 600.0
"""A writer's temp file older than this (seconds) is an abandoned write; an eviction removes it."""


class ReadCache:
    """A byte-capped, LRU, multi-process cache of verified image bytes, keyed by sha256.

    Args:
        folder: the cache folder (created if missing); local disk of this node.
        max_bytes: cap on the bytes held (files only; at least 1). An image larger than the cap
            is not cached.

    Raises:
        ValueError: ``max_bytes < 1``.
        OSError: the folder cannot be created.
    """

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"read cache max_bytes must be >= 1, got {max_bytes}")
        self.folder = Path(folder).resolve()
        self.max_bytes = int(max_bytes)
        self.objects = self.folder / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)

    def path_of(self, sha256: str) -> Path:
        """Where the image with this sha256 is (or would be) held.

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex characters.
        """
        if not SHA256_RE.fullmatch(sha256):
            raise ValueError(f"sha256 {sha256[:80]!r} is not 64 lowercase hex characters")
        return self.objects / sha256[:2] / sha256

    def get(self, sha256: str, *, max_bytes: int) -> bytes | None:
        """The cached bytes of ``sha256``, verified, or None (a miss).

        A file that is not a regular file, is over ``max_bytes``, or does not hash to its name is a
        miss (the last one is removed, where this process may: a failed removal is still a miss).
        A hit refreshes the file's mtime (its LRU age).

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex characters.
        """
        path = self.path_of(sha256)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # absent (never cached, evicted), a symlink (ELOOP)
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                return None
            data = f.read(max_bytes + 1)
            if len(data) > max_bytes:
                return None
            if hashlib.sha256(data).hexdigest() != sha256:
                with contextlib.suppress(OSError):  # a lock or folder this user may not write: still a miss
                    self._discard(path, st.st_size)
                return None
            with contextlib.suppress(OSError):  # another user's file: still a hit, not re-aged
                os.utime(fd)
        return data

    def put(self, sha256: str, data: bytes) -> bool:
        """Hold ``data`` under ``sha256`` (the caller has checked that it hashes to it; :meth:`get`
        checks again). Evicts least recently used files past the cap.

        Returns:
            True when this call added the file, False when it was already held or is over the cap.

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex characters.
            OSError: the cache folder is not writable (callers treat the cache as optional).
        """
        path = self.path_of(sha256)
        if len(data) > self.max_bytes or os.path.lexists(path):
            return False
        path.parent.mkdir(exist_ok=True)
        with temp_file(path.parent, data) as tmp, self._locked():
            if os.path.lexists(path):  # another process won the race with the same bytes
                return False
            usage = self._read_usage() + len(data)  # read first: a rescan must not see the file
            os.replace(tmp, path)
            if usage > self.max_bytes:
                usage = self._evict_locked(int(self.max_bytes * LOW_WATER))
            self._write_usage(usage)
        return True

    def usage(self) -> int:
        """Bytes held now, by a scan of the folder (the ``.usage`` figure may lag after a crash)."""
        return sum(size for _, size, _ in self._entries())

    # --- internals -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _read_usage(self) -> int:
        try:
            return int((self.folder / ".usage").read_text() or "0")
        except (OSError, ValueError):
            return self.usage()

    def _write_usage(self, usage: int) -> None:
        (self.folder / ".usage").write_text(str(max(usage, 0)))

    def _entries(self) -> Iterator[tuple[int, int, str]]:
        """``(mtime_ns, size, path)`` of every cached file (temp files left out)."""
        for shard in os.scandir(self.objects):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if entry.name.startswith(TEMP_PREFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    yield st.st_mtime_ns, st.st_size, entry.path

    def _evict_locked(self, target: int) -> int:
        """Remove the least recently used files until at most ``target`` bytes remain, and temp
        files older than :data:`TEMP_MAX_AGE_S`; return the bytes left. Caller holds the lock."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            total -= size
        cutoff = time.time() - TEMP_MAX_AGE_S
        for shard in os.scandir(self.objects):
            if shard.is_dir(follow_symlinks=False):
                for entry in os.scandir(shard.path):
                    if entry.name.startswith(TEMP_PREFIX):
                        with contextlib.suppress(FileNotFoundError):
                            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                                os.unlink(entry.path)
        return total

    def _discard(self, path: Path, size: int) -> None:
        """Remove a file that failed its check, and count its bytes out.

        Raises:
            OSError: the lock, the file's folder or ``.usage`` cannot be written by this process
                (:meth:`get` counts the file as a miss all the same).
        """
        with self._locked():
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            self._write_usage(self._read_usage() - size)
