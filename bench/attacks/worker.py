"""A client process for the attacks: ``python -m bench.attacks.worker MODE ADDR TOKEN TRANSPORT
START COUNT`` runs one kind of work in a loop and prints a line per finished operation, until
it is killed (the attacks SIGKILL it at a random moment) or, for ``soak``, until its time is
up. Every chunk it reads is checked against ``content``; ``soak`` prints its tallies as JSON
at the end.

- ``get``: Gets of chunks START..START+COUNT (put by somebody else), 16 per call;
- ``put``: Puts of fresh chunks START..START+PUT_KEYS, every other one durable;
- ``pin``: leases slots, pins its chunks (Pin RPC), then starts a bulk Get whose pages stay
  pinned for it and never sends RELEASE; prints ``held`` and waits;
- ``soak SECONDS``: all RPCs mixed over chunks START..START+COUNT of its own tenant.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import time

import torch

from bench.attacks.target import NS, content, keys
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client import Client, DaemonError
from kvstore.wire.convert import ns_to_proto
from kvstore.wire.frames import FRAME, GET, HELLO


PUT_KEYS = 4096


def _say(line: str) -> None:
    print(line, flush=True)


def get_loop(client: Client, start: int, count: int) -> None:
    ks = keys(start, count)
    outs = [torch.empty(NS.chunk_shape, dtype=torch.float16) for _ in range(16)]
    rng = random.Random(start)
    while True:
        i = rng.randrange(0, count - 16 + 1)
        n = client.get_many_into(ks[i : i + 16], outs)
        for j in range(n):
            if not torch.equal(outs[j].view(torch.int16), content(start + i + j).view(torch.int16)):
                _say(f"WRONG {start + i + j}")
        _say("got")


def put_loop(client: Client, start: int, count: int) -> None:
    for i, key in enumerate(keys(start, PUT_KEYS)):
        client.put(key, content(start + i), durable=i % 2 == 0)
        _say(f"put {start + i}")


def pin_and_hold(client: Client, start: int, count: int) -> None:
    ks = keys(start, count)
    for i, k in enumerate(ks):
        client.put(k, content(start + i))
    client.pin(ks, 600)
    lease = client._drive(client._core.transports.lease())
    attach = client._drive(client._core._call("BulkAttach", pb.BulkAttachRequest()))
    sock = socket.create_connection(("127.0.0.1", attach.port))
    sock.sendall(HELLO.pack(attach.session, attach.token))
    sock.recv(1)
    slots = lease.take(count) if lease is not None else []
    request = pb.GetRequest(namespace=ns_to_proto(NS), prefix_hashes=[k.prefix_hash for k in ks[: len(slots) or count]],
                            payload=pb.TENSOR, slots=[ref for ref, _ in slots], pool_views=bool(slots))
    meta = request.SerializeToString()
    sock.sendall(FRAME.pack(GET, len(meta), 0) + meta)
    sock.recv(1 << 16)  # the daemon has pinned pages for us; we never say RELEASE
    _say("held")
    time.sleep(3600)


def soak(client: Client, start: int, count: int, seconds: float) -> dict:
    """Every operation, at random, over this worker's own chunks; reads are checked."""
    rng = random.Random(start)
    ks = keys(start, count)
    tally = {"ops": 0, "wrong": 0, "errors": 0, "hits": 0}
    out = torch.empty(NS.chunk_shape, dtype=torch.float16)
    outs = [torch.empty(NS.chunk_shape, dtype=torch.float16) for _ in range(8)]
    deadline = time.monotonic() + seconds

    def check(i: int, tensor: torch.Tensor) -> None:
        tally["hits"] += 1
        if not torch.equal(tensor.view(torch.int16), content(start + i).view(torch.int16)):
            tally["wrong"] += 1
            _say(f"WRONG {start + i}")

    while time.monotonic() < deadline:
        i = rng.randrange(count)
        op = rng.choice(["put", "put", "durable", "lz4", "get_into", "get_into", "get_many", "get", "blob",
                         "lookup", "contains", "pin", "unpin", "prefetch", "delete", "stats", "ping"])
        try:
            if op in ("put", "durable", "lz4"):
                client.put(ks[i], content(start + i), durable=op == "durable", codec="lz4" if op == "lz4" else None)
            elif op == "get_into":
                if client.get_into(ks[i], out):
                    check(i, out)
            elif op == "get_many":
                j = min(i, count - 8)
                for n in range(client.get_many_into(ks[j : j + 8], outs)):
                    check(j + n, outs[n])
            elif op == "get":
                for n, t in enumerate(client.get(ks[i : i + 4])):
                    check(i + n, t)
            elif op == "blob":
                if client.get_blob(ks[i]) is not None:
                    tally["hits"] += 1
            elif op == "lookup":
                client.lookup(ks[i : i + 8])
            elif op == "contains":
                client.contains(ks[i])
            elif op == "pin":
                client.pin(ks[i : i + 4], 1.0)
            elif op == "unpin":
                client.unpin(ks[i : i + 4])
            elif op == "prefetch":
                client.prefetch(ks[i : i + 4], wait=rng.random() < 0.5)
            elif op == "delete":
                client.delete(ks[i : i + 2])
            elif op == "stats":
                client.stats()
            else:
                client.ping()
        except DaemonError as exc:
            if exc.code.name != "RESOURCE_EXHAUSTED":
                tally["errors"] += 1
                _say(f"ERROR {op} {exc}")
        tally["ops"] += 1
    return tally


def main(argv: list[str]) -> int:
    mode, addr, token, transport, start, count = argv[:6]
    start, count = int(start), int(count)
    with Client(addr, token=token, transport=transport, timeout_s=30) as client:
        if mode == "get":
            get_loop(client, start, count)
        elif mode == "put":
            put_loop(client, start, count)
        elif mode == "pin":
            pin_and_hold(client, start, count)
        elif mode == "soak":
            _say("TALLY " + json.dumps(soak(client, start, count, float(argv[6]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
