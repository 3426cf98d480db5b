"""The connector's configuration: one typed dataclass tree, loadable from TOML like the
store's (``load_connector_config(path)``; the ``[store]`` table is a full ``StoreConfig``).
Mistakes are one-line ``ConnectorConfigError``s at start, naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvstore.config import ConfigError, StoreConfig, load_config

BACKENDS = ("auto", "store", "daemon")
LOAD_MODES = ("sync", "async", "layerwise")
TRANSPORTS = ("auto", "shm", "remote")
ROLES = ("both", "producer", "consumer")
IMPORTANCE = ("keynorm", "recency", "attention")


class ConnectorConfigError(ConfigError):
    """The connector's configuration is invalid; the message is one line naming the key."""


@dataclass
class DaemonBackendConfig:
    """The sidecar daemon (``kvstore serve``) as the store."""

    addr: str = "127.0.0.1:50051"
    # auto: shared memory when the daemon runs on this host, else the remote (bulk TCP) path
    transport: str = "auto"
    token_file: str | None = None
    # Per RPC; with ``retries`` it bounds how long a dead daemon can hold a step.
    timeout_s: float = 5.0
    retries: int = 1


@dataclass
class TransferConfig:
    """Prefill-decode disaggregation (docs/disaggregation.md): how a producer sends a prompt's
    chunks and how long a consumer waits for them."""

    # The producer's codec for prompt chunks: "raw" (exact) or a lossy one the probe allows.
    codec: str = "raw"
    # How a mixed codec ranks a chunk's rows: "keynorm" (the codec's own), "recency" (later first),
    # "attention" (the attention the prompt's last ``observe_tokens`` queries pay each token, per
    # layer, exported by the prefill; the prompt's chunks are then put once its prefill is done).
    importance: str = "keynorm"
    observe_tokens: int = 32
    sink_tokens: int = 4  # a prompt's first tokens, kept at full precision by mixed codecs
    wait_s: float = 10.0  # consumer: promised chunks not visible in this long are recomputed
    poll_s: float = 0.01  # consumer: how often it looks for them meanwhile

    @property
    def ranks_by_attention(self) -> bool:
        """Whether the producer ranks tokens by the prefill's attention (a mixed codec with
        ``importance = "attention"``): it then observes it, and puts a prompt's chunks at its end."""
        if self.importance != "attention" or self.codec == "raw":
            return False
        from kvstore.codecs import get_codec
        from kvstore.codecs.mixed import MixedPrecisionCodec

        return isinstance(get_codec(self.codec), MixedPrecisionCodec)

    def check(self) -> None:
        if self.importance not in IMPORTANCE:
            raise ConnectorConfigError(f"connector.transfer.importance: unknown value {self.importance!r}; "
                                       f"known: {', '.join(IMPORTANCE)}")
        if self.codec != "raw":
            from kvstore.codecs import codec_names

            if self.codec not in codec_names():
                raise ConnectorConfigError(f"connector.transfer.codec: unknown codec {self.codec!r}; "
                                           f"known: {', '.join(codec_names())}")
        for name in ("wait_s", "poll_s", "observe_tokens"):
            if getattr(self, name) <= 0:
                raise ConnectorConfigError(f"connector.transfer.{name} must be positive, got {getattr(self, name)}")
        if self.sink_tokens < 0:
            raise ConnectorConfigError(f"connector.transfer.sink_tokens must not be negative, got {self.sink_tokens}")


@dataclass
class ConnectorConfig:
    # "store": an in-process Store; "daemon": the daemon's Client; "auto": the Store, unless another
    # process (the daemon on the same default directory) holds its data directory: then the daemon
    backend: str = "auto"
    store: StoreConfig = field(default_factory=StoreConfig)
    daemon: DaemonBackendConfig = field(default_factory=DaemonBackendConfig)
    # Tokens per store chunk, a multiple of the engine's block size (checked at start).
    chunk_tokens: int = 256
    # sync: loads finish inside the step that admits the request; async: the request waits
    # (WAITING_FOR_KV) while others run; layerwise: layer i is scattered while layer i-1 computes.
    load_mode: str = "sync"
    # A load not done in this long is given up: its request recomputes from the first missing chunk.
    load_timeout_s: float = 10.0
    load_workers: int = 2  # threads reading chunks and scattering them into the paged cache
    chunks_per_read: int = 2  # chunks per store read call (one round trip through a daemon)
    staging_chunks: int = 16  # idle chunk buffers kept for reuse (fresh ones fault in every page)
    save: bool = True  # False: only load (a consumer that never writes the store)
    # Save each prompt's tail (its full blocks past its last full chunk, as one zero-padded
    # chunk) once its prefill is done, so a hit recomputes at most a block, not a chunk.
    prompt_tails: bool = True
    # Chunks gathered and waiting for their put; 0: two engine steps' worth (a step gathers
    # every chunk its forward completed at once, so a prompt is never cut while the store keeps
    # up). Past this the store is pushing back and new saves are dropped (counted, and logged
    # once): a dropped save is a future miss, never a wrong load.
    max_pending_saves: int = 0
    pin_ttl_s: float = 30.0  # lease on looked-up chunks until they are loaded (bounds any leak)
    # After a store failure the connector is off (no lookups, loads or saves) this long.
    unavailable_backoff_s: float = 30.0
    model_id: str = ""  # "" = the engine's fingerprint of its weights
    tenant: str = ""  # a salt in the namespace: tenants never share chunks
    # both: load and save; producer (prefill): every full prompt chunk saved durably, with the
    # transfer codec; consumer (decode): loads, never saves (docs/disaggregation.md).
    role: str = "both"
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        for name, value, known in (("backend", self.backend, BACKENDS), ("load_mode", self.load_mode, LOAD_MODES),
                                   ("daemon.transport", self.daemon.transport, TRANSPORTS),
                                   ("role", self.role, ROLES)):
            if value not in known:
                raise ConnectorConfigError(f"connector.{name}: unknown value {value!r}; known: {', '.join(known)}")
        for name in ("chunk_tokens", "load_workers", "chunks_per_read", "load_timeout_s",
                     "pin_ttl_s", "unavailable_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConnectorConfigError(f"connector.{name} must be positive, got {getattr(self, name)}")
        for name in ("staging_chunks", "max_pending_saves"):
            if getattr(self, name) < 0:
                raise ConnectorConfigError(f"connector.{name} must not be negative, got {getattr(self, name)}")
        self.transfer.check()

    @property
    def store_host_bytes(self) -> int:
        """Host RAM of the in-process Store this config builds (``backend = "store"``)."""
        return self.store.host.capacity_bytes

    @property
    def saves(self) -> bool:
        """Whether this engine writes the store: a consumer never saves a producer's chunks."""
        return self.save and self.role != "consumer"

    def check_block_size(self, block_size: int) -> None:
        """A chunk is a whole number of engine blocks, or chunks and blocks cannot line up."""
        if self.chunk_tokens % block_size:
            raise ConnectorConfigError(f"connector.chunk_tokens {self.chunk_tokens} is not a multiple of the "
                                       f"engine block size {block_size}")


def load_connector_config(path: str | os.PathLike) -> ConnectorConfig:
    """A ``ConnectorConfig`` from a TOML file, read as the store reads its own."""
    return load_config(path, ConnectorConfig)
