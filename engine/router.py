"""The router of disaggregated serving: each request to a prefill engine, then, with the
transfer parameters it returned, to a decode engine (engine/pd.py). Engines run in
processes of their own (``EngineProcess``), talk to the router over a pipe and to
their stores (one daemon each, or one shared) on their own; the KV never passes the router.

Every wait is bounded: a prefill engine that dies, or does not answer a request within
``prefill_timeout_s``, sends its requests to the decode engine without a transfer (the
decode computes the prompt itself); a decode waits for promised chunks at most its
connector's ``transfer.wait_s``. Without a prefill engine the router serves colocated.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import wait
from typing import NoReturn

from engine.pd import EngineSpec, Finished
from engine.sampling import SamplingParams


class EngineDied(RuntimeError):
    """An engine process exited or closed its connection."""


class EngineProcess:
    """``python -m engine.pd`` serving ``spec``; requests in, ``Finished`` out."""

    def __init__(self, spec: EngineSpec, start_timeout_s: float = 300.0) -> None:
        self.spec = spec
        self._dir = tempfile.TemporaryDirectory(prefix="engine-pd-")
        self.conn, child = Pipe()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "ENGINE_PD_FD": str(child.fileno()),
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log_path = os.path.join(self._dir.name, "stderr.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.pd"], env=env, stdout=subprocess.DEVNULL,
                                         stderr=log, pass_fds=(child.fileno(),))
        child.close()  # the engine holds the only other end: its exit reads here as end of file
        try:
            self.conn.send(spec)
            if not self.conn.poll(start_timeout_s):
                self._fail(f"did not get ready in {start_timeout_s} s")
            msg = self.conn.recv()
        except (OSError, EOFError):
            self._fail("exited before it was ready")
        if msg["op"] != "ready":
            self._fail(f"failed to start: {msg.get('error')}")
        self.pid = msg["pid"]
        self.alive = True

    def _fail(self, why: str) -> NoReturn:
        self.kill()
        log = self.log()
        self.conn.close()
        self._dir.cleanup()
        raise EngineDied(f"{self.spec.role} engine {why}: {log}")

    def running(self) -> bool:
        """Whether the process is up and its connection open."""
        return self.alive and self.proc.poll() is None

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-2000:]

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, transfer: dict | None = None) -> None:
        try:
            self.conn.send({"op": "submit", "request_id": request_id, "prompt": prompt, "params": params,
                            "transfer": transfer})
        except (OSError, EOFError) as exc:
            self.alive = False
            raise EngineDied(f"{self.spec.role} engine is gone: {exc}") from None

    def recv(self) -> dict:
        try:
            return self.conn.recv()
        except (OSError, EOFError) as exc:
            self.alive = False
            raise EngineDied(f"{self.spec.role} engine is gone: {exc}") from None

    def ask(self, op: str, timeout_s: float = 30.0) -> dict:
        """``stats`` (the engine's and its store's counters) or ``check`` (its bookkeeping; see
        ``RoleEngine.check``); ask while it is idle."""
        self.conn.send({"op": op})
        if not self.conn.poll(timeout_s):
            raise EngineDied(f"{self.spec.role} engine did not answer {op}")
        msg = self.conn.recv()
        if msg["op"] != op:
            raise RuntimeError(f"{self.spec.role} engine answered {msg['op']} to {op}")
        return msg

    def kill(self) -> None:
        self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send({"op": "close"})
                self.proc.wait(timeout_s)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                self.kill()
        self._dir.cleanup()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_s: float = 0.0  # after the run's start


@dataclass
class Routed:
    """A request served: its output and when each token reached the router's side."""

    request_id: str
    token_ids: list[int]
    arrival: float
    token_times: list[float]
    prefill: Finished | None = None
    decode: Finished | None = None
    rerouted: bool = False  # the prefill failed: the decode engine computed the prompt
    error: str | None = None  # an engine refused the request (too long, bad token ids...)

    @property
    def ttft_s(self) -> float:
        """Arrival to the first token (not for a refused request: it has none)."""
        return self.token_times[0] - self.arrival

    @property
    def tpot_s(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0


@dataclass
class Router:
    decode: EngineProcess
    prefill: EngineProcess | None = None  # None: the decode engine is colocated
    prefill_timeout_s: float = 120.0
    _at_prefill: dict = field(default_factory=dict)

    def run(self, requests: list[Request]) -> list[Routed]:
        """Serve ``requests`` (arriving at their ``arrival_s``); results in request order."""
        start = time.monotonic()
        queue = sorted(requests, key=lambda r: r.arrival_s)
        by_id = {r.request_id: r for r in requests}
        results: dict[str, Routed] = {}
        partial: dict[str, Routed] = {}
        while len(results) < len(requests):
            now = time.monotonic()
            while queue and start + queue[0].arrival_s <= now:
                r = queue.pop(0)
                partial[r.request_id] = Routed(r.request_id, [], start + r.arrival_s, [])
                self._send_prefill(r)
            prefill_dead = self.prefill is not None and not self.prefill.running()
            for rid, sent in list(self._at_prefill.items()):
                if prefill_dead or now - sent > self.prefill_timeout_s:
                    self._reroute(by_id[rid], partial[rid])
            conns = [e.conn for e in (self.prefill, self.decode) if e is not None and e.alive]
            next_arrival = start + queue[0].arrival_s - now if queue else 0.05
            for conn in wait(conns, timeout=max(0.0, min(0.05, next_arrival))):
                engine = self.prefill if self.prefill is not None and conn is self.prefill.conn else self.decode
                try:
                    msg = engine.recv()
                except EngineDied:
                    if engine is self.decode:
                        raise
                    for rid in list(self._at_prefill):
                        self._reroute(by_id[rid], partial[rid])
                    continue
                if msg["op"] != "finished":
                    continue
                f: Finished = msg["finished"]
                r, routed = by_id[f.request_id], partial[f.request_id]
                if f.error is not None:
                    self._at_prefill.pop(f.request_id, None)
                    routed.error = f.error
                    results[r.request_id] = routed
                elif engine is self.decode:
                    routed.decode = f
                    routed.token_ids = f.token_ids
                    routed.token_times += f.token_times
                    results[r.request_id] = routed
                elif self._at_prefill.pop(f.request_id, None) is not None:
                    routed.prefill = f
                    routed.token_ids, routed.token_times = list(f.token_ids), list(f.token_times)
                    if r.params.max_tokens == 1 or f.stopped:
                        results[r.request_id] = routed
                    else:
                        self.decode.submit(r.request_id, r.prompt, r.params, f.transfer.to_dict())
        return [results[r.request_id] for r in requests]

    def _send_prefill(self, r: Request) -> None:
        if self.prefill is None:
            self.decode.submit(r.request_id, r.prompt, r.params)
            return
        if self.prefill.alive:
            try:
                self.prefill.submit(r.request_id, r.prompt, r.params)
                self._at_prefill[r.request_id] = time.monotonic()
                return
            except EngineDied:
                pass
        self.decode.submit(r.request_id, r.prompt, r.params)

    def _reroute(self, r: Request, routed: Routed) -> None:
        """The prefill failed: the decode engine computes the prompt (and may still load
        whatever chunks the producer did put)."""
        self._at_prefill.pop(r.request_id, None)
        routed.rerouted = True
        self.decode.submit(r.request_id, r.prompt, r.params)
