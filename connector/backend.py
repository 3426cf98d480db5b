"""Open the store a configuration names. Each backend is imported only when chosen, so an
engine that talks to a daemon never imports the Store, its tiers or its policies."""

from __future__ import annotations

from connector.config import ConnectorConfig
from kvstore.api import ChunkStore


def open_store(config: ConnectorConfig) -> ChunkStore:
    """An in-process Store over ``config.store``, or a Client of the daemon at ``config.daemon``."""
    if config.backend == "store":
        from kvstore.store import Store

        return Store(config.store)
    from kvstore.client import Client

    d = config.daemon
    return Client(d.addr, token_file=d.token_file, timeout_s=d.timeout_s, retries=d.retries, transport=d.transport)
