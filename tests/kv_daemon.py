"""A real daemon process for tests: loopback, a port the OS picks, its own data directory,
configuration and bearer token (``kvstore serve`` exactly as a user runs it)."""

from __future__ import annotations

from pathlib import Path

from kvstore.daemon.spawn import DaemonProcess

TOKEN = "connector-tests-token"


def start_daemon(root: Path, host_bytes: str = "64MiB", disk_bytes: str = "256MiB",
                 slot_bytes: str = "1MiB", page_bytes: int = 4096, listen: str = "127.0.0.1:0",
                 env: dict[str, str] | None = None, extra_toml: str = "") -> DaemonProcess:
    """Start ``kvstore serve`` under ``root`` (again on the same data after a stop: ``listen``
    then names the address it had; ``env``: added to its environment); ``proc.token_file``
    holds its token; ``extra_toml``: more of its configuration file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "token").write_text(TOKEN + "\n")
    (root / "daemon.toml").write_text(
        f'[shm]\nslots = 16\nslot_bytes = "{slot_bytes}"\n'
        f'[store.host]\ncapacity_bytes = "{host_bytes}"\npage_bytes = {page_bytes}\n'
        f'[store.disk]\ncapacity_bytes = "{disk_bytes}"\n{extra_toml}'
    )
    proc = DaemonProcess(["--config", str(root / "daemon.toml"), "--listen", listen,
                          "--data-dir", str(root / "data"), "--auth-token-file", str(root / "token")], env=env)
    proc.token_file = str(root / "token")
    proc.data_dir = root / "data"
    return proc
