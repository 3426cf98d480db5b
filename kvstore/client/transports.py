"""Which way a client's chunk bytes travel, and the state behind that choice: the slot lease
(and retired ones), the idle bulk sessions, and when to try each again.

Chunk bytes take the fastest path available, chosen once per client:

- ``shm``: the daemon runs on this host (we can map its slot arena and read its nonce): a
  put's blob is copied into a leased shared-memory slot and only the slot reference
  travels; a get copies raw chunks straight out of the daemon's host pool (mapped
  read-only), others out of slots;
- ``bulk``: chunk bytes on a plain TCP connection attached with a one-time token;
- ``grpc``: bytes pieces inside gRPC messages (works everywhere, TLS included).

Gets and puts go over a bulk channel whenever the daemon offers one (shm included: gRPC
costs about as much per message as moving a 4 MiB chunk), else over gRPC. A request never
waits for a slot: with all of them busy it takes the socket path, and one whose bulk
connection is closed before the daemon's hello reply (a flood of connections without a
token fills the daemon's room for such connections) takes gRPC; bulk is tried again a
second later, the wait doubling up to a minute while it fails.

This state is shared by the client's threads: it changes only under ``_lock``, never held
across an effect.
"""

from __future__ import annotations

import secrets
import threading
import time
from contextlib import contextmanager

import grpc

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client.bulk import BulkSession
from kvstore.client.effects import Rpc
from kvstore.client.errors import DaemonError, slots_reusable
from kvstore.client.options import ClientOptions
from kvstore.client.shm import ShmLease

LEASE_AGAIN_S = 1.0  # after the daemon had no free slots for a lease
BULK_AGAIN_S = (1.0, 60.0)  # after a bulk connection did not attach: gRPC meanwhile, doubling per failure
UNANSWERED_KEPT = 16  # Lease requests without an answer to release by id: the latest so many


