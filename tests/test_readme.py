"""The README's five-minute tour runs as written: each of its Python blocks, in a fresh
interpreter, prints what its comments say (a newcomer's first hour starts there)."""

import os
import re
import subprocess
import sys
from pathlib import Path

from kvstore.daemon.spawn import DaemonProcess

ROOT = Path(__file__).parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def block(marker: str) -> str:
    """The one README Python block that contains ``marker``."""
    (found,) = [b for b in BLOCKS if marker in b]
    return found


def run(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


def test_the_in_process_store_block(tmp_path):
    code = block("from kvstore.store import Store")
    assert code.count('"/tmp/kvstore-tour"') == 1
    out = run(code.replace('"/tmp/kvstore-tour"', repr(str(tmp_path / "tour"))))
    assert out[:2] == ["3", "3"]  # lookup: 3 leading chunks; host hits: the 3 gets


def test_the_daemon_client_block(tmp_path):
    code = block("from kvstore.client import Client")
    assert code.count('"127.0.0.1:50051"') == 1  # scripts/run.sh's default address
    with DaemonProcess(["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data")]) as daemon:
        out = run(code.replace('"127.0.0.1:50051"', repr(daemon.addr)))
    assert out[0] == "1 1"


def test_the_engine_block_loads_instead_of_recomputing():
    out = run(block("from engine import LLM"))
    prompt, loaded, computed, _, _ = map(float, out[0].split())  # and the two TTFTs, which a benchmark compares
    assert prompt > 2000 and loaded == prompt // 16 * 16 and computed == max(1, prompt - loaded)
