"""The store's configuration: one typed dataclass tree, loadable from TOML.

Sizes accept integers (bytes) or strings like ``"8GiB"``, ``"512MB"``; times are seconds.
Unknown keys and wrong types are errors that name the offending key, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like ``"8GiB"``, ``"1.5GB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number of bytes or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/s)?\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r}; use bytes or a unit like KiB, MiB, GiB, MB, GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: int) -> str:
    """Bytes for a person, in binary units: ``"1GiB"``, ``"1.5MiB"``, ``"100TiB"`` (never an exponent)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f}".rstrip("0").rstrip(".") + unit
    return f"{nbytes}B"


def default_data_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "kvstore" / "data")


@dataclass
class HostTierConfig:
    """Host RAM: a preallocated, prefaulted pool of fixed-size pages."""

    capacity_bytes: int = 1 << 30
    page_bytes: int = 256 << 10
    prefault: bool = True
    # A file under /dev/shm to back the pool (so other processes can map it); None = private memory.
    shm_path: str | None = None
    # Host RAM is our own process memory: verifying payload checksums there costs bandwidth and
    # guards only against memory corruption. Headers are always verified.
    verify_payload: bool = False
    fetch_workers: int = 1


@dataclass
class DiskTierConfig:
    """Local disk (NVMe): one file per chunk under a fan-out of directories."""

    enabled: bool = True
    path: str = field(default_factory=default_data_dir)
    capacity_bytes: int = 8 << 30
    fsync: bool = False
    # Read with O_DIRECT (true), through the page cache (false), or "auto": whichever reads
    # probe files cold faster on this device, measured with ``fetch_workers`` (once per device,
    # kept in the data directory). O_DIRECT reads land in reused buffers, so they never fault
    # in page-cache pages (on a VM whose host takes freed memory back, those faults made
    # buffered reads collapse, docs/benchmarks.md), but they never hit the page cache either:
    # chunks written behind moments ago, or read again soon, come from the device each time.
    o_direct: bool | str = False
    # Write copies with O_DIRECT (where the file system allows it): no core spent copying
    # them into the page cache, and no second copy of bytes host RAM holds already; off by
    # default, since on this VM the first read of host RAM pages after a DMA from them ran
    # slower (docs/benchmarks.md, "Disk writes").
    direct_writes: bool = False
    read_threads: int = 4
    verify_payload: bool = True
    # Cold reads in flight; 0 = as many as the device serves best, measured once per device
    # by reading probe files cold (tiers/read_probe.py) and kept in the data directory.
    fetch_workers: int = 0
    # Emulate a slower device: cap the tier's bandwidth (bytes/s, e.g. "200MB/s"); 0 = no cap.
    read_bytes_per_s: int = 0


@dataclass
class PfsTierConfig:
    """A parallel file system shared by many daemons (Lustre, GPFS, NFS, 3FS): a directory."""

    enabled: bool = False
    path: str = ""
    capacity_bytes: int = 64 << 30  # this daemon's budget against its view of the directory
    fsync: bool = False
    read_threads: int = 8
    fetch_workers: int = 4
    verify_payload: bool = True
    read_bytes_per_s: int = 0


@dataclass
class RedisTierConfig:
    """Redis (standalone or Cluster) as a shared remote tier; also hosts the shared index."""

    enabled: bool = False
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "kvs:"
    capacity_bytes: int = 4 << 30  # this daemon's budget against the values it knows of
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    max_connections: int = 16
    fetch_workers: int = 4
    verify_payload: bool = True
    read_bytes_per_s: int = 0
    reconnect_s: float = 5.0  # while Redis is unreachable, retry connecting this often


@dataclass
class GpuTierConfig:
    """Device memory on the engine's GPU; skipped with one log line where there is no CUDA."""

    enabled: bool = False
    capacity_bytes: int = 4 << 30
    page_bytes: int = 2 << 20
    device: str = "cuda"
    fetch_workers: int = 2


@dataclass
class SharedIndexConfig:
    """Which chunks exist in which shared tier, kept in Redis so every daemon sees every chunk."""

    enabled: bool = False
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "kvs:idx:"
    socket_timeout_s: float = 1.0
    reconnect_s: float = 5.0


