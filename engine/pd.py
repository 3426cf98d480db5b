"""One engine serving one role of disaggregated serving, stepped by its owner: ``prefill``
(its connector a producer: each request runs to its first token, its chunks put durably,
then it reports ``TransferParams``), ``decode`` (a consumer: a request waits, bounded, for its
promised chunks, loads them and decodes), or ``colocated`` (prefill and decode in one engine,
the baseline). ``serve`` runs one in a process of its own (engine/router.py starts those).
Times are ``time.monotonic()``, one clock for every process of the host. See
docs/disaggregation.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from connector import PromisedChunks, TransferParams
from engine.llm import LLM
from engine.sampling import SamplingParams

ROLES = {"prefill": "producer", "decode": "consumer", "colocated": None}


@dataclass
class Finished:
    """A request done in one engine. ``token_ids``: its output (a prefill's: the first token);
    ``token_times``: when each became known (a prefill's: once its puts returned)."""

    request_id: str
    token_ids: list[int]
    token_times: list[float]
    transfer: TransferParams | None = None
    loaded_tokens: int = 0
    prefilled_tokens: int = 0
    kv_load_s: float = 0.0
    wait_s: float = 0.0  # decode: waiting for promised chunks
    wait_timed_out: bool = False
    finish_reason: str | None = None
    error: str | None = None  # the engine refused the request (one line); nothing was computed

    @property
    def stopped(self) -> bool:
        """Ended by an end-of-sequence token or a stop string (not by its length)."""
        return self.finish_reason == "stop"


@dataclass
class _Pending:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    transfer: TransferParams | None
    promise: PromisedChunks
    since: float


@dataclass
class _Running:
    prompt: list[int]
    first: list[int] = field(default_factory=list)  # the producer's token, given to a decode
    times: list[float] = field(default_factory=list)
    transfer: TransferParams | None = None
    wait_s: float = 0.0
    wait_timed_out: bool = False


class RoleEngine:
    def __init__(self, llm: LLM, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
        want = ROLES[role]
        have = llm.connector.config.role if llm.connector else None
        if want is not None and have != want:
            raise ValueError(f"a {role} engine needs a connector with role {want!r}, not {have!r}")
        self.llm, self.role = llm, role
        self._pending: list[_Pending] = []
        self._running: dict[str, _Running] = {}

    def busy(self) -> bool:
        return bool(self._pending or self.llm.has_unfinished())

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               transfer: TransferParams | None = None) -> None:
        """Queue a request. A decode's ``transfer`` names the chunks a producer promised (None:
        compute the whole prompt); with its ``first_token`` the decode continues after it.
        A request the engine cannot serve raises ValueError here, before anything is queued."""
        if self.role == "decode" and transfer and transfer.first_token is not None:
            self.llm._validate(prompt + [transfer.first_token], dataclasses.replace(params, max_tokens=max(
                1, params.max_tokens - 1)))
        else:
            self.llm._validate(prompt, params)
        if self.role == "prefill":
            self._add(request_id, prompt, dataclasses.replace(params, max_tokens=1), _Running(prompt))
        elif self.role == "colocated":
            self._add(request_id, prompt, params, _Running(prompt))
        else:
            if transfer and transfer.first_token is not None and params.max_tokens < 2:
                raise ValueError("the producer's first token was the whole output: nothing to decode")
            promise = self.llm.connector.promised_chunks(prompt, transfer)
            self._pending.append(_Pending(request_id, prompt, params, transfer, promise, time.monotonic()))

    def _add(self, request_id: str, tokens: list[int], params: SamplingParams, state: _Running) -> None:
        self.llm.add_request(tokens, params, request_id=request_id)
        self._running[request_id] = state

    def check(self) -> dict:
        """Idle bookkeeping (``Scheduler.check_integrity``: no request tracked, no pin held) and
        the staging buffers still out (nothing in flight: 0), for tests after faults."""
        self.llm.scheduler.check_integrity()
        staged = self.llm.connector.staging_out() if self.llm.connector else 0
        return {"pending": len(self._pending), "running": len(self._running), "staged": staged}

    def _admit_ready(self) -> None:
        """Decodes whose promised chunks are visible, or whose wait is over, join the engine."""
        for p in [p for p in self._pending if p.promise.ready()]:
            self._pending.remove(p)
            state = _Running(p.prompt, transfer=p.transfer, wait_s=time.monotonic() - p.since,
                             wait_timed_out=p.promise.timed_out)
            first = p.transfer.first_token if p.transfer else None
            if first is None:
                self._add(p.request_id, p.prompt, p.params, state)
            else:
                state.first = [first]
                self._add(p.request_id, p.prompt + [first], dataclasses.replace(p.params, max_tokens=p.params.max_tokens - 1),
                          state)

    def step(self) -> list[Finished]:
        """One engine step (or a short nap while decodes only wait for chunks); what finished."""
        if self._pending:
            self._admit_ready()
        if not self.llm.has_unfinished():
            if self._pending:
                time.sleep(self.llm.connector.config.transfer.poll_s)
            return []
        done = []
        for out in self.llm.step():
            state = self._running[out.request_id]
            state.times.append(time.monotonic())
            if out.finished:
                done.append(self._finish(out, self._running.pop(out.request_id)))
        return done

    def _finish(self, out, state: _Running) -> Finished:
        m = out.metrics
        tokens = state.first + out.output_token_ids
        finished = Finished(out.request_id, tokens, state.times, state.transfer, m.num_loaded_tokens,
                            m.num_prefilled_tokens, m.kv_load_s, state.wait_s, state.wait_timed_out,
                            out.finish_reason)
        if self.role == "prefill":
            finished.transfer = self._promise(out.request_id, state.prompt, tokens[0])
            finished.token_times = [time.monotonic()]
        return finished

    def _promise(self, request_id: str, prompt: list[int], first_token: int) -> TransferParams:
        """Once this request's puts returned: the leading chunks the store holds durably."""
        self.llm.flush_saves()
        return self.llm.connector.transfer_params(request_id, prompt, first_token)


@dataclass
class EngineSpec:
    """What a serving process builds: ``LLM(model, config)`` in ``role``, on ``threads`` torch threads."""

    model: str
    config: object  # EngineConfig
    role: str
    threads: int = 1


def serve(conn, engine: RoleEngine) -> None:
    """Requests in, ``Finished`` out, over a ``multiprocessing.connection`` until "close" or EOF."""
    while True:
        timeout = 0 if engine.busy() else 0.05
        while conn.poll(timeout):
            msg = conn.recv()
            if msg["op"] == "close":
                return
            if msg["op"] == "submit":
                transfer = msg.get("transfer")
                try:
                    engine.submit(msg["request_id"], msg["prompt"], msg["params"],
                                  TransferParams.from_dict(transfer) if transfer else None)
                except ValueError as exc:  # a bad request: answered, and the engine serves on
                    conn.send({"op": "finished", "finished": Finished(msg["request_id"], [], [], error=str(exc))})
            elif msg["op"] == "check":
                try:
                    conn.send({"op": "check", **engine.check()})
                except AssertionError as exc:
                    conn.send({"op": "check", "error": str(exc)})
            elif msg["op"] == "stats":
                conn.send({"op": "stats", "stats": engine.llm.stats(),
                           "store": engine.llm.kv_store.stats() if engine.llm.kv_store else None})
            timeout = 0
        for finished in engine.step():
            conn.send({"op": "finished", "finished": finished})


def main() -> int:
    """The serving process: build the engine the router asks for over the pipe it handed down, serve."""
    from multiprocessing.connection import Connection

    import torch

    conn = Connection(int(os.environ["ENGINE_PD_FD"]))
    spec: EngineSpec = conn.recv()
    torch.set_num_threads(spec.threads)
    try:
        llm = LLM(spec.model, spec.config)
        engine = RoleEngine(llm, spec.role)
    except Exception as exc:
        conn.send({"op": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 2
    conn.send({"op": "ready", "pid": os.getpid()})
    try:
        serve(conn, engine)
    except (EOFError, ConnectionError):
        pass  # the router is gone
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    from engine.pd import main as module_main  # records pickle as engine.pd's, not __main__'s

    sys.exit(module_main())
