"""The connector's face: everything an engine may use to load and save its KV through a store.

Shaped like vLLM's v1 KV connector, whose engine knows only ``KVConnectorBase_V1``: one
``KVConnector`` with a scheduler side (what the store can supply, load and save plans), a
worker side (the paged KV cache, loads, saves) and the store's half of agent sessions, over
any ``kvstore.api.ChunkStore``. The records it trades with the engine (its config, the step's
metadata and output, its stats, a paused session's pins, a disaggregated request's transfer),
the way to open the store a config names, and the store's lease rule for a paused session's
pins (``pin_ttl``, and ``valid_duration`` for an event's durations: one rule for the engine's
pauses and the daemon's) are here too. An engine imports nothing else
of ``connector`` (tests/engine/test_engine_connector_seam.py). See docs/connector.md.
"""

from connector.backend import open_store, resolve_backend
from connector.config import ConnectorConfig, ConnectorConfigError, DaemonBackendConfig, load_connector_config
from connector.connector import KVConnector
from connector.metadata import ConnectorMetadata, ConnectorOutput
from connector.roles import PromisedChunks, TransferParams
from connector.sessions import SessionPins
from connector.stats import ConnectorStats
from kvstore.api import pin_ttl, valid_duration

__all__ = ["ConnectorConfig", "ConnectorConfigError", "ConnectorMetadata", "ConnectorOutput", "ConnectorStats",
           "DaemonBackendConfig", "KVConnector", "PromisedChunks", "SessionPins", "TransferParams",
           "load_connector_config", "open_store", "pin_ttl", "resolve_backend", "valid_duration"]