@dataclass
class ClusterConfig:
    """Several daemons sharing the pfs and redis tiers (docs/cluster.md): each shared tier's
    ``capacity_bytes`` is then the whole cluster's budget for it, kept with the members'
    usage, heartbeats and pins in the shared index's Redis; every member configures the same."""

    enabled: bool = False
    # This daemon's name in the cluster; "" = host name and disk path, stable across restarts.
    member: str = ""
    heartbeat_s: float = 1.0
    # A member silent this long is dead: its pins stop counting and its unfinished writes go.
    member_ttl_s: float = 10.0
    # A write of a chunk another member is writing or deleting waits this long for it.
    busy_wait_s: float = 10.0
    # A dead member that holds nothing is listed this long, then forgotten.
    forget_after_s: float = 3600.0


@dataclass
class WriteBehindConfig:
    """Copies of new chunks travel to lower tiers through a bounded queue."""

    # Bytes queued for a replica tier at most (their host pages cannot be evicted meanwhile).
    # Unset: host RAM's own room bounds the queues, and puts wait only once host RAM would
    # fill with chunks whose copies are not done (a burst that fits returns at memory speed).
    # At most the host tier's capacity.
    max_pending_bytes: int | None = None  # per replica tier
    workers: int = 2
    # A tier with copies in flight that finished none for this long is stalled (a hung mount,
    # Redis): puts skip it (counted in write_behind_dropped), and the copies waiting for it
    # give their chunks' host RAM back when a put needs it. Copies queued but not yet started
    # (a put holding room while it waits, threads the machine's load keeps off a core) never
    # count: a busy tier that finishes copies is not stalled.
    stall_s: float = 10.0
    # A durable put waits this long for its copies, then raises TimeoutError (they go on).
    durable_timeout_s: float = 60.0
    # A copy waits this long after its put before a worker takes it: a burst of puts gets the
    # cores and the memory bandwidth to itself, and a chunk deleted meanwhile is never written.
    # Durable puts, flushes and a host RAM that needs the chunks' pages take copies at once.
    delay_s: float = 0.1
    # Niceness added to the copy threads (Linux, 0-19): a buffered copy costs a core while it
    # lasts, and on a machine with few cores the puts and reads beside it should get it first.
    nice: int = 19


@dataclass
class PlacementConfig:
    """Joint compression and eviction (docs/placement.md): when a tier needs room, its
    eviction victim may stay re-encoded smaller instead of leaving."""

    # On by default, and inert until a verdict file allows a lossy codec (no default
    # candidate is lossless: lz4 does not shrink fp16 KV); then the utility decides per chunk.
    enabled: bool = True
    # Private tiers whose victims may be re-encoded in place (shared tiers never are).
    tiers: list[str] = field(default_factory=lambda: ["host", "disk"])
    # Candidate codecs; a lossy one is used only where a verdict file allows it for the dtype.
    codecs: list[str] = field(default_factory=lambda: ["int8", "mixed75", "mixed50", "int4"])
    # Codec verdict files written by `kvbench probe-codec` for the served model.
    verdicts: list[str] = field(default_factory=list)
    # Lambda: seconds of load time that one percent of perplexity change costs, per use.
    quality_weight_s: float = 0.01
    # Prefill cost model: recomputing a chunk costs its tokens / this (calibrate with the engine).
    prefill_tokens_per_s: float = 20000.0
    # A tier's read bandwidth until the store has measured reads from it.
    assumed_read_bytes_per_s: int = 1_000_000_000
    # Read bandwidths to plan with instead of the measured ones (0 = measured), for a tier
    # whose reads here do not show its real speed (a page cache in front of a throttled disk).
    host_read_bytes_per_s: int = 0
    disk_read_bytes_per_s: int = 0
    pfs_read_bytes_per_s: int = 0
    redis_read_bytes_per_s: int = 0
    # Decode speed, raw bytes out per second (0 = measured on this host's CPU at the first
    # put of a shape); set it where chunks are decoded elsewhere (e.g. on the device).
    decode_bytes_per_s: int = 0
    # Copies written behind to a tier in `tiers` (not the first) get the encoding with the
    # most time saved per byte there, the put's own included, not always the put's.
    encode_on_write: bool = True


