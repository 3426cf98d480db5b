"""The fuzzer: malformed and hostile messages to every RPC, garbage to the bulk port.

Messages are random bytes, valid requests mutated (bit flips, truncation, trailing garbage,
spliced fields), and valid requests with hostile values (absurd dimensions and counts, keys
of every length, foreign slot references, NaN and huge TTLs, Put streams that lie about
their length, blobs naming other keys). On the bulk port: garbage before the handshake,
forged handshakes, and random or mutated frames on an attached channel. Every answer must be
a status the daemon gives on purpose: INTERNAL or UNKNOWN would be a bug and is counted
apart. Seeded, so a failure replays.
"""

from __future__ import annotations

import random
import select
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import torch

from bench.attacks.target import NS, SHARED, TOKENS, Target, keys
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.blob import encode_header
from kvstore.client import DaemonError
from kvstore.codecs.raw import tensor_bytes
from kvstore.wire.convert import ns_to_proto
from kvstore.wire.frames import FRAME, GET, HELLO, PUT, RELEASE

METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]
BUGS = ("INTERNAL", "UNKNOWN")


@dataclass
class FuzzReport:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)  # status name -> count (gRPC); "OK" included
    bulk_frames: int = 0
    bulk_closed: int = 0  # connections the daemon cut off (broken framing, forged handshakes)
    bugs: list[str] = field(default_factory=list)  # INTERNAL/UNKNOWN answers, errors the daemon logged
    victim_bad: int = 0  # victim chunks read back wrong or not at all after the fuzzing

    def as_dict(self) -> dict:
        return {"sent": self.sent, "statuses": dict(self.statuses), "bulk_frames": self.bulk_frames,
                "bulk_closed": self.bulk_closed, "bugs": self.bugs[:20],
                "victim_bad": self.victim_bad}


