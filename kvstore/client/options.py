"""How a client talks to the daemon: one dataclass, loadable like the rest of the config
(``kvstore.config.load_config(path, ClientOptions)``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

TRANSPORTS = ("auto", "shm", "remote", "grpc")


@dataclass
class ClientOptions:
    token: str | None = None  # bearer token (or read it from token_file)
    token_file: str | None = None
    tls_ca: str | None = None  # CA certificate (PEM) that signed the daemon's: TLS
    tls_cert: str | None = None  # this client's certificate chain and key (PEM): mutual TLS
    tls_key: str | None = None
    timeout_s: float = 30.0  # deadline of every RPC and every bulk-socket operation
    retries: int = 4  # UNAVAILABLE (and a broken bulk connection) is retried this often, with backoff
    backoff_s: float = 0.05  # the first retry's wait; doubles each time
    # "auto": shm, else bulk, else grpc; "shm" or "remote" (bulk, else grpc) or "grpc" force one
    transport: str = "auto"
    shm_slots: int = 8
    piece_bytes: int = 4 << 20  # inline gRPC pieces
    socket_buffer_bytes: int = 4 << 20
    # Keep chunk-sized blocks in this process's heap (kvstore/wire/malloc.py): without it every
    # chunk buffer ``get`` allocates faults in all its pages, which costs more than receiving it.
    tune_malloc: bool = True
    copy_threads: int = 4  # AsyncClient: threads for copies into and out of shared memory
    # The blob format puts write (docs/blob-format.md); 1 for a daemon older than format 2
    blob_version: int = 2

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if (self.tls_cert or self.tls_key) and not self.tls_ca:
            raise ValueError("a client certificate needs tls_ca (mutual TLS)")
        from kvstore.blob import VERSIONS

        if self.blob_version not in VERSIONS:
            raise ValueError(f"blob_version must be one of {VERSIONS}, got {self.blob_version}")
        for name in ("timeout_s", "piece_bytes", "shm_slots", "copy_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def merged(cls, options: "ClientOptions | None", overrides: dict) -> "ClientOptions":
        """``options`` (or the defaults) with ``overrides`` (field names) applied."""
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown client option(s) {sorted(unknown)}; known: {sorted(known)}")
        return replace(options or cls(), **overrides)