class Transports:
    def __init__(self, host: str, options: ClientOptions) -> None:
        self.host, self.options = host, options
        self._lock = threading.Lock()
        self._lease: ShmLease | None = None
        self._shm_tried = False  # and found shared memory out of reach (another host, shm off)
        self._lease_again_at = 0.0  # after "no free slots": when to ask again
        self._retired: list[ShmLease] = []  # leases to release once every slot of theirs came back
        self._unanswered: list[int] = []  # Lease requests that got no answer: released by their id
        self._idle: list[BulkSession] = []
        self._bulk_ok = not options.tls_ca  # the bulk channel is not encrypted
        self._bulk_again_at = 0.0  # after a bulk connection that did not attach: when to try again
        self._bulk_failed = 0  # bulk connections in a row that did not attach

    # -- the slot lease ---------------------------------------------------------------------

    def lease(self):
        """This client's lease, taken the first time (None: not on the daemon's host, or
        shared memory is not wanted)."""
        if self.options.transport in ("remote", "grpc"):
            return None
        yield from self.release_retired()
        lease = self._lease
        if lease is not None:
            if not lease.fresh():
                asked = lease.clock()
                yield Rpc("RenewLease", pb.LeaseRef(lease_id=lease.lease_id))
                lease.renewed(asked)
            return lease
        if self.options.transport == "auto" and (self._shm_tried or time.monotonic() < self._lease_again_at):
            return None
        request_id = secrets.randbits(63) or 1
        try:
            reply = yield Rpc("Lease", pb.LeaseRequest(slots=self.options.shm_slots, request_id=request_id))
        except BaseException as exc:
            if not slots_reusable(exc):  # no answer (a deadline, a cancellation): it may be granted all the same
                with self._lock:
                    self._unanswered = (self._unanswered + [request_id])[-UNANSWERED_KEPT:]
            if not isinstance(exc, DaemonError):
                raise
            if self.options.transport == "shm" or exc.code == grpc.StatusCode.UNAVAILABLE:
                raise  # unreachable now (restarting, say), not "no shared memory": the call is retried
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED or not slots_reusable(exc):  # all slots leased
                self._lease_again_at = time.monotonic() + LEASE_AGAIN_S
            else:
                self._shm_tried = True
            return None
        try:
            lease = ShmLease(reply)
        except OSError as exc:
            self._shm_tried = True  # not on the daemon's host
            yield Rpc("ReleaseLease", pb.LeaseRef(lease_id=reply.lease_id))
            if self.options.transport == "shm":
                raise DaemonError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"shared memory is not reachable from this host: {exc}") from None
            return None
        with self._lock:
            if self._lease is None:
                self._lease = lease
                return lease
            lease.retire()  # another thread leased meanwhile
            self._retired.append(lease)
            return self._lease

    def retire(self, lease: ShmLease) -> None:
        """Never hand out this lease's slots again (see kvstore/client/shm.py)."""
        with self._lock:
            if self._lease is lease:
                self._lease, self._shm_tried = None, False
            if lease.retire():
                self._retired.append(lease)

    def release_retired(self):
        """Release the retired leases none of whose slots a request of this client still
        uses (the others wait for a later call, or expire at the daemon), and whatever the
        Lease requests that got no answer were granted. Interrupted (KeyboardInterrupt, a
        cancellation), it keeps what it has not released yet for the next call or ``close``
        (releasing one twice is harmless: the daemon ignores a lease it no longer has)."""
        with self._lock:
            ready = [lease for lease in self._retired if lease.releasable()]
            self._retired = [lease for lease in self._retired if lease not in ready]
            unanswered, self._unanswered = self._unanswered, []
        for lease in ready:
            lease.unregister_from_cuda()
        refs = [pb.LeaseRef(request_id=r) for r in unanswered]
        refs += [pb.LeaseRef(lease_id=lease.lease_id) for lease in ready]
        for n, ref in enumerate(refs):
            try:
                yield Rpc("ReleaseLease", ref)
            except DaemonError:
                pass  # a lease not released expires at the daemon
            except BaseException:
                with self._lock:
                    self._unanswered = (unanswered[n:] + self._unanswered)[-UNANSWERED_KEPT:]
                    self._retired += ready[max(0, n - len(unanswered)):]
                raise

    @contextmanager
    def using(self, lease: ShmLease, slots):
        """Give ``slots`` back once their request is over; retire the lease if the request
        ended without an answer (the daemon may still be using them)."""
        try:
            yield
        except BaseException as exc:
            if not slots_reusable(exc):
                self.retire(lease)
            raise
        finally:
            lease.give(slots)

    # -- bulk sessions ----------------------------------------------------------------------

    def session(self):
        """An attached bulk session (idle or new), or None where there is none to have."""
        if self.options.transport == "grpc" or not self._bulk_ok:
            return None
        with self._lock:
            if self._idle:
                return self._idle.pop()  # attached already: a flood does not touch it
        if time.monotonic() < self._bulk_again_at:
            return None
        try:
            reply = yield Rpc("BulkAttach", pb.BulkAttachRequest())
        except DaemonError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                self._bulk_ok = False  # the daemon has no bulk channel: use gRPC
                return None
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # too many sessions right now: this call uses gRPC
            raise
        try:
            session = yield from BulkSession.open(self.host, reply)
        except OSError:
            # Closed or refused before the hello reply: anyone can fill the daemon's room for
            # connections without a token (max_unauthenticated), and retrying on that port
            # would fail the call. This call uses gRPC; bulk is tried again later, and less
            # often while it keeps failing (a port that times out costs a whole timeout).
            first, most = BULK_AGAIN_S
            self._bulk_again_at = time.monotonic() + min(most, first * 2 ** self._bulk_failed)
            self._bulk_failed += 1
            return None
        self._bulk_failed = 0
        return session

    def done_with(self, session: BulkSession | None, ok: bool):
        """Keep a session for the next call, or close it: after a failure its state is unknown."""
        if session is None:
            return
        if ok:
            with self._lock:
                self._idle.append(session)
        else:
            yield from session.close()

    # -- both -------------------------------------------------------------------------------

    def leased(self) -> bool:
        """Whether this client holds a lease now (chunk bytes go through shared memory), known
        without asking the daemon."""
        return self._lease is not None

    def leased_for_cuda(self) -> bool:
        """Whether this client holds a lease whose maps are registered with CUDA (registering
        them the first time it is asked), known without asking the daemon."""
        lease = self._lease
        return lease is not None and lease.register_with_cuda()

    def path(self):
        """The transport chunk bytes take now: "shm", "bulk" or "grpc"."""
        if (yield from self.lease()) is not None:
            return "shm"
        session = yield from self.session()
        yield from self.done_with(session, True)
        return "grpc" if session is None else "bulk"

    def drop(self):
        """Retire the lease and close the idle sessions: the next request takes fresh ones."""
        with self._lock:
            lease, idle, self._idle = self._lease, self._idle, []
        if lease is not None:
            self.retire(lease)
        for session in idle:
            yield from session.close()

    def close(self):
        """Release the lease (and any retired one) and close the bulk sessions."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            self.retire(lease)
        yield from self.release_retired()
        yield from self.drop()
