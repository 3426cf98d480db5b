"""Clients of the kvstore daemon with the Store's methods, so callers (the connector) can use
an in-process Store or a daemon interchangeably: ``Client`` (blocking, thread-safe) and
``AsyncClient`` (asyncio), two thin fronts of one core (kvstore/client/core.py).

Differences from Store: ``put_blob`` takes a ChunkKey (the wire names the namespace in full),
or a key id of a namespace this client has seen; ``prefetch`` returns completed futures once
the daemon has started the promotions; ``flush``/``close`` only concern this connection.
"""

from kvstore.client.aio import AsyncClient
from kvstore.client.errors import DaemonError
from kvstore.client.options import TRANSPORTS, ClientOptions
from kvstore.client.sync import Client

__all__ = ["AsyncClient", "Client", "ClientOptions", "DaemonError", "TRANSPORTS"]
