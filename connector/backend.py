"""Open the store a configuration names. Each backend is imported only when chosen, so an
engine that talks to a daemon never imports the Store, its tiers or its policies.

The default, ``auto``, fits a newcomer's machine: an in-process Store, unless its data
directory is held by another process (the daemon ``./scripts/run.sh`` starts uses the
same default directory), in which case the engine shares that daemon's store through
its Client instead of failing on the directory's lock.
"""

from __future__ import annotations

import logging
from pathlib import Path

from connector.config import ConnectorConfig, ConnectorConfigError
from kvstore.api import ChunkStore

log = logging.getLogger(__name__)


def resolve_backend(config: ConnectorConfig) -> str:
    """``config.backend``, with ``auto`` resolved to ``store`` or ``daemon``."""
    if config.backend != "auto":
        return config.backend
    holder = _directory_holder(config)
    if holder is None:
        return "store"
    _check_daemon_answers(config, holder)
    return "daemon"


def open_store(config: ConnectorConfig, backend: str | None = None) -> ChunkStore:
    """An in-process Store over ``config.store``, or a Client of the daemon at ``config.daemon``,
    as ``backend`` (resolved by ``resolve_backend``) says. Once open, an ``auto`` choice is said
    in one log line."""
    backend = backend or resolve_backend(config)
    if backend == "store":
        from kvstore.store import Store

        store = Store(config.store)
    else:
        store = _client(config)
    if config.backend == "auto":
        log.info("connector: %s (backend auto)", f"an in-process store on {config.store.disk.path}"
                 if backend == "store" else f"the daemon at {config.daemon.addr}, which holds {config.store.disk.path}")
    return store


def _client(config: ConnectorConfig):
    from kvstore.client import Client

    d = config.daemon
    return Client(d.addr, token_file=d.token_file, timeout_s=d.timeout_s, retries=d.retries, transport=d.transport)


def _directory_holder(config: ConnectorConfig) -> str | None:
    """The pid (as its lock file says) of another process holding the in-process Store's data
    directory, or None when it is free, missing or not used."""
    from tiers.files import DirectoryInUse, DirectoryLock

    if not config.store.disk.enabled or not Path(config.store.disk.path).is_dir():
        return None
    try:
        DirectoryLock(config.store.disk.path).close()
    except DirectoryInUse as exc:
        return exc.holder
    except OSError:
        return None  # unreadable: the Store says what is wrong with it
    return None


def _check_daemon_answers(config: ConnectorConfig, holder: str) -> None:
    client = _client(config)
    try:
        status, _ = client.ping()
    except Exception as exc:  # refused, timed out, TLS: any way of not answering
        status = f"no answer ({type(exc).__name__})"
    finally:
        client.close()
    if status != "SERVING":
        raise ConnectorConfigError(
            f"connector.backend auto: the data directory {config.store.disk.path} is held by pid {holder}, and the "
            f"daemon at connector.daemon.addr {config.daemon.addr} is {status}; set daemon.addr to the daemon that "
            f"holds it, or store.disk.path to a directory of the engine's own")
