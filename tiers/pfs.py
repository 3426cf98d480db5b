"""Parallel-file-system tier: chunk files on a mount shared by many daemons on many hosts
(Lustre, GPFS, NFS, 3FS: just a directory path).

Same layout as the local-disk tier (one file per value, named by the key's hex, under a
two-level fan-out of 256 x 256 directories taken from the key's last bytes, which are hash
bits, so directories stay small and evenly filled). What changes when many writers share
the mount:

- Values are content-addressed: a key names the KV, so two daemons writing one key write the
  same chunk and a rename over an existing file is harmless; but not always the same bytes
  (the codec is not part of the key), which the Store's read path allows for. A write goes
  to a temporary name unique across hosts (host, pid, random) and is renamed into place; no
  locks anywhere.
- Other daemons' files are found: a key missing from this daemon's view costs one ``stat``
  (``size_of``/``contains``) or one ``open`` (``read_into``), and ``keys()`` rescans the mount.
- A file deleted by another daemon is a clean miss here: the read returns None and the view
  forgets the key.
- Temporary files are removed at start only when older than ``stale_temp_s``: a younger one
  may be another host's write in flight.
- Capacity: the mount is shared, so ``used_bytes`` is this daemon's view of it (files found
  by the last scan plus those written, read or found since, each rounded up to 4 KiB), and
  ``capacity_bytes`` is this daemon's budget against that view. ``rescan()`` refreshes it.

Reads go straight into the caller's buffers with ``preadv``; ``read_many_into`` keeps up to
``read_threads`` large sequential reads in flight. ``read_into_device`` reads into a CUDA
tensor, GPU-direct through kvikio when it is installed (a GPU-only path), else via host memory.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from typing import Iterator

from tiers.base import Tier, TierUnavailable, as_buffers
from tiers.files import SUFFIX, TMP_SUFFIX, read_fully, round_up, unlink_quietly
from tiers.disk import DiskTier

try:
    import kvikio
except ImportError:  # optional: only useful where a GPU and GPUDirect Storage are present
    kvikio = None


class PfsTier(DiskTier):
    shared = True

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        read_threads: int = 8,
        fsync: bool = False,
        stale_temp_s: float = 3600.0,
        name: str = "pfs",
    ) -> None:
        self.stale_temp_s = stale_temp_s
        self._host = socket.gethostname().replace(".", "-")
        super().__init__(path, capacity_bytes, fsync=fsync, o_direct=False, read_threads=read_threads, name=name)

    # -- the view -----------------------------------------------------------------------------

    def _recover(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"{self.name}: cannot use data directory {self.root}: {exc.strerror}") from exc
        self.rescan()

    def rescan(self) -> None:
        """Rebuild the view from the mount, and remove temporary files older than ``stale_temp_s``."""
        stale_before = time.time() - self.stale_temp_s
        sizes: dict[bytes, int] = {}
        for dirpath, _, files in os.walk(self.root):
            for fname in files:
                full = os.path.join(dirpath, fname)
                try:
                    st = os.stat(full)
                except OSError:
                    continue  # renamed or deleted by another daemon meanwhile
                if fname.endswith(TMP_SUFFIX):
                    if st.st_mtime < stale_before:
                        unlink_quietly(full)
                    continue
                if fname.endswith(SUFFIX):
                    try:
                        sizes[bytes.fromhex(fname[: -len(SUFFIX)])] = st.st_size
                    except ValueError:
                        continue
        with self._lock:
            self._sizes = sizes
            self._used = sum(round_up(s) for s in sizes.values())

    def _observe(self, key: bytes) -> int | None:
        """The file's size now, into the view (None, and forgotten, if there is none). Under
        the key's stripe, so that a delete or write of ours that ran after the caller looked
        at the file (a read in flight, a ``stat``) is not undone with what the caller saw:
        a deleted file counted again would hold its bytes of the budget until a rescan."""
        with self._stripe(key):
            try:
                size = os.stat(self.path_of(key)).st_size
            except FileNotFoundError:
                self._forget(key)
                return None
            except OSError as exc:
                raise self._error(exc) from exc
            self._record(key, size)
            return size

    def _saw(self, key: bytes, size: int) -> None:
        """A read found ``size`` bytes: the view learns of it unless it agrees already."""
        if self._sizes.get(key) != size:
            self._observe(key)

    def _record(self, key: bytes, size: int) -> None:
        with self._lock:
            old = self._sizes.get(key)
            if old is not None:
                self._used -= round_up(old)
            self._sizes[key] = size
            self._used += round_up(size)

    # -- writes ---------------------------------------------------------------------------------

    def _replaces_synced(self, key: bytes) -> bool:
        """Always, on a shared mount: the file a rename replaces may be another daemon's
        durable put, which this view cannot know (written after our look, or never seen)."""
        return True

    def temp_path(self, final: Path) -> Path:
        """A temporary name no other thread, process or host can pick."""
        return final.with_name(f"{final.name}.{self._host}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}")

    # -- reads ----------------------------------------------------------------------------------

    def size_of(self, key: bytes) -> int | None:
        """The view's size, or one ``stat`` of the file when the view does not know the key."""
        size = self._sizes.get(key)
        if size is not None:
            return size
        return self._observe(key)

    def contains(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    # its read_into differs from the local disk's (the file's own length, recorded): hash after it
    read_into_hashing = Tier.read_into_hashing

    def read_into(self, key: bytes, out) -> int | None:
        """Read the file into ``out`` (one buffer or a list, filled in order).

        Returns the file's real length (a truncated file reads short: the blob checks above
        this tier catch it), or None if there is no file, whatever the view said.
        """
        outs = [memoryview(o).cast("B") for o in as_buffers(out)]
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            capacity = sum(len(o) for o in outs)
            if size > capacity:
                raise ValueError(f"{self.name}: buffer of {capacity} bytes is too small for {size}")
            got = read_fully(fd, outs)
        except OSError as exc:
            raise self._error(exc) from exc
        finally:
            os.close(fd)
        self._saw(key, got)
        return got

    def read_into_device(self, key: bytes, out) -> int | None:
        """Read a value into a contiguous torch tensor's bytes; None if absent.

        A CUDA tensor is filled GPU-direct by kvikio when it is installed, else through a
        host buffer; a CPU tensor is filled directly.
        """
        import torch

        flat = out.view(-1).view(torch.uint8)
        if not flat.is_cuda:
            return self.read_into(key, memoryview(flat.numpy()))
        if kvikio is not None:
            path = self.path_of(key)
            try:
                size = os.stat(path).st_size
                if size > flat.numel():
                    raise ValueError(f"{self.name}: buffer of {flat.numel()} bytes is too small for {size}")
                with kvikio.CuFile(path, "r") as f:
                    got = f.read(flat[:size])
            except FileNotFoundError:
                self._observe(key)
                return None
            except OSError as exc:
                raise self._error(exc) from exc
            self._saw(key, got)
            return got
        host = torch.empty(flat.numel(), dtype=torch.uint8)
        got = self.read_into(key, memoryview(host.numpy()))
        if got:
            flat[:got].copy_(host[:got])
        return got

    def _open(self, key: bytes) -> int | None:
        try:
            return os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            self._observe(key)  # gone, unless a write of ours renamed a new file in meanwhile
            return None
        except OSError as exc:
            raise self._error(exc) from exc

    # -- the rest ---------------------------------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Remove the file; other daemons then miss cleanly. False if neither view nor mount
        had it. A mount that refuses the unlink (EIO, EROFS, EACCES, ...) raises, and the view
        still counts the file: before, the view forgot it first and the delete was reported
        done, the very next lookup found the chunk again, and in a cluster its budget bytes
        were freed while the file stayed."""
        with self._stripe(key):
            try:
                os.unlink(self.path_of(key))
                found = True
            except FileNotFoundError:  # gone already (another daemon's delete)
                found = False
            except OSError as exc:
                raise self._error(exc) from exc
            with self._lock:
                self._synced.discard(key)
                size = self._sizes.pop(key, None)
                if size is not None:
                    self._used -= round_up(size)
        return found or size is not None

    def keys(self) -> Iterator[bytes]:
        """Every value on the mount now, whoever wrote it (a full rescan)."""
        self.rescan()
        return super().keys()
