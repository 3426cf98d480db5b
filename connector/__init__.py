"""The engine-facing API to the store, shaped like vLLM's v1 KV connector: a scheduler side
(what the store can supply, load and save plans) and a worker side (the paged KV cache,
loads, saves) over any ``kvstore.api.ChunkStore``. See docs/connector.md."""

from connector.config import ConnectorConfig, ConnectorConfigError, DaemonBackendConfig
from connector.connector import KVConnector
from connector.stats import ConnectorStats

__all__ = ["ConnectorConfig", "ConnectorConfigError", "ConnectorStats", "DaemonBackendConfig", "KVConnector"]
