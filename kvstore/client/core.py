"""The client's operations, written once for both fronts: the calls in flight, the index calls
(lookup, pin, delete, stats...), and the parts that move chunk bytes.

Every operation is a generator that yields I/O effects (kvstore/client/effects.py) and
returns the operation's result; the sync front (kvstore/client/sync.py) performs each effect
blocking, the async front (kvstore/client/aio.py) awaits it. So a fix here is a fix in both.

The parts, each in its own module: which way bytes travel and the slot lease and bulk
sessions behind it (transports.py), retries (retries.py), request messages and the
namespaces they named (requests.py), puts (put_path.py) and reads (read_path.py).

torch (and the blob and codec modules, which need it) is imported in the methods that take
or make tensors, not with this module: ``kvstore ping`` and ``stats`` start in a fraction of
a second, and a client that moves only blobs never loads it.

The fronts run every operation through ``call``, so that ``close`` can refuse new calls and
wait for those in flight before it gives the lease and the sessions back.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Sequence

import grpc
from grpc_health.v1 import health_pb2

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client.effects import CallsDone
from kvstore.client.errors import DaemonError
from kvstore.client.options import ClientOptions
from kvstore.client.put_path import PutPath
from kvstore.client.read_path import ReadPath
from kvstore.client.requests import Requests
from kvstore.client.retries import Retrier
from kvstore.client.transports import Transports
from kvstore.keys import ChunkKey
from kvstore.wire.malloc import keep_large_blocks_in_heap
from kvstore.wire.auth import bearer, read_token_file
from kvstore.wire.convert import split_host_port, stats_from_proto

if TYPE_CHECKING:
    import torch


class ClientCore:
    def __init__(self, addr: str, options: ClientOptions) -> None:
        self.addr, self.options = addr, options
        host, _ = split_host_port(addr)
        if options.tune_malloc:
            keep_large_blocks_in_heap()
        token = read_token_file(options.token_file) if options.token_file else options.token
        self.metadata = (bearer(token),) if token else ()
        self.tls = None  # (root certificates, private key, certificate chain) for TLS
        if options.tls_ca:
            self.tls = tuple(None if p is None else open(p, "rb").read()
                             for p in (options.tls_ca, options.tls_key, options.tls_cert))
        self.transports = Transports(host, options)
        self.retrier = Retrier(options, self.transports)
        self.requests = Requests()
        self.puts = PutPath(options, self.transports, self.retrier, self.requests)
        self.reads = ReadPath(options, self.transports, self.retrier, self.requests)
        self._lock = threading.Lock()
        self._calls = 0  # operations running now (``call``)
        self._closing = False  # ``close`` began: new operations are refused
        self._calls_done = threading.Condition(self._lock)

    # -- calls ------------------------------------------------------------------------------

    def call(self, op):
        """Run the operation ``op`` (a generator of this core) as one call of the client:
        refused once ``close`` began, counted until it ends so that ``close`` waits for it."""
        with self._lock:
            if self._closing:
                raise DaemonError(grpc.StatusCode.CANCELLED, "the client is closed")
            self._calls += 1
        try:
            return (yield from op)
        finally:
            with self._lock:
                self._calls -= 1
                self._calls_done.notify_all()

    def wait_calls_done(self) -> None:
        """Block until no operation runs (``close`` refuses new ones first)."""
        with self._lock:
            self._calls_done.wait_for(lambda: self._calls == 0)

    def _call(self, method: str, request, health: bool = False):
        return self.retrier.rpc(method, request, health)

    def path(self):
        """The transport chunk bytes take now: "shm", "bulk" or "grpc"."""
        return self.transports.path()

    def hands_over_in_place(self, device: torch.device | str = "cpu") -> bool:
        """``HandsOverChunks.hands_over_in_place``: a lease is held (the daemon's host pool is
        mapped here), and for a CUDA ``device`` its maps are registered with CUDA. No I/O: a
        load asks it before it reads, and must not fail on it."""
        if str(device).startswith("cuda"):
            return self.transports.leased_for_cuda()
        return self.transports.leased()

    # -- chunk bytes ------------------------------------------------------------------------

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None, durable: bool = False,
            codec=None):
        """Store one chunk (encoded here, verified by the daemon); ``codec`` as ``Store.put``'s."""
        return self.puts.put(key, kv, parent=parent, durable=durable, codec=codec)

    def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: ChunkKey | bytes | None = None,
                 durable: bool = False):
        """Store an encoded blob (header + payload, possibly in pieces)."""
        return self.puts.put_blob(key, parts, parent=parent, durable=durable)

    def get_into(self, key: ChunkKey, out: torch.Tensor):
        """Load a chunk into ``out`` (contiguous CPU tensor of the chunk's shape); False on a miss."""
        return self.reads.get_into(key, out)

    def get(self, keys: Sequence[ChunkKey]):
        """The leading chunks of ``keys`` that are present, in order (stops at the first miss)."""
        return self.reads.get(keys)

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]):
        """Load the leading present chunks into ``outs`` (reused buffers); returns how many.
        When it returns (or raises), nothing writes into ``outs`` any more."""
        return self.reads.get_many_into(keys, outs)

    def get_with(self, keys: Sequence[ChunkKey], consume):
        """Hand each leading present chunk of ``keys`` to ``consume(index, tensor)`` as a
        read-only tensor of the chunk's shape, valid only during the call; ``consume``
        returns False to take no more. Returns how many it took.

        Why: a caller that copies a chunk somewhere anyway (the vLLM connector, into its paged
        cache) reads it straight out of the daemon's host pool, mapped here read-only and
        pinned until the Get is released: one copy instead of two (pool to buffer, buffer to
        blocks)."""
        return self.reads.get_with(keys, consume)

    def get_blob(self, key: ChunkKey):
        """The verified blob (header + encoded payload) of a chunk, or None on a miss."""
        return self.reads.get_blob(key)

    # -- index operations -------------------------------------------------------------------

    def _count(self, method: str, cls, keys: Sequence[ChunkKey], **kw):
        if not keys:
            return 0
        return (yield from self._call(method, self.requests.keys_request(cls, keys, **kw))).count

    def lookup(self, keys: Sequence[ChunkKey]):
        """How many leading keys are present."""
        return (yield from self._count("Lookup", pb.KeysRequest, keys))

    def contains(self, key: ChunkKey):
        return (yield from self._call("Contains", self.requests.keys_request(pb.KeysRequest, [key]))).present[0]

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float):
        if not ttl_s > 0:  # as the in-process Store: a pin without a lease is the caller's error
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        return (yield from self._count("Pin", pb.PinRequest, keys, ttl_s=ttl_s))

    def pin_leading(self, keys: Sequence[ChunkKey], ttl_s: float):
        """Pin the leading present keys in one call; how many (``ChunkStore.pin_leading``)."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        return (yield from self._count("PinLeading", pb.PinRequest, keys, ttl_s=ttl_s))

    def unpin(self, keys: Sequence[ChunkKey]):
        return (yield from self._count("Unpin", pb.KeysRequest, keys))

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = False):
        """Ask the daemon to promote chunks held only in slower tiers; one completed future per
        promotion started or already running (with ``wait``: once they are done)."""
        count = yield from self._count("Prefetch", pb.PrefetchRequest, keys, wait=wait)
        futures = [Future() for _ in range(count)]
        for f in futures:
            f.set_result(None)
        return futures

    def delete(self, keys: Sequence[ChunkKey]):
        return (yield from self._count("Delete", pb.KeysRequest, keys))

    def pause(self, session: str, keys: Sequence[ChunkKey], expected_s: float | None = None,
              ttl_s: float | None = None):
        """An agent session paused (advisory): the daemon pins ``keys`` (one namespace) for the
        lease (``ttl_s``, else from the expected stall) and remembers them under ``session``,
        so a later ``resume_soon`` by session id alone warms them; the count pinned."""
        return (yield from self._count("Pause", pb.PauseRequest, keys, session=session,
                                       expected_s=expected_s or 0.0, ttl_s=ttl_s or 0.0))

    def resume_soon(self, session: str, eta_s: float = 0.0):
        """The session's next turn comes in about ``eta_s`` (advisory): the daemon prefetches
        the chunks it paused with into host RAM; the promotions started (0: unknown session)."""
        return (yield from self._call("ResumeSoon", pb.ResumeRequest(session=session, eta_s=eta_s))).count

    def stats_reply(self):
        """The daemon's full stats message (Store stats plus address, free slots, sessions)."""
        return (yield from self._call("Stats", pb.StatsRequest()))

    def stats(self):
        return stats_from_proto((yield from self.stats_reply()))

    def config(self):
        """The daemon's effective configuration as TOML (``load_config`` reads it)."""
        return (yield from self._call("Config", pb.ConfigRequest())).toml

    def ping(self):
        """The daemon's health status name and the round-trip time in seconds."""
        start = time.perf_counter()
        reply = yield from self._call("Check", health_pb2.HealthCheckRequest(), health=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), time.perf_counter() - start

    def close(self):
        """Refuse new calls, wait for those in flight (they may still copy into or out of
        slots, and into their callers' memory), then release the lease (and any retired
        one) and close the bulk sessions."""
        with self._lock:
            self._closing = True
        yield CallsDone()
        yield from self.transports.close()


MAX_MESSAGE_BYTES = 64 << 20


def channel_for(core: ClientCore, module):
    """A channel of ``grpc`` or ``grpc.aio`` with the client's options and credentials."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if core.tls is None:
        return module.insecure_channel(core.addr, options=options)
    root, key, chain = core.tls
    creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    return module.secure_channel(core.addr, creds, options=options)