@dataclass
class ReplicationConfig:
    """Which replica tiers get a copy of a chunk (docs/placement.md, "Replication")."""

    # "all": every chunk to every replica tier. "utility": per chunk, the tiers whose copy
    # saves more load time per byte than it displaces (the planning bandwidths and prefill
    # cost model of [placement]); a chunk read again from below host RAM gains copies.
    mode: str = "all"


# The built-in codecs' names (kvstore.codecs registers these and checks this list): a config
# names one without importing the codecs, which load torch (seconds for `kvstore config` or
# `kvstore cluster`).
BUILTIN_CODECS = ("int4", "int8", "lz4", "mixed25", "mixed50", "mixed75", "raw")


def known_codecs() -> list[str]:
    """The codec registry's names once it is loaded (a program may have registered codecs of
    its own); before that, only the built-in ones can exist."""
    codecs = sys.modules.get("kvstore.codecs")
    return codecs.codec_names() if codecs is not None else sorted(BUILTIN_CODECS)


@dataclass
class StoreConfig:
    host: HostTierConfig = field(default_factory=HostTierConfig)
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    pfs: PfsTierConfig = field(default_factory=PfsTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    shared_index: SharedIndexConfig = field(default_factory=SharedIndexConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    write_behind: WriteBehindConfig = field(default_factory=WriteBehindConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    # Tiers that receive a copy of every new chunk, written behind; unset = every enabled
    # tier below host RAM. Names: gpu, disk, pfs, redis.
    replicate_to: list[str] | None = None
    eviction_policy: str = "default"
    codec: str = "raw"
    promote_on_read: bool = True
    # A chunk in flight on one tier for longer than this may be fetched from another replica.
    fetch_stall_s: float = 0.5
    # Pins last at most this long, whatever a caller asks: a forgotten pin always ends.
    max_pin_ttl_s: float = 3600.0
    # Prefetches reading or waiting at once, at most; more are not started (a miss later).
    prefetch_max_inflight: int = 256
    # The blob format puts write (docs/blob-format.md): 2 lets every copy thread hash what it
    # copies. 1 while a shared tier (pfs, redis) is still read by daemons older than format
    # 2, which take a version 2 blob for a corrupt one and delete it. Both are always read.
    blob_version: int = 2

    def validate(self) -> None:
        """Check what the types cannot: registry names and cross-field rules (ConfigError
        naming the key)."""
        from kvstore.blob import VERSIONS
        from kvstore.policies import POLICIES

        if self.blob_version not in VERSIONS:
            raise ConfigError(f"blob_version: expected one of {VERSIONS}, got {self.blob_version}")
        if self.codec not in known_codecs():
            raise ConfigError(f"codec: unknown codec {self.codec!r}; known: {known_codecs()}")
        if self.eviction_policy != "default" and self.eviction_policy not in POLICIES:
            raise ConfigError(f"eviction_policy: unknown policy {self.eviction_policy!r}; "
                              f"known: {['default', *sorted(POLICIES)]}")
        tiers = {"host", "gpu", "disk", "pfs", "redis"}
        unknown = set(self.replicate_to or ()) - tiers
        if unknown:
            raise ConfigError(f"replicate_to: unknown tiers {sorted(unknown)}; known: {sorted(tiers - {'host'})}")
        unknown = set(self.placement.tiers) - tiers
        if unknown:
            raise ConfigError(f"placement.tiers: unknown tiers {sorted(unknown)}; known: {sorted(tiers)}")
        bad = [c for c in self.placement.codecs if c not in known_codecs()]
        if bad:
            raise ConfigError(f"placement.codecs: unknown codecs {bad}; known: {known_codecs()}")
        if self.replication.mode not in ("all", "utility"):
            raise ConfigError(f"replication.mode: expected \"all\" or \"utility\", got {self.replication.mode!r}")
        for name in ("host_read_bytes_per_s", "disk_read_bytes_per_s", "pfs_read_bytes_per_s",
                     "redis_read_bytes_per_s", "decode_bytes_per_s"):
            if getattr(self.placement, name) < 0:
                raise ConfigError(f"placement.{name}: must be 0 (measured) or positive, got {getattr(self.placement, name)}")
        for path, value in (("write_behind.stall_s", self.write_behind.stall_s),
                            ("write_behind.durable_timeout_s", self.write_behind.durable_timeout_s),
                            ("max_pin_ttl_s", self.max_pin_ttl_s), ("fetch_stall_s", self.fetch_stall_s)):
            if not value > 0:
                raise ConfigError(f"{path}: must be positive, got {value}")
        if isinstance(self.disk.o_direct, str) and self.disk.o_direct != "auto":
            raise ConfigError(f'disk.o_direct: expected true, false or "auto", got {self.disk.o_direct!r}')
        if self.disk.fetch_workers < 0:
            raise ConfigError(f"disk.fetch_workers: must be 0 (measured) or positive, got {self.disk.fetch_workers}")
        if not self.write_behind.delay_s >= 0:
            raise ConfigError(f"write_behind.delay_s: must be 0 or more, got {self.write_behind.delay_s}")
        if self.write_behind.workers < 1 or self.prefetch_max_inflight < 1:
            raise ConfigError("write_behind.workers and prefetch_max_inflight must be at least 1")
        if not 0 <= self.write_behind.nice <= 19:
            raise ConfigError(f"write_behind.nice: must be 0 to 19, got {self.write_behind.nice}")
        self._validate_cluster()

    def _validate_cluster(self) -> None:
        """A cluster whose budget cannot be kept, or cannot be fair, is refused in one line."""
        c = self.cluster
        if not c.enabled:
            return
        if not self.shared_index.enabled:
            raise ConfigError("cluster.enabled: needs shared_index.enabled (the cluster's budgets, usage and pins "
                              "live in the shared index's Redis)")
        if not (self.pfs.enabled or self.redis.enabled):
            raise ConfigError("cluster.enabled: no shared tier (pfs, redis) is enabled; there is nothing to share")
        if not (c.heartbeat_s > 0 and c.member_ttl_s >= 3 * c.heartbeat_s):
            raise ConfigError(f"cluster.member_ttl_s: must be at least 3 heartbeats (3 x cluster.heartbeat_s = "
                              f"{3 * c.heartbeat_s} s), got {c.member_ttl_s}: a live member would be taken for dead")
        if not c.busy_wait_s > 0:
            raise ConfigError(f"cluster.busy_wait_s: must be positive, got {c.busy_wait_s}")


def _is_size_field(f: dataclasses.Field) -> bool:
    """Sizes (and rates) take ``"8GiB"``: every field with the word ``bytes`` in its name.
    Before, only names ending in ``_bytes`` did, and the documented
    ``max_bytes_in_flight_per_tenant = "1GiB"`` was refused at start."""
    return "bytes" in f.name.split("_")


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, path)
        elif _is_size_field(fields[name]):
            try:
                kwargs[name] = parse_size(value)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
        else:
            kwargs[name] = _check_type(value, hint, path)
    built = cls(**kwargs)
    if hasattr(built, "validate"):
        try:
            built.validate()  # registry names and cross-field rules
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}" if where else str(exc)) from None
    return built


def _check_type(value, hint, path):
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return value
        if typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            if isinstance(value, list) and all(isinstance(v, item) for v in value):
                return list(value)
            continue
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is not type(None) and isinstance(value, t) and not (t is int and isinstance(value, bool)):
            return value
    names = " or ".join(str(t) if typing.get_origin(t) else getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{path}: expected {names}, got {value!r}")


def to_toml(config) -> str:
    """A config dataclass tree as TOML that ``load_config`` reads back; unset fields are
    comments, and ``eviction_policy = "default"`` says which policy that is."""
    from kvstore.policies import DEFAULT_POLICY

    lines: list[str] = []

    def emit(obj, prefix: str) -> None:
        nested = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f.name, value))
            elif value is None:
                lines.append(f"# {f.name} is unset")
            else:
                resolved = f"  # = {DEFAULT_POLICY}" if f.name == "eviction_policy" and value == "default" else ""
                lines.append(f"{f.name} = {_toml_value(value)}{resolved}")
        for name, value in nested:
            lines.extend(["", f"[{prefix}{name}]"])
            emit(value, f"{prefix}{name}.")

    emit(config, "")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def config_from_dict(data: dict, cls=StoreConfig):
    """Build a config dataclass tree from plain data (e.g. parsed TOML)."""
    return _build(cls, data, "")


def load_config(path: str | os.PathLike, cls=StoreConfig):
    """Load a TOML file into a config dataclass tree."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return config_from_dict(data, cls)
