"""``kvstore serve``/``stats``/``ping`` user errors: one line on stderr, exit code 2."""

import asyncio
import socket

import pytest

from kvstore.cli import main
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon, StartupError
from kvstore.config import load_config


@pytest.mark.parametrize("argv,fragment", [
    (["serve", "--host-bytes", "lots"], "cannot parse size"),
    (["serve", "--listen", "nowhere"], "HOST:PORT"),
    (["serve", "--metrics", "127.0.0.1:x"], "HOST:PORT"),
    (["serve", "--tls-cert", "/nonexistent.pem"], "go together"),
    (["serve", "--config", "/nonexistent.toml"], "nonexistent"),
    (["ping", "--addr", "bad address"], "HOST:PORT"),
])
def test_user_errors_print_one_line_and_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err


def test_unknown_config_key_names_it(tmp_path, capsys):
    cfg = tmp_path / "d.toml"
    cfg.write_text("[shm]\nslotz = 3\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "slotz" in capsys.readouterr().err


def test_ping_without_a_daemon_is_a_user_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    assert main(["ping", "--addr", f"127.0.0.1:{port}", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UNAVAILABLE" in err


def test_daemon_config_loads_sizes_and_defaults_to_loopback(tmp_path):
    cfg = tmp_path / "d.toml"
    cfg.write_text('[shm]\nslot_bytes = "16MiB"\n[store.host]\ncapacity_bytes = "2GiB"\n')
    loaded = load_config(cfg, DaemonConfig)
    assert loaded.shm.slot_bytes == 16 << 20 and loaded.store.host.capacity_bytes == 2 << 30
    assert DaemonConfig().listen.startswith("127.0.0.1:")


def test_config_daemon_prints_a_loadable_daemon_config(tmp_path, capsys):
    cfg = tmp_path / "d.toml"
    cfg.write_text('metrics = "127.0.0.1:9400"\n[shm]\nslots = 3\n[store.host]\ncapacity_bytes = "2MiB"\n')
    assert main(["config", "--daemon", "--config", str(cfg)]) == 0
    out = tmp_path / "out.toml"
    out.write_text(capsys.readouterr().out)
    loaded = load_config(out, DaemonConfig)
    assert loaded.shm.slots == 3 and loaded.store.host.capacity_bytes == 2 << 20
    assert loaded.metrics == "127.0.0.1:9400" and loaded.auth_token_file is None


def test_serve_on_a_taken_port_is_a_user_error(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", "--listen", f"127.0.0.1:{port}", "--host-bytes", "8MiB",
                     "--data-dir", str(tmp_path / "data"), "--no-shm", "--no-bulk"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err


def test_a_taken_metrics_address_fails_the_start_before_the_grpc_port_is_bound(tmp_path):
    """Even past the CLI's early check (the address taken in between), in one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        cfg = DaemonConfig(listen="127.0.0.1:0", metrics=f"127.0.0.1:{taken.getsockname()[1]}")
        cfg.store.host.capacity_bytes = 8 << 20
        cfg.store.disk.path = str(tmp_path / "data")
        cfg.shm.dir = str(tmp_path)

        async def start() -> Daemon:
            daemon = Daemon(cfg)
            try:
                with pytest.raises(StartupError, match="cannot serve metrics"):
                    await daemon.start()
            finally:
                await daemon.stop()
            return daemon

        assert asyncio.run(start()).address == ""  # no gRPC port was bound
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # its shared-memory files are gone
