"""The daemon's configuration: one typed dataclass tree (the Store's config is a subtree).

Load it from TOML with ``kvstore.config.load_config(path, DaemonConfig)``; ``kvstore serve``
flags override single fields.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

from kvstore.config import ConfigError, StoreConfig


def _at_least(obj, minimum, *names: str) -> None:
    """Refuse, naming the key, a field of ``obj`` below ``minimum`` (or not finite)."""
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value >= minimum):
            raise ConfigError(f"{name}: must be at least {minimum}, got {value}")


def _positive(obj, *names: str) -> None:
    """Refuse, naming the key, a time of ``obj`` that is not a positive number of seconds."""
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name}: must be a positive number of seconds, got {value}")


@dataclass
class ShmConfig:
    """Shared-memory slot arena for same-host clients (a file under /dev/shm)."""

    enabled: bool = True
    dir: str = "/dev/shm"
    slots: int = 64
    slot_bytes: int = 8 << 20
    # A lease not renewed or used for this long is reclaimed (the client died).
    lease_ttl_s: float = 30.0
    max_slots_per_lease: int = 16
    # Put the host tier's pool in a file under ``dir`` too, so same-host clients copy chunks
    # straight out of it (one copy per Get instead of two). It gives those clients (same uid:
    # the files are 0600) nothing the slot arena does not: they can read any slot already.
    share_host_pool: bool = True

    def validate(self) -> None:
        _at_least(self, 1, "slots", "max_slots_per_lease")
        if self.slot_bytes <= 0 or self.slot_bytes % mmap.PAGESIZE:
            raise ConfigError(f"slot_bytes: must be a positive multiple of {mmap.PAGESIZE}, got {self.slot_bytes}")
        _positive(self, "lease_ttl_s")


@dataclass
class BulkConfig:
    """Plain TCP channel for Gets and Puts (off when TLS is on: it is not encrypted)."""

    enabled: bool = True
    port: int = 0  # 0 = any free port, advertised through BulkAttach
    # Sessions, attached or with a token not presented yet: daemon-wide and per tenant (so
    # a tenant attaching in a loop runs out of its own share, not of other tenants').
    max_sessions: int = 256
    max_sessions_per_tenant: int = 64
    # How long a Put waits for its bulk frame, and a reply frame for its reader.
    frame_timeout_s: float = 30.0
    socket_buffer_bytes: int = 4 << 20
    # Connections that have not presented a session token yet: at most this many at once
    # (newer ones are closed at once), each for at most hello_timeout_s; a token not
    # presented within 2 x hello_timeout_s of its BulkAttach is void.
    max_unauthenticated: int = 64
    hello_timeout_s: float = 3.0
    # Host-pool pages a Get pins for a client that copies them out itself (pool views) are
    # released on RELEASE, or after this long at the latest (the connection is then cut off),
    # and a channel pins at most max_pinned_bytes at once (further chunks go into slots, or
    # without slots over the socket).
    pin_ttl_s: float = 30.0
    max_pinned_bytes: int = 256 << 20
    # Bytes of request frames (meta and data) all bulk sessions hold at once, counted when a
    # frame announces its size, before any buffer is taken; a tenant past its share of them
    # (this divided among the tenants) is refused while less than a quarter is free.
    max_receive_bytes: int = 1 << 30
    # TCP keepalive: a peer that vanished without a FIN is noticed after about
    # keepalive_idle_s + 3 * keepalive_interval_s.
    keepalive_idle_s: int = 10
    keepalive_interval_s: int = 5

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be 0 (any free port) to 65535, got {self.port}")
        _at_least(self, 1, "max_sessions", "max_sessions_per_tenant", "max_unauthenticated", "max_receive_bytes",
                  "keepalive_idle_s", "keepalive_interval_s")
        _positive(self, "frame_timeout_s", "hello_timeout_s", "pin_ttl_s")


@dataclass
class LimitsConfig:
    max_chunk_bytes: int = 64 << 20
    max_keys_per_request: int = 4096
    # Keys per second one tenant's requests may name (every RPC that names keys: Lookup,
    # Contains, Get, Prefetch, Pin, PinLeading, Unpin, Pause, Delete; ResumeSoon's recorded keys), after
    # a burst of a quarter of a second of them (one max_keys_per_request at least); past it a
    # request waits up to a second, then is refused. Each key costs ~1 us of the daemon's
    # interpreter; an engine names a few thousand a second (kvstore/daemon/key_rate.py).
    max_keys_per_s_per_tenant: int = 65536
    # KVStore RPCs at once, counted from the moment each opens (kvstore/daemon/rpc_budget.py):
    # a tenant at its share of them (this divided among the tenants) gets more only while
    # more than reserved_streams stay free. The health service is not counted.
    max_concurrent_streams: int = 256
    reserved_streams: int = 64
    # How long a Put stream may wait for each of its messages, the first one included (an
    # idle stream holds one of its tenant's requests and of the RPC budget).
    stream_idle_timeout_s: float = 10.0
    # TCP connections to the gRPC port at once (grpc refuses more before any handshake), and
    # how long a new one may take to complete its handshake.
    max_connections: int = 1024
    handshake_timeout_s: float = 5.0
    # Largest gRPC message either way (inline pieces are smaller than this).
    max_message_bytes: int = 16 << 20
    inline_piece_bytes: int = 4 << 20
    # Smallest piece of a chunk a gRPC Get may ask for (GetRequest.piece_bytes), and a Put
    # stream may send but as its last: each message costs the daemon ~1 ms of event-loop
    # time, and 1-byte pieces took 16.7 s of it for one 64 KiB chunk.
    min_piece_bytes: int = 64 << 10
    # Chunks of one Get read at once (in executor threads) while earlier ones travel.
    get_read_ahead: int = 3
    # Per tenant (every caller with one credential): requests being served at once, and the
    # chunk bytes they hold (puts' blobs, gets' read-ahead); beyond either a request is shed
    # at once with RESOURCE_EXHAUSTED.
    max_requests_per_tenant: int = 128
    max_bytes_in_flight_per_tenant: int = 1 << 30
    # Promotions started by Prefetch and not finished yet: daemon-wide and per tenant (a key
    # already being promoted is not started again).
    max_prefetches: int = 256
    max_prefetches_per_tenant: int = 64
    max_pin_ttl_s: float = 600.0
    max_model_id_bytes: int = 256
    # Paused agent sessions remembered per tenant (Pause / ResumeSoon), and a session id's length.
    max_paused_sessions_per_tenant: int = 4096
    max_paused_namespaces_per_session: int = 64
    # Keys all of a tenant's paused-session records hold (~170 B each); past it the records
    # expiring first go. At least max_keys_per_request, so one Pause is always recorded whole.
    max_paused_keys_per_tenant: int = 262144
    max_session_id_bytes: int = 256
    # Daemon time shared among tenants by their recent use of it (kvstore/daemon/tenant_scheduler.py):
    # a tenant's use (CPU time of its work) halves every scheduler_half_life_s; while another
    # tenant is active (work in flight, or done less than scheduler_idle_s ago), a tenant over
    # its share of the active tenants' use, or that used more than a tenant whose work waits,
    # waits before its next piece of work, at most scheduler_max_wait_s each time (0: never).
    # A tenant alone never waits, and nothing is refused for it.
    scheduler_half_life_s: float = 0.25
    scheduler_idle_s: float = 0.05
    scheduler_max_wait_s: float = 0.5

    def validate(self) -> None:
        _at_least(self, 1, "max_chunk_bytes", "max_keys_per_request", "max_keys_per_s_per_tenant",
                  "max_concurrent_streams", "max_connections", "inline_piece_bytes", "get_read_ahead",
                  "max_requests_per_tenant", "max_model_id_bytes", "max_session_id_bytes")
        _at_least(self, 0, "max_prefetches", "max_prefetches_per_tenant", "max_paused_sessions_per_tenant",
                  "max_paused_namespaces_per_session")
        if self.max_message_bytes <= 1024:  # a Get's pieces are this less 1 KiB
            raise ConfigError(f"max_message_bytes: must be more than 1024, got {self.max_message_bytes}")
        _positive(self, "handshake_timeout_s", "max_pin_ttl_s", "stream_idle_timeout_s", "scheduler_half_life_s",
                  "scheduler_idle_s")
        _at_least(self, 0, "scheduler_max_wait_s")
        if self.max_paused_keys_per_tenant < self.max_keys_per_request:
            raise ConfigError(f"max_paused_keys_per_tenant: must be at least max_keys_per_request "
                              f"({self.max_keys_per_request}), got {self.max_paused_keys_per_tenant}")
        if not 1 <= self.min_piece_bytes <= self.inline_piece_bytes:
            raise ConfigError(f"min_piece_bytes: must be 1 to inline_piece_bytes ({self.inline_piece_bytes}), "
                              f"got {self.min_piece_bytes}")
        if not 0 <= self.reserved_streams < self.max_concurrent_streams:
            raise ConfigError(f"reserved_streams: must be at least 0 and below max_concurrent_streams "
                              f"({self.max_concurrent_streams}), got {self.reserved_streams}")


def io_workers(config: DaemonConfig) -> int:
    """Threads of the daemon's executor for Store calls (two at least)."""
    return max(2, config.io_threads)


