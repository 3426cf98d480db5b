"""Local-disk tier: one file per value under a two-level fan-out of directories.

Files are written under a temporary name and renamed into place, so a crash never leaves a
half-written file under a real name; temporary files found at start are removed. The index
(key -> size) is rebuilt from the directory tree on start, so a restart keeps the cache.
Capacity counts each file rounded up to the 4 KiB block it occupies and is never exceeded:
a write that does not fit raises ``TierFull`` before touching the disk. Writes are buffered,
or O_DIRECT if asked for and the file system allows it (tiers/direct_write.py).

Reads use ``preadv`` straight into the caller's buffers (scatter: a header buffer and the
tensor's bytes), optionally with O_DIRECT when the buffers are aligned and the file system
supports it; ``read_many_into`` keeps up to ``read_threads`` reads in flight.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from kernels.parallel_copy import copy_hashing, copy_pairs
from tiers.base import Buffer, Tier, TierFull, TierUnavailable, as_buffers
from tiers.direct_write import bounce_buffer, write_direct
from tiers.files import SUFFIX, TMP_SUFFIX, DirectoryInUse, DirectoryLock, read_fully, read_fully_hashing, round_up, skip, sync_filesystem, unlink_quietly

HASH_SLICE_BYTES = 256 << 10  # a slice just read is still in L2 when it is hashed
_UNAVAILABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOTDIR}


class DataDirectoryInUse(TierUnavailable):
    """Another live process (daemon, Store, benchmark) holds this private data directory."""


class DiskTier(Tier):
    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        fsync: bool = False,
        o_direct: bool = False,
        read_threads: int = 4,
        name: str = "disk",
        direct_writes: bool = False,
    ) -> None:
        super().__init__(name, capacity_bytes)
        self.root = Path(path)
        self.fsync = fsync
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.direct_writes = direct_writes and hasattr(os, "O_DIRECT")
        self.read_threads = max(1, read_threads)
        self._sizes: dict[bytes, int] = {}
        # keys whose file holds data an fsync covered (its directory entry maybe not yet): a
        # write that replaces one fsyncs its temporary file before the rename, so a power loss
        # between the rename and the caller's ``sync`` leaves the old whole file or the new
        # whole one under the name, never an empty one in place of a durable put's
        self._synced: set[bytes] = set()
        # fan-out directories created here whose entries in their parents are not synced yet
        self._unsynced_dirs: set[Path] = set()
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()
        # A file's rename into place and its removal happen under its key's stripe, with the
        # size map updated in the same hold: a delete racing a write of the same key can
        # never unlink the new file while the map says it is there (review #21).
        self._stripes = [threading.Lock() for _ in range(64)]
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"{name}-read")
        self._dir_lock: DirectoryLock | None = None  # a private directory's (tiers/files.py)
        self._recover()

    # -- layout -------------------------------------------------------------------------

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[-4:-2] / name[-2:] / (name + SUFFIX)

    def _recover(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._dir_lock = DirectoryLock(self.root)
        except DirectoryInUse as exc:
            raise DataDirectoryInUse(f"{self.name}: {exc}") from None
        except OSError as exc:
            # mkdir(exist_ok=True) says "File exists" of a file in the directory's place
            reason = "it is a file, not a directory" if isinstance(exc, FileExistsError) else exc.strerror
            raise TierUnavailable(f"{self.name}: cannot use data directory {self.root}: {reason}") from exc
        for dirpath, _, files in os.walk(self.root):
            for fname in files:
                full = os.path.join(dirpath, fname)
                if fname.endswith(TMP_SUFFIX):
                    unlink_quietly(full)
                    continue
                if not fname.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(fname[: -len(SUFFIX)])
                    size = os.stat(full).st_size
                except (ValueError, OSError):
                    continue
                self._sizes[key] = size
                self._used += round_up(size)

    # -- accounting ---------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1))

    @property
    def used_bytes(self) -> int:
        return self._used + self._reserved

    # -- Tier interface -------------------------------------------------------------------

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") if not isinstance(p, np.ndarray) else memoryview(p.reshape(-1).view(np.uint8)) for p in parts]
        length = sum(len(v) for v in views)
        need = self.footprint(length)
        with self._lock:
            # the old file stays until the new one replaces it: both count until then
            if self._used + self._reserved + need > self.capacity_bytes:
                raise TierFull(f"{self.name}: {need} bytes do not fit ({self.used_bytes}/{self.capacity_bytes} used)")
            self._reserved += need
        try:
            durable = self.fsync or self._replaces_synced(key)
            tmp = self._write_temp(key, views, length, durable)
            with self._stripe(key):
                if not durable and self._replaces_synced(key):  # synced since it was looked at
                    self._fsync_temp(tmp)
                    durable = True
                self._rename(tmp, self.path_of(key))
                with self._lock:
                    self._reserved -= need
                    previous = self._sizes.get(key)
                    if previous is not None:
                        self._used -= round_up(previous)
                    self._sizes[key] = length
                    self._used += need
                    if durable:
                        self._synced.add(key)
                    else:
                        self._synced.discard(key)
        except BaseException:
            with self._lock:
                self._reserved -= need
            raise

    def is_synced(self, key: bytes) -> bool:
        """Whether the value's data is on the medium whole: synced, or written over a synced
        value with its data fsynced first (a power loss then leaves the old or the new one)."""
        with self._lock:
            return key in self._synced

    def _replaces_synced(self, key: bytes) -> bool:
        """Whether the file a write of ``key`` replaces may be a durable put's (its data synced)."""
        return key in self._synced

    def _fsync_temp(self, tmp: Path) -> None:
        try:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            unlink_quietly(tmp)
            raise self._error(exc) from exc

    def _stripe(self, key: bytes) -> threading.Lock:
        return self._stripes[key[-1] % len(self._stripes)]

    def temp_path(self, final: Path) -> Path:
        """A name no other writer uses, beside the final one (so the rename stays in one directory)."""
        return final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")

    def _write_temp(self, key: bytes, views: list[memoryview], length: int, sync: bool = False) -> Path:
        """The value in a new temporary file beside its final name (fsync'ed if ``sync``),
        written with O_DIRECT unless the file system refuses it (tiers/direct_write.py)."""
        final = self.path_of(key)
        while True:
            direct = self.direct_writes
            tmp = self.temp_path(final)
            try:
                self._make_dirs(final.parent)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:
                    self.direct_writes = False  # this file system does not support O_DIRECT
                    continue
                raise self._error(exc) from exc
            try:
                if direct:
                    write_direct(fd, views, self._bounce())
                else:
                    written = 0
                    while written < length:
                        written += os.writev(fd, skip(views, written)[:1024])
                if sync:
                    os.fsync(fd)
            except OSError as exc:
                os.close(fd)
                unlink_quietly(tmp)
                if direct and exc.errno == errno.EINVAL:
                    self.direct_writes = False  # it opened, but refuses these writes
                    continue
                raise self._error(exc) from exc
            os.close(fd)
            return tmp

    def _bounce(self):
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = bounce_buffer()
        return bounce

    def _rename(self, tmp: Path, final: Path) -> None:
        try:
            os.replace(tmp, final)
            if self.fsync:
                self._sync_dir(final.parent)
                self._sync_new_dirs(final.parent)
        except OSError as exc:
            unlink_quietly(tmp)
            raise self._error(exc) from exc

    def _make_dirs(self, directory: Path) -> None:
        """Create a value's missing fan-out directories (at most 65,536, once each). Their
        entries in their parents are synced only when a value in them must be durable
        (``_sync_new_dirs``): a write-behind copy syncs nothing, and the first durable value
        in a directory one created must not then depend on the file system's ordering."""
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        with self._lock:  # noted before the mkdir: a durable write beside it sees it as new
            self._unsynced_dirs.update(missing)
        for new in reversed(missing):
            try:
                new.mkdir()
            except FileExistsError:  # another writer's
                pass

    def _sync_new_dirs(self, directory: Path) -> None:
        """fsync, innermost first, the parents of ``directory`` and of its ancestors that this
        tier created and nobody synced into their parents yet."""
        while directory != self.root:
            with self._lock:
                new = directory in self._unsynced_dirs
            if new:
                self._sync_dir(directory.parent)
                with self._lock:
                    self._unsynced_dirs.discard(directory)
            directory = directory.parent

    @staticmethod
    def _sync_dir(path: Path) -> None:
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def sync_all(self) -> None:
        """One ``syncfs`` of the data directory's file system, not an fsync per file (a clean
        file's fsync with its directory's costs about 0.1 ms here; syncfs costs what is dirty)."""
        with self._lock:
            present = list(self._sizes)
        try:
            sync_filesystem(self.root)
        except OSError as exc:
            raise self._error(exc) from exc
        with self._lock:
            self._synced.update(k for k in present if k in self._sizes)

    def sync_deleted(self, keys: Sequence[bytes]) -> None:
        """fsync the directories the keys' files were removed from: an unlink is a change of
        its directory, which a power loss undoes until the directory is written back."""
        for directory in sorted({self.path_of(k).parent for k in keys}):
            try:
                self._sync_dir(directory)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._error(exc) from exc

    def sync(self, key: bytes) -> None:
        """fsync the value's file and its directory: after this a power loss keeps it whole."""
        if self.fsync:
            return  # every write was synced already
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            self._sync_dir(path.parent)
            self._sync_new_dirs(path.parent)
        except OSError as exc:
            raise self._error(exc) from exc
        with self._stripe(key):  # the file synced is still the one under the name
            try:
                same = os.stat(path).st_ino == inode
            except OSError:
                same = False
            with self._lock:
                if same and key in self._sizes:
                    self._synced.add(key)

    def peek(self, key: bytes, nbytes: int) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            return os.pread(fd, nbytes, 0)
        except OSError as exc:
            raise self._error(exc) from exc
        finally:
            os.close(fd)

    def _error(self, exc: OSError) -> Exception:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return TierFull(f"{self.name}: file system is full ({exc.strerror})")
        if exc.errno in _UNAVAILABLE or exc.errno == errno.ENOENT:
            return TierUnavailable(f"{self.name}: {self.root}: {exc.strerror}")
        return TierUnavailable(f"{self.name}: I/O error: {exc}")

    def read_into(self, key: bytes, out) -> int | None:
        """Read the value into ``out`` (one buffer or a list, filled in order).

        Returns the number of bytes read, or None if the key is absent or its file vanished.
        A file shorter or longer than recorded reads what is there: the blob checks above
        this tier catch the difference.
        """
        return self._read(key, out, None)

    def read_into_hashing(self, key: bytes, out, head_bytes: int, digest) -> int | None:
        """Buffered reads go in slices, each hashed as it lands; an O_DIRECT read lands in a
        staging buffer and is hashed slice by slice as it is copied out (one pass either way)."""
        return self._read(key, out, (head_bytes, digest))

    def _read(self, key: bytes, out, hashing: tuple | None) -> int | None:
        outs = [memoryview(o).cast("B") for o in as_buffers(out)]
        size = self._sizes.get(key)
        if size is None:
            return None
        capacity = sum(len(o) for o in outs)
        if size > capacity:
            raise ValueError(f"{self.name}: buffer of {capacity} bytes is too small for {size}")
        if self.o_direct:
            try:
                return self._read_direct(key, size, outs, hashing)
            except FileNotFoundError:
                self._gone(key)
                return None
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise self._error(exc) from exc
                self.o_direct = False  # this file system does not support O_DIRECT
        fd = self._open(key)
        if fd is None:
            return None
        try:
            if hashing is not None:
                return read_fully_hashing(fd, outs, *hashing, HASH_SLICE_BYTES)
            return read_fully(fd, outs)
        except OSError as exc:
            raise self._error(exc) from exc
        finally:
            os.close(fd)

    def _open(self, key: bytes) -> int | None:
        """A read descriptor for the key's file; None (and forgotten) if the file is gone."""
        try:
            return os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            self._gone(key)
            return None
        except OSError as exc:
            raise self._error(exc) from exc

    def _read_direct(self, key: bytes, size: int, outs: list[memoryview], hashing: tuple | None = None) -> int:
        """O_DIRECT read into a reused, page-aligned per-thread staging buffer, then copy out:
        on all cores, and (``hashing``: (head bytes, digest)) in slices, each hashed right after
        it is copied, while it is in cache (``copy_hashing``)."""
        staging = getattr(self._local, "staging", None)
        need = round_up(size)
        if staging is None or len(staging) < need:
            staging = mmap.mmap(-1, need)
            self._local.staging = staging
        fd = os.open(self.path_of(key), os.O_RDONLY | os.O_DIRECT)
        try:
            got = read_fully(fd, [memoryview(staging)[:need]])
        finally:
            os.close(fd)
        got = min(got, sum(len(o) for o in outs))
        src = np.frombuffer(staging, dtype=np.uint8, count=got)
        pairs, done = [], 0
        for o in outs:
            take = min(len(o), got - done)
            pairs.append((np.frombuffer(o, dtype=np.uint8, count=take), src[done : done + take]))
            done += take
        if hashing is None:
            copy_pairs(pairs)
            return got
        head_bytes, digest = hashing
        body, offset = [], 0
        for dst, piece in pairs:
            skip = min(max(head_bytes - offset, 0), piece.size)
            np.copyto(dst[:skip], piece[:skip])
            body.append((dst[skip:], piece[skip:]))
            offset += piece.size
        copy_hashing(body, digest)
        return got

    def read_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """``read_into`` for many keys with up to ``read_threads`` reads in flight. Returns
        (or raises the first read's error) only once no read writes ``outs`` any more."""
        futures = [self._pool.submit(self.read_into, key, out) for key, out in zip(keys, outs)]
        wait(futures)
        return [f.result() for f in futures]

    def drop_cache(self, key: bytes) -> None:
        """Ask the kernel to drop this file's cached pages (cold-read benchmarks)."""
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except OSError:
            return
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _gone(self, key: bytes) -> None:
        """A read found no file: forget the key, unless a write of ours renamed a new file in
        since (looked at under the key's stripe, which writes and deletes hold). Forgotten
        outside it, a durable re-put's file landing between the failed open and the forget
        was dropped from the view and then from the index: lost, uncounted, undeletable."""
        with self._stripe(key):
            if not os.path.exists(self.path_of(key)):
                self._forget(key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._synced.discard(key)
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= round_up(size)

    def delete(self, key: bytes) -> bool:
        """Remove the file. A medium that refuses the unlink (EIO, EROFS, ...) raises, and the
        tier still counts the file: it is there, and would be found again at the next start."""
        with self._stripe(key):
            with self._lock:
                if key not in self._sizes:
                    return False
            try:
                os.unlink(self.path_of(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._error(exc) from exc
            with self._lock:
                self._synced.discard(key)
                size = self._sizes.pop(key, None)
                if size is not None:
                    self._used -= round_up(size)
        return True

    def contains(self, key: bytes) -> bool:
        return key in self._sizes

    def size_of(self, key: bytes) -> int | None:
        return self._sizes.get(key)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._sizes))

    def __len__(self) -> int:
        return len(self._sizes)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._dir_lock is not None:
            self._dir_lock.close()
