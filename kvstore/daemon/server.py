"""The daemon process: one Store behind a grpc.aio server, plus the health and reflection
services, the shared-memory slot arena, the bulk channel and the metrics endpoint.

Start-up refuses, in one line (``StartupError``), what it cannot serve safely: no credentials
on an address other than loopback, a data directory another process holds. A start that
fails removes what it created (its /dev/shm files included).

Shutdown (SIGTERM/SIGINT): health turns NOT_SERVING, the server stops accepting and gives
in-flight RPCs ``shutdown_grace_s``, then the Store flushes its write-behind queues and
closes its tiers, so every chunk acknowledged as durable, and every queued copy, is on disk.
A flush that takes longer than ``flush_timeout_s`` (a stalled disk) is abandoned with an
error and exit code 1, so shutdown is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import ipaddress
import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.config import ConfigError, StoreConfig, format_size
from kvstore.daemon.auth import TokenAuth
from kvstore.daemon.buffers import BufferPool
from kvstore.daemon.bulk import BulkServer
from kvstore.daemon.config import DaemonConfig, io_workers
from kvstore.daemon.identity import Credentials
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.quotas import DISK, HOST, Quotas
from kvstore.daemon.service import KVStoreService, register
from kvstore.daemon.shmfiles import POOL, SharedFile, remove_orphans
from kvstore.daemon.slots import SlotArena
from kvstore.store.quota import ReplicaUsage
from kvstore.store import Store
from kvstore.store.tier_setup import check_host_capacity
from kvstore.wire.convert import split_host_port
from tiers.base import TierUnavailable

log = logging.getLogger("kvstore.daemon")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name

# RPCs grpc admits beyond the daemon's own KVStore budget (kvstore/daemon/fair_share.py): the
# health and reflection services, which it does not count and an orchestrator's probe needs
# answered whatever tenants do, and KVStore RPCs while the budget refuses them.
HEALTH_ROOM = 32


class StartupError(Exception):
    """The daemon cannot start as configured; the message says why, in one line."""


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _credentials(cfg: DaemonConfig, host: str) -> Credentials:
    if cfg.auth_token_file and cfg.tenants_file:
        raise StartupError("auth_token_file and tenants_file exclude each other: choose one")
    if cfg.tenants_file:
        return Credentials.from_file(cfg.tenants_file)
    if cfg.auth_token_file:
        return Credentials.single_token(cfg.auth_token_file)
    if not _loopback(host) and cfg.tls_client_ca is None:
        raise StartupError(f"refusing to serve {host} without authentication: every caller would be one "
                           "tenant; set auth_token_file or tenants_file, or listen on loopback")
    return Credentials.none()


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.address = ""
        self.store: Store | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.arena: SlotArena | None = None
        self.bulk: BulkServer | None = None
        self.metrics: DaemonMetrics | None = None
        self._executor = ThreadPoolExecutor(io_workers(config), thread_name_prefix="daemon-io")
        self.pool = BufferPool(config.idle_buffer_bytes)
        self._expiry: asyncio.Task | None = None
        self._pool_file: SharedFile | None = None  # the shared host pool's file, locked while we live

    async def start(self) -> None:
        cfg = self.config
        try:
            cfg.validate()
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        host, port = split_host_port(cfg.listen)
        credentials = _credentials(cfg, host)
        tls = self._tls()
        loop = asyncio.get_running_loop()
        # before the host pool takes its room; said once started (a failed start says one line)
        orphans = remove_orphans(cfg.shm.dir) if cfg.shm.enabled else 0
        usage = ReplicaUsage([HOST, DISK])
        try:
            self.store = await loop.run_in_executor(self._executor, functools.partial(
                Store, self._store_config(), usage=usage))
        except TierUnavailable as exc:  # e.g. the data directory is another daemon's
            raise StartupError(str(exc)) from None
        if cfg.shm.enabled:
            s = cfg.shm
            self.arena = SlotArena(s.dir, s.slots, s.slot_bytes, s.lease_ttl_s, s.max_slots_per_lease)
        if cfg.bulk.enabled and tls is None:  # the bulk channel is not encrypted
            self.bulk = BulkServer(host, cfg.bulk, cfg.limits.max_chunk_bytes, self.pool)
        quotas = Quotas(self.store, usage, credentials.all_tenants)
        self.metrics = DaemonMetrics(self.store.stats, self._gauges, {t.label: functools.partial(quotas.used, t)
                                                                     for t in credentials.all_tenants})
        options = [
            ("grpc.max_send_message_length", cfg.limits.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.limits.max_message_bytes),
            ("grpc.max_concurrent_streams", cfg.limits.max_concurrent_streams),
            ("grpc.max_allowed_incoming_connections", cfg.limits.max_connections),
            ("grpc.server_handshake_timeout_ms", int(cfg.limits.handshake_timeout_s * 1000)),
            ("grpc.so_reuseport", 0),
        ]
        self._server = grpc.aio.server(
            interceptors=[TokenAuth(credentials)] if credentials.authenticated and cfg.tls_client_ca is None else None,
            options=options,
            maximum_concurrent_rpcs=cfg.limits.max_concurrent_streams + HEALTH_ROOM,
        )
        self.service = KVStoreService(self.store, cfg, self._executor, self.arena, self.bulk, self.metrics,
                                      self.pool, credentials, quotas)
        register(self.service, self._server)
        metrics_at = self._serve_metrics()  # before the gRPC port: a start that fails binds nothing
        if self.bulk is not None:
            self.bulk.start(self.service.bulk_request, self.service.bulk_admit)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = self._server.add_secure_port(target, tls) if tls else self._server.add_insecure_port(target)
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.service.address = self.address
        if self.store.cluster is not None:  # the other members and `kvstore cluster` see where it serves
            self.store.cluster.advertise(self.address)
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.arena is not None:
            self._expiry = loop.create_task(self._expire_leases())
        if orphans:
            log.info("removed %d shared-memory file(s) of daemons that are gone", orphans)
        tiers = ", ".join(f"{t.name} {format_size(t.capacity_bytes)}" for t in self.store.tiers)
        log.info("kvstore daemon listening on %s (tiers: %s; shm %s; bulk %s; metrics %s; auth %s; tls %s)",
                 self.address, tiers,
                 f"{self.arena.slots}x{format_size(self.arena.slot_bytes)}"
                 f"{' + host pool' if self.service.pool_path else ''}" if self.arena else "off",
                 f"port {self.bulk.port}" if self.bulk else "off", metrics_at, credentials.mode,
                 ("on, client certificates required" if cfg.tls_client_ca else "on") if tls else "off")

    def _serve_metrics(self) -> str:
        """Start the Prometheus endpoint if configured; returns where it listens, or "off"."""
        if not self.config.metrics:
            return "off (--metrics 127.0.0.1:9400 serves Prometheus text at /metrics)"
        host, port = split_host_port(self.config.metrics)
        try:
            return f"{host}:{self.metrics.serve(host, port)}"
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {self.config.metrics}: {exc.strerror or exc}") from None

    def _tls(self) -> grpc.ServerCredentials | None:
        cfg = self.config
        if not (cfg.tls_cert or cfg.tls_key):
            if cfg.tls_client_ca:
                raise StartupError("tls_client_ca needs tls_cert and tls_key")
            return None
        if not (cfg.tls_cert and cfg.tls_key):
            raise StartupError("TLS needs both a certificate and a key")
        pair = [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())]
        if cfg.tls_client_ca is None:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(pair, root_certificates=Path(cfg.tls_client_ca).read_bytes(),
                                           require_client_auth=True)

    def _store_config(self) -> StoreConfig:
        """The store's config, with the host pool in a shared file when same-host clients
        may read from it (``shm.share_host_pool``) and the shm directory has room for it.
        The file is created (and locked) here, so it is known to be ours and live."""
        cfg = self.config
        host = cfg.store.host
        check_host_capacity(host.capacity_bytes)
        if host.shm_path is not None:  # configured: ours only while no live daemon holds it
            try:
                self._pool_file = SharedFile.claim(host.shm_path)
            except BlockingIOError:
                raise StartupError(f"store.host.shm_path {host.shm_path} is the host pool of another "
                                   "daemon that is running") from None
            return cfg.store
        if not (cfg.shm.enabled and cfg.shm.share_host_pool):
            return cfg.store
        free = os.statvfs(cfg.shm.dir)
        if free.f_bavail * free.f_frsize < host.capacity_bytes * 1.05 + (64 << 20):
            log.warning("%s has too little room for the %s host pool: clients copy out of slots instead",
                        cfg.shm.dir, format_size(host.capacity_bytes))
            return cfg.store
        self._pool_file = SharedFile(cfg.shm.dir, POOL)
        return dataclasses.replace(cfg.store, host=dataclasses.replace(host, shm_path=self._pool_file.path))

    def _gauges(self) -> dict[str, int]:
        return {
            "io_inflight": self.service.io_inflight,
            "prefetches_running": self.service.prefetches.running,
            "shm_slots_free": self.arena.free_slots if self.arena else 0,
            "bulk_sessions": self.bulk.sessions if self.bulk else 0,
        }

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.arena.lease_ttl_s / 4))
            if n := self.arena.expire():
                log.info("reclaimed %d expired shared-memory lease(s)", n)

    async def stop(self) -> None:
        """Stop accepting, let in-flight RPCs finish (bounded), flush and close the Store.
        Quiet when start failed (the caller reports that error in one line)."""
        say = log.info if self.address else log.debug
        say("shutting down: finishing in-flight requests (up to %.1f s)", self.config.shutdown_grace_s)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        grace = self.config.shutdown_grace_s
        stopping = [self._server.stop(grace)] if self._server is not None else []
        if self.bulk is not None:
            stopping.append(self.bulk.close(grace))
        await asyncio.gather(*stopping)
        if self._expiry is not None:
            self._expiry.cancel()
        await asyncio.to_thread(self._executor.shutdown, True)  # Store calls of cancelled RPCs finish
        if self.bulk is not None:  # nothing writes into the host pool now: pool views may go
            self.bulk.release_pins()
        if self.store is not None:
            pending = self.store.stats().write_behind_pending_bytes
            say("flushing %d bytes of write-behind, closing tiers", pending)
            closer = threading.Thread(target=self.store.close, name="store-close", daemon=True)
            closer.start()
            await asyncio.to_thread(closer.join, self.config.flush_timeout_s)
            if closer.is_alive():  # a stalled disk: do not hang forever
                left = self.store.stats().write_behind_pending_bytes
                log.error("write-behind not flushed after %.0f s (%d bytes unwritten); exiting anyway",
                          self.config.flush_timeout_s, left)
                self._remove_shared_files()  # before, they stayed in /dev/shm (the pool as large as host RAM)
                logging.shutdown()
                os._exit(1)
        self._remove_shared_files()
        if self.metrics is not None:
            self.metrics.close()
        say("stopped")


    def _remove_shared_files(self) -> None:
        """Remove the slot arena and the host pool file from /dev/shm. The Store's close thread
        may still write into the pool's mapping when the flush was given up: the file's name
        goes, its mapping stays valid until the process exits."""
        if self.arena is not None:
            self.arena.close()
        if self._pool_file is not None:
            self._pool_file.close()


async def serve(config: DaemonConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            log.info("already shutting down")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    daemon = Daemon(config)
    try:
        await daemon.start()
        _freeze_startup_objects()
        await stop.wait()
    finally:
        await daemon.stop()


def _freeze_startup_objects() -> None:
    """Take what the daemon holds once started (its imports, torch's most of all, and the index
    of recovered chunks) out of the cyclic garbage collector's full passes. Each full pass
    walked all of it: under a tenant that allocates fast (a flood of many-key requests) one
    ran every few seconds and stopped the daemon for ~54 ms, every tenant's requests with it;
    after this it took ~0.4 ms. Reference counting still frees these objects; only a cycle
    among them that became garbage would stay: the daemon's parts live as long as it does,
    and the index's entries hold no cycles."""
    gc.freeze()
    log.info("took %d startup objects out of the cyclic garbage collector", gc.get_freeze_count())