@dataclass
class DaemonConfig:
    listen: str = "127.0.0.1:50051"
    metrics: str | None = None  # HOST:PORT of the Prometheus endpoint; None = off
    # Who a caller is (docs/daemon.md, "Tenants"): one bearer token for a single tenant, or a
    # tenants file mapping tokens (and client-certificate names) to tenants. Neither: no
    # authentication, allowed on a loopback address only.
    auth_token_file: str | None = None
    tenants_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # CA bundle (PEM) of client certificates: mutual TLS, every client must present one.
    tls_client_ca: str | None = None
    # Threads for Store calls (file I/O, copies): bounds how much blocking work runs at once.
    io_threads: int = 8
    # Chunk-sized buffers kept for reuse between requests (fresh ones fault in every page).
    idle_buffer_bytes: int = 256 << 20
    # SIGTERM/SIGINT: in-flight RPCs get this long, then write-behind is flushed.
    shutdown_grace_s: float = 10.0
    # ... and then the write-behind queues get this long to reach the disk before we give up.
    flush_timeout_s: float = 120.0
    shm: ShmConfig = field(default_factory=ShmConfig)
    bulk: BulkConfig = field(default_factory=BulkConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def validate(self) -> None:
        """Values no daemon can serve with, refused naming the key (load_config calls it on
        every table; ``Daemon.start`` again, for configs built in code or changed by flags)."""
        _at_least(self, 0, "io_threads", "shutdown_grace_s")
        _positive(self, "flush_timeout_s")
        for name in ("shm", "bulk", "limits", "store"):
            try:
                getattr(self, name).validate()
            except ConfigError as exc:
                raise ConfigError(f"{name}.{exc}") from None
