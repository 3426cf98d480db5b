"""The engine reaches the store only through the connector package's face.

As vLLM's engine knows only ``KVConnectorBase_V1``, our engine may import from ``connector``
only what ``connector/__init__.py`` exports, never a connector module (``connector.worker``,
``connector.sessions``, ...), nor the store's insides the face stands for (``kvstore.store``,
``kvstore.daemon`` with its session book, ``kvstore.cluster``, ``kvstore.config``); and it may not reach through the ``KVConnector`` to its parts
(``connector.store``, ``connector.scheduler``, ``connector.worker``, ``connector.availability``,
used or only named: an alias would hide the use). Checked on the source with ``ast``, so a new engine module is
covered without being listed. A config's ``connector`` field is the ``ConnectorConfig``, not
the connector: ``config.connector.store`` (the Store's configuration) is allowed."""

import ast
from pathlib import Path

import connector

ENGINE = Path(__file__).resolve().parents[2] / "engine"
STORE_INSIDES = ("kvstore.store", "kvstore.daemon", "kvstore.cluster", "kvstore.config")
CONNECTOR_PARTS = {"store", "scheduler", "worker", "availability"}
CONNECTOR_NAMES = {"connector", "conn"}  # what the engine calls a KVConnector
CONFIG_NAMES = {"cfg", "config"}  # what the engine calls an EngineConfig


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _reaches_through(node: ast.Attribute) -> bool:
    """``<connector>.<part>``, where ``<connector>`` is not a config's field."""
    owner = node.value
    if node.attr not in CONNECTOR_PARTS or _name(owner) not in CONNECTOR_NAMES:
        return False
    return not (isinstance(owner, ast.Attribute) and _name(owner.value) in CONFIG_NAMES)


def seam_violations(source: str, filename: str) -> list[str]:
    """Each line of ``source`` that crosses the seam, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("connector."):
                found.append(f"{where}: imports the connector's module {node.module}")
            elif node.module == "connector":
                found += [f"{where}: imports {a.name}, not on the connector's face" for a in node.names
                          if a.name not in connector.__all__]
            elif node.module.startswith(STORE_INSIDES):
                found.append(f"{where}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names
                      if a.name.startswith("connector.") or a.name.startswith(STORE_INSIDES)]
        elif isinstance(node, ast.Attribute) and _reaches_through(node):
            found.append(f"{where}: reaches through the connector: {ast.unparse(node)}")
    return sorted(found, key=lambda v: int(v.split(":")[1]))


def test_the_engine_uses_only_the_connectors_face():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} engine modules under {ENGINE}"
    found = [v for f in files for v in seam_violations(f.read_text(), str(f.relative_to(ENGINE.parent)))]
    assert not found, "the engine crosses the connector's seam:\n" + "\n".join(found)


def test_the_face_exports_what_it_names():
    assert all(hasattr(connector, name) for name in connector.__all__)


def test_the_check_sees_each_kind_of_crossing():
    """Each rule fires on the kind of line it forbids, and not on its look-alikes."""
    crossing = {
        "from connector.worker import WorkerConnector": "connector's module connector.worker",
        "from connector.sessions import session_holder": "connector's module connector.sessions",
        "import connector.scheduler": "imports connector.scheduler",
        "from connector import Availability": "not on the connector's face",
        "from kvstore.daemon.sessions import SessionBook": "imports kvstore.daemon.sessions",
        "import kvstore.store.facade": "imports kvstore.store.facade",
        "from kvstore.config import load_config": "imports kvstore.config",
        "self.connector.store.prefetch(keys)": "self.connector.store",
        "n = llm.connector.scheduler.pins": "llm.connector.scheduler",
        "conn.worker.saver.promised(keys)": "conn.worker",
        "store = self.connector.store": "self.connector.store",
        "self.connector.availability.available()": "self.connector.availability",
    }
    for line, what in crossing.items():
        found = seam_violations(line, "x.py")
        assert len(found) == 1 and what in found[0], (line, found)
    allowed = ["from connector import KVConnector, ConnectorOutput",
               "from kvstore.keys import chunk_keys",
               "from kvstore.api import valid_duration",
               "n = cfg.connector.store.host.capacity_bytes",
               "n = self.config.connector.store.host.capacity_bytes",
               "self.connector.pause_session(s.id, s.token_ids, ttl)",
               "self.connector.config.transfer.wait_s",
               "self.kv_store.stats()"]
    for line in allowed:
        assert seam_violations(line, "x.py") == [], line
