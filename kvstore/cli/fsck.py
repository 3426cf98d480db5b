"""Offline verification of a disk tier's data directory: every blob's header and payload.

Used by ``kvstore fsck``; the store itself verifies lazily on read, this checks everything
at once (e.g. after a crash or a disk error) and can remove what is bad. A repair holds the
data directory's lock (tiers/files.py) while it runs: a temporary file in a directory a live
daemon or Store holds is that process's write in flight, not a crash leftover, so a repair
of such a directory is refused (``DirectoryInUse``). A check only reads, and runs beside a
live daemon (a file deleted while it runs is skipped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.blob import CorruptBlob, verify_blob
from tiers.files import SUFFIX, TMP_SUFFIX, DirectoryInUse, DirectoryLock


@dataclass
class FsckReport:
    blobs: int = 0
    bytes: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    temporary: list[str] = field(default_factory=list)
    removed: int = 0


def fsck(data_dir: str | os.PathLike, repair: bool = False) -> FsckReport:
    """Verify every blob under ``data_dir``; with ``repair``, delete corrupt and temporary files."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory {root} does not exist")
    if not repair:
        return _walk(root, repair)
    try:
        lock = DirectoryLock(root)
    except DirectoryInUse as exc:
        raise DirectoryInUse(f"{exc}. Stop it before repairing its directory (a check without --repair "
                             "runs beside it)") from None
    try:
        return _walk(root, repair)
    finally:
        lock.close()


def _walk(root: Path, repair: bool) -> FsckReport:
    report = FsckReport()
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith(TMP_SUFFIX):
                report.temporary.append(path)
                bad = True
            elif name.endswith(SUFFIX):
                report.blobs += 1
                bad = _check(path, name, report)
            else:
                continue
            if bad and repair:
                os.unlink(path)
                report.removed += 1
    return report


def _check(path: str, name: str, report: FsckReport) -> bool:
    try:
        data = Path(path).read_bytes()
        report.bytes += len(data)
        header, _ = verify_blob(data)
        if header.key_id.hex() != name[: -len(SUFFIX)]:
            raise CorruptBlob("file name does not match the key in its header")
    except FileNotFoundError:
        report.blobs -= 1  # deleted since the walk listed it (a live daemon's delete or eviction)
        return False
    except (CorruptBlob, OSError) as exc:
        report.corrupt.append((path, str(exc)))
        return True
    return False
