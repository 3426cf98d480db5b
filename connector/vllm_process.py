"""A real vLLM engine in a child process under the vLLM venv (``scripts/setup.sh vllm`` makes
``.venv-vllm``), driven by ``connector/vllm_driver.py``: one engine start (a minute or more on
a small CPU), many requests. The project's own venv has no vLLM: tests/connector/test_vllm_*.py (which
skip with one line when the vLLM venv is absent) and ``kvbench vllm`` both drive vLLM through
this, since neither may import the other."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
SKIP_REASON = f"vLLM is not installed ({VLLM_PYTHON} missing): bash scripts/setup.sh vllm"


def connector_kv_config(addr: str, token_file: str | None, **extra) -> dict:
    """``--kv-transfer-config`` for our connector on the daemon at ``addr``."""
    daemon = {"addr": addr, "timeout_s": 2.0, **({"token_file": token_file} if token_file else {})}
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connector.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"daemon": daemon, "unavailable_backoff_s": 1.0, **extra}}


class VllmEngine:
    def __init__(self, model: Path, kv_transfer_config: dict | None = None, max_model_len: int = 2048,
                 prefix_caching: bool = False, max_batched_tokens: int | None = None, num_blocks: int | None = None,
                 start_timeout_s: float = 600.0) -> None:
        """``max_batched_tokens`` below a prompt's length splits its prefill over steps;
        ``num_blocks`` overrides the KV cache's size in blocks (small: preemptions)."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
        # as a module: run as a file, its folder would come first on sys.path and connector/vllm.py
        # would shadow vLLM
        cmd = [str(VLLM_PYTHON), "-m", "connector.vllm_driver", "--model", str(model),
               "--max-model-len", str(max_model_len), "--max-batched-tokens", str(max_batched_tokens or max_model_len)]
        if num_blocks is not None:
            cmd += ["--num-blocks", str(num_blocks)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if prefix_caching:
            cmd.append("--prefix-caching")
        # replies on a pipe of their own: vLLM's processes write their logs to stdout concurrently,
        # and a reply sharing a line with one of them would be lost
        reply_read, reply_write = os.pipe()
        cmd += ["--reply-fd", str(reply_write)]
        started = time.monotonic()
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, env=env, cwd=ROOT, start_new_session=True, pass_fds=(reply_write,))
        finally:
            os.close(reply_write)
        self.log: deque[str] = deque(maxlen=5000)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_log, daemon=True).start()
        threading.Thread(target=self._read_replies, args=(os.fdopen(reply_read),), daemon=True).start()
        self._wait_reply(start_timeout_s)
        self.start_s = time.monotonic() - started

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))

    def _read_replies(self, replies) -> None:
        with replies:
            for line in replies:
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the process ended

    def _wait_reply(self, timeout_s: float) -> dict:
        """The driver's next reply; its log so far when it ends or stays silent."""
        try:
            answer = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"vLLM driver gave no reply in {timeout_s} s:\n{self.text[-4000:]}") from None
        if answer is None:
            raise RuntimeError(f"vLLM driver exited ({self.proc.wait()}):\n{self.text[-6000:]}")
        return answer

    @property
    def text(self) -> str:
        return "\n".join(self.log)

    def call(self, timeout_s: float = 300.0, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16) -> dict:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache, so the next send of a prompt reaches the connector."""
        if not self.call(op="reset_prefix_cache")["ok"]:
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still holds blocks)")

    def close(self, timeout_s: float = 120.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout_s)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:  # the engine's own children are in its session
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