class _Messages:
    """Hostile messages of every kind, from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def spec(self) -> pb.NamespaceSpec:
        r = self.rng
        spec = ns_to_proto(NS)
        for name, values in (("model_id", ["", "m" * r.randrange(200, 2000), "\x00\x1f", "é" * 50, NS.model_id]),
                             ("num_layers", [0, 1, 2, 2**32 - 1, 10**6]), ("num_kv_heads", [0, 2, 2**31]),
                             ("head_dim", [0, 32, 2**20]), ("chunk_tokens", [0, 32, 2**16]),
                             ("dtype", ["", "int8", "float16", "bfloat16", "x" * 100]),
                             ("layout", ["", "LKTHD", "KLTHD"]), ("tp_rank", [0, 1, 7]), ("tp_size", [0, 1, 2]),
                             ("tenant", ["", "victim", SHARED, "t" * 500])):
            if r.random() < 0.3:
                setattr(spec, name, r.choice(values))
        return spec

    def hashes(self) -> list[bytes]:
        r = self.rng
        real = [k.prefix_hash for k in keys(0, 8)]
        count = r.choice([0, 1, 3, 8, 4097])
        return [r.choice(real) if r.random() < 0.6 else r.randbytes(r.choice([0, 15, 16, 17, 32])) for _ in range(count)]

    def slot(self) -> pb.SlotRef:
        r = self.rng
        return pb.SlotRef(lease_id=r.getrandbits(63), index=r.choice([0, 1, 63, 64, 2**32 - 1]),
                          generation=r.getrandbits(64))

    def blob(self, ok_key: bool) -> bytes:
        r = self.rng
        key = keys(r.randrange(0, 64), 1)[0] if ok_key else keys(r.randrange(1000, 2000), 1)[0]
        value = torch.zeros(NS.chunk_shape, dtype=torch.float16)
        payload = bytes(tensor_bytes(value))
        blob = encode_header(key, r.choice([0, 0, 1, 77]), value.dtype, value.shape, payload) + payload
        if r.random() < 0.5:
            blob = self.mutate(blob)
        return blob

    def request(self, method: str):
        """A structured but hostile request for ``method`` (Put: a list of PutRequests)."""
        r = self.rng
        if method == "Put":
            header = pb.PutHeader(namespace=self.spec(), prefix_hash=r.choice(self.hashes() or [b""]),
                                  parent_hash=r.choice([b"", r.randbytes(16), r.randbytes(5)]),
                                  durable=r.random() < 0.3, blob_bytes=r.choice([0, 128, 16512, 2**40]))
            if r.random() < 0.3:
                header.slot.CopyFrom(self.slot())
            blob = self.blob(ok_key=r.random() < 0.5)
            pieces = [pb.PutRequest(header=header, data=blob[: r.randrange(0, len(blob) + 1)])]
            for _ in range(r.randrange(0, 4)):
                pieces.append(pb.PutRequest(data=r.randbytes(r.randrange(0, 5000)),
                                            header=header if r.random() < 0.1 else None))
            return pieces
        if method == "Get":
            hashes = self.hashes()
            request = pb.GetRequest(namespace=self.spec(), prefix_hashes=hashes, payload=r.choice([0, 1, 2, 99]),
                                    piece_bytes=r.choice([0, 1, 1000, 2**32 - 1]), pool_views=r.random() < 0.2)
            if r.random() < 0.3:
                request.slots.extend(self.slot() for _ in range(r.choice([len(hashes), 1, 3])))
            return request
        if method in ("Lookup", "Contains", "Unpin", "Delete"):
            return pb.KeysRequest(namespace=self.spec(), prefix_hashes=self.hashes())
        if method == "Prefetch":
            return pb.PrefetchRequest(namespace=self.spec(), prefix_hashes=self.hashes(), wait=r.random() < 0.2)
        if method in ("Pin", "PinLeading"):
            return pb.PinRequest(namespace=self.spec(), prefix_hashes=self.hashes(),
                                 ttl_s=r.choice([0.0, -1.0, float("nan"), float("inf"), 1e300, 0.01, 5.0]))
        if method == "Lease":
            return pb.LeaseRequest(slots=r.choice([0, 1, 16, 2**32 - 1]))
        if method in ("RenewLease", "ReleaseLease"):
            return pb.LeaseRef(lease_id=r.getrandbits(64))
        if method == "Stats":
            return pb.StatsRequest()
        return pb.BulkAttachRequest()

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        data = bytearray(data)
        for _ in range(r.randrange(1, 6)):
            choice = r.random()
            if choice < 0.4 and data:
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            elif choice < 0.6:
                data = data[: r.randrange(len(data) + 1)]
            elif choice < 0.8:
                data += r.randbytes(r.randrange(1, 64))
            elif data:
                at = r.randrange(len(data))
                data[at:at] = data[: r.randrange(len(data))]
        return bytes(data)

    def raw(self, method: str):
        """Wire bytes for ``method`` (Put: a list of them): random, mutated or structured."""
        r = self.rng
        structured = self.request(method)
        choice = r.random()
        if method == "Put":
            wire = [m.SerializeToString() for m in structured]
            if choice < 0.2:
                return [r.randbytes(r.randrange(0, 512)) for _ in range(r.randrange(0, 4))]
            return [self.mutate(w) if r.random() < 0.5 else w for w in wire]
        if choice < 0.2:
            return r.randbytes(r.randrange(0, 512))
        wire = structured.SerializeToString()
        return self.mutate(wire) if choice < 0.6 else wire


def _call(channel: grpc.Channel, method: str, payload, metadata, timeout_s: float) -> str:
    path = f"/kvstore.v1.KVStore/{method}"
    try:
        if method == "Put":
            channel.stream_unary(path)(iter(payload), timeout=timeout_s, metadata=metadata)
        elif method == "Get":
            for _ in channel.unary_stream(path)(payload, timeout=timeout_s, metadata=metadata):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=timeout_s, metadata=metadata)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def fuzz_grpc(target: Target, count: int, seed: int, report: FuzzReport, timeout_s: float = 10.0) -> None:
    rng = random.Random(seed)
    messages = _Messages(rng)
    channel = grpc.insecure_channel(target.addr)
    tokens = [((("authorization", f"Bearer {TOKENS['attacker']}"),), 0.85), ((), 0.05),
              ((("authorization", "Bearer " + "x" * 40),), 0.05), ((("authorization", "garbage"),), 0.05)]
    try:
        for _ in range(count):
            method = rng.choice(METHODS)
            metadata = rng.choices([t for t, _ in tokens], [w for _, w in tokens])[0]
            payload = messages.raw(method)
            status = _call(channel, method, payload, metadata, timeout_s)
            report.sent += len(payload) if method == "Put" else 1
            report.statuses[status] += 1
            if status in BUGS:
                report.bugs.append(f"{method} -> {status}")
    finally:
        channel.close()


def _attach(target: Target) -> tuple[socket.socket, int] | None:
    """An attached bulk connection (waiting while the fuzzer's own tokens, spent on BulkAttach
    calls it never used, keep its tenant at its session limit)."""
    with target.client("attacker", transport="grpc") as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = client._drive(client._core._call("BulkAttach", pb.BulkAttachRequest()))
                break
            except DaemonError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    sock = socket.create_connection(("127.0.0.1", reply.port), timeout=5)
    sock.sendall(HELLO.pack(reply.session, reply.token))
    if sock.recv(1) != b"\x01":
        sock.close()
        return None
    return sock, reply.port


def _drain(sock: socket.socket, wait_s: float = 0.05) -> bool:
    """Read what the daemon answers (waiting up to ``wait_s`` for a first byte); False once
    it closed the connection."""
    try:
        while select.select([sock], [], [], wait_s)[0]:
            if not sock.recv(1 << 16):
                return False
            wait_s = 0.005
    except OSError:
        return False
    return True


def fuzz_bulk(target: Target, count: int, seed: int, report: FuzzReport) -> None:
    rng = random.Random(seed + 1)
    messages = _Messages(rng)
    attached = _attach(target)
    if attached is None:
        raise RuntimeError("could not attach a bulk channel")
    sock, port = attached
    sent = 0
    while sent < count:
        choice = rng.random()
        if choice < 0.1:  # garbage, or a forged handshake, on a fresh connection
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            raw.sendall(rng.choice([rng.randbytes(rng.randrange(1, 200)),
                                    HELLO.pack(rng.getrandbits(64), rng.randbytes(32))]))
            report.bulk_closed += not _drain(raw)
            raw.close()
        else:
            kind = rng.choice([GET, PUT, RELEASE, GET, PUT, rng.randrange(256)])
            if kind == GET and rng.random() < 0.7:
                meta = messages.request("Get").SerializeToString()
            elif kind == PUT and rng.random() < 0.7:
                meta = messages.request("Put")[0].header.SerializeToString()
            else:
                meta = rng.randbytes(rng.randrange(0, 300))
            meta = messages.mutate(meta) if rng.random() < 0.3 else meta
            data = messages.blob(ok_key=rng.random() < 0.5) if kind == PUT and rng.random() < 0.6 else b""
            claimed = len(data) if rng.random() < 0.9 else rng.choice([0, len(data) + 7, 2**40])
            try:
                sock.sendall(FRAME.pack(kind, len(meta), claimed) + meta + data)
                alive = _drain(sock)
            except OSError:
                alive = False
            report.bulk_frames += 1
            if not alive:
                report.bulk_closed += 1
                sock.close()
                attached = _attach(target)
                if attached is None:
                    raise RuntimeError("could not attach a bulk channel")
                sock, port = attached
        sent += 1
        report.sent += 1
    sock.close()


def run(target: Target, messages: int, seed: int = 0) -> FuzzReport:
    """``messages`` in all: nine in ten to gRPC, the rest to the bulk port."""
    report = FuzzReport()
    fuzz_grpc(target, messages - messages // 10, seed, report)
    fuzz_bulk(target, messages // 10, seed, report)
    report.bugs += [line for line in target.process.log if "internal error" in line or "Traceback" in line]
    report.victim_bad = target.intact()
    return report
