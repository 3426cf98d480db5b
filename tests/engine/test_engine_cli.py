"""The engine's defaults and its command line as a newcomer meets them: the torch thread
count chosen from the cores the process may use (and said at start), explicit settings that
win, and mistakes that are one line and exit code 2, not a traceback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig
from engine.testing import make_tiny_checkpoint
from engine.threads import default_threads

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def environment(**extra: str) -> dict:
    """This one's, without a thread count named by the environment (it would win)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def python(code: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=environment(**env))


def test_one_thread_less_than_the_cores_at_least_one():
    assert [default_threads(n) for n in (1, 2, 3, 16)] == [1, 1, 2, 15]


@pytest.mark.parametrize("cores", ["one", "all"])
def test_importing_the_engine_sets_threads_from_the_cores_the_process_may_use(cores):
    """torch's default (a thread per core) made a cold prefill 2.7-5x slower on 2 shared cores."""
    code = ("import os, sys, torch\n"
            "if sys.argv[1] == 'one':\n    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "import engine\nprint(len(os.sched_getaffinity(0)), torch.get_num_threads())")
    proc = python(code, cores)
    usable, threads = map(int, proc.stdout.split())
    assert usable == (1 if cores == "one" else len(os.sched_getaffinity(0)))
    assert threads == max(1, usable - 1)


def test_omp_num_threads_wins_over_the_default():
    proc = python("import torch, engine; print(torch.get_num_threads())", OMP_NUM_THREADS="2")
    assert proc.stdout.split() == ["2"], proc.stderr[-2000:]


def test_the_engine_says_its_thread_count_and_who_chose_it(tiny, caplog):
    caplog.set_level(logging.INFO, logger="engine")
    LLM(tiny, EngineConfig(num_blocks=16, threads=2)).close()
    assert torch.get_num_threads() == 2
    assert "2 torch threads (EngineConfig.threads" in caplog.text
    caplog.clear()
    torch.set_num_threads(3)  # the program's own choice, after the import: kept
    LLM(tiny, EngineConfig(num_blocks=16)).close()
    assert torch.get_num_threads() == 3 and "3 torch threads (set by the program" in caplog.text
    with pytest.raises(ValueError, match="threads must be positive"):
        EngineConfig(threads=0)


def run_engine(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "generate", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=environment())


def test_generate_says_its_threads_at_start(tiny):
    proc = run_engine("--model", str(tiny), "--prompt", "hi", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    n = default_threads(len(os.sched_getaffinity(0)))
    assert f"engine: {n} torch thread{'s' if n > 1 else ''} (one less than the" in proc.stderr.splitlines()[0]


@pytest.mark.parametrize("case", ["data dir is a file", "host RAM above physical memory", "threads 0",
                                  "threads negative", "connector typo"])
def test_generate_user_errors_are_one_line_and_exit_2(tiny, tmp_path, case):
    (tmp_path / "a-file").write_text("")
    toml = {"data dir is a file": f'[store.disk]\npath = "{tmp_path / "a-file"}"\n',
            "host RAM above physical memory": '[store.host]\ncapacity_bytes = "100TiB"\n',
            "connector typo": "chunk_tokens = 16\nchunk_tokenz = 16\n"}.get(case)
    argv = ["--model", str(tiny), "--prompt", "hi", "--max-tokens", "2"]
    if toml is not None:
        (tmp_path / "connector.toml").write_text(toml)
        argv += ["--connector", str(tmp_path / "connector.toml")]
    else:
        argv += ["--threads", "0" if case == "threads 0" else "-2"]
    proc = run_engine(*argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    expected = {"data dir is a file": "it is a file, not a directory", "host RAM above physical memory":
                "more than this machine's physical memory", "threads 0": "threads must be positive",
                "threads negative": "threads must be positive", "connector typo": "chunk_tokenz"}[case]
    assert proc.stderr.startswith("engine generate: ") and expected in proc.stderr
