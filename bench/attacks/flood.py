"""A connection flood: many connections to the bulk and gRPC ports that never authenticate
(some send garbage), with the daemon short of descriptors, while a legitimate client keeps
reading. The daemon must keep its attached client served, shed the flood (closing what has
not authenticated in time), and afterwards accept new clients as before."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

import torch

from bench.attacks.target import NS, Target, content
from kvstore.wire._proto import kvstore_pb2 as pb


@dataclass
class FloodReport:
    connections: int = 0  # flood connections opened
    legit_ops: int = 0  # Gets the attached client completed during the flood
    legit_failures: int = 0
    wrong: int = 0
    fds_before: int = 0
    fds_after: int = 0
    new_client_ok: bool = False
    accept_errors_logged: bool = False

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def run(target: Target, connections: int, seconds: float) -> FloodReport:
    report = FloodReport(fds_before=_fds(target.pid))
    stop = threading.Event()
    legit = target.client("victim", transport="remote", timeout_s=10, retries=0)
    keys = target.victim_keys[:8]
    bulk_port = legit._drive(legit._core._call("BulkAttach", pb.BulkAttachRequest())).port
    grpc_port = int(target.addr.rsplit(":", 1)[1])
    assert legit.path == "bulk"

    def reader() -> None:
        outs = [torch.empty(NS.chunk_shape, dtype=torch.float16) for _ in keys]
        while not stop.is_set():
            try:
                n = legit.get_many_into(keys, outs)
                report.wrong += sum(not torch.equal(outs[i], content(i)) for i in range(n))
                report.legit_ops += 1
            except Exception:
                report.legit_failures += 1

    thread = threading.Thread(target=reader)
    thread.start()
    socks: list[socket.socket] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for port in (bulk_port, grpc_port):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=2)
                    if len(socks) % 3 == 0:
                        s.sendall(os.urandom(64))
                    socks.append(s)
                    report.connections += 1
                except OSError:
                    pass
            if len(socks) > connections:
                for s in socks[: len(socks) - connections]:
                    s.close()
                del socks[: len(socks) - connections]
    finally:
        stop.set()
        thread.join()
        for s in socks:
            s.close()
        legit.close()
    report.accept_errors_logged = any("accept() failed" in line or "have not presented a token" in line
                                      for line in target.process.log)
    with target.client("victim", transport="remote", timeout_s=10) as fresh:
        got = fresh.get(keys)
        report.new_client_ok = len(got) == len(keys) and all(torch.equal(g, content(i)) for i, g in enumerate(got))
    limit = time.monotonic() + 30
    while _fds(target.pid) > report.fds_before + 8 and time.monotonic() < limit:
        time.sleep(0.1)
    report.fds_after = _fds(target.pid)
    return report
