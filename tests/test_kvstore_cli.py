import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.cli import main
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, load_config
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.files import SUFFIX

TINY_NS = Namespace("m", 1, 1, 8, chunk_tokens=4)


def test_config_prints_loadable_toml(tmp_path, capsys):
    cfg_file = tmp_path / "in.toml"
    cfg_file.write_text('[host]\ncapacity_bytes = "2MiB"\n')
    assert main(["config", "--config", str(cfg_file)]) == 0
    out = tmp_path / "out.toml"
    out.write_text(capsys.readouterr().out)
    cfg = load_config(out)
    assert cfg.host.capacity_bytes == 2 << 20 and cfg.host.shm_path is None
    assert 'eviction_policy = "default"  # = shadow-vote' in out.read_text()  # what "default" means


def test_the_cli_and_the_client_start_without_torch():
    """kvstore --help, ping and stats start in a fraction of a second: torch alone takes ~1 s."""
    code = "import sys, kvstore.cli, kvstore.client; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


def test_version_and_a_subcommands_own_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("kvstore 0.")
    with pytest.raises(SystemExit) as exc:
        main(["ping", "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: kvstore ping") and "--bogus" in err


def test_fsck_finds_and_repairs_corruption(tmp_path, capsys):
    data = tmp_path / "data"
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False),
                      disk=DiskTierConfig(path=str(data), capacity_bytes=1 << 20))
    with Store(cfg) as store:
        for k in chunk_keys(list(range(12)), TINY_NS):
            store.put(k, torch.ones(TINY_NS.chunk_shape, dtype=torch.float16))
    files = sorted(data.rglob("*" + SUFFIX))
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    assert main(["fsck", "--data-dir", str(data)]) == 1
    assert "3 blobs" in capsys.readouterr().out
    assert main(["fsck", "--data-dir", str(data), "--repair"]) == 0
    assert main(["fsck", "--data-dir", str(data)]) == 0
    assert len(list(data.rglob("*" + SUFFIX))) == 2


def test_fsck_verifies_blobs_without_torch(tmp_path):
    """fsck reads headers and checksums only: loading torch (seconds on a small machine) for
    it made `kvstore fsck` of an empty directory take 8 s."""
    data = tmp_path / "data"
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False),
                      disk=DiskTierConfig(path=str(data), capacity_bytes=1 << 20))
    with Store(cfg) as store:
        for k in chunk_keys(list(range(8)), TINY_NS):
            store.put(k, torch.ones(TINY_NS.chunk_shape, dtype=torch.float16))
    code = ("import sys; from kvstore.cli import main; rc = main(['fsck', '--data-dir', sys.argv[1]]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(data)], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 blobs" in proc.stdout and "0 corrupt" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "no torch"


def test_user_errors_exit_2(tmp_path, capsys):
    assert main(["fsck", "--data-dir", str(tmp_path / "missing")]) == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("[host]\nsize = 1\n")
    assert main(["config", "--config", str(bad)]) == 2
    assert "unknown key" in capsys.readouterr().err
