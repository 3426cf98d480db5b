"""Where a Get's chunks go on the client: copies out of slots and the host pool, and the
sink for chunks that arrive as bytes (gRPC pieces or bulk frames)."""

from __future__ import annotations

import warnings

import grpc
import numpy as np

from kernels.parallel_copy import copy_hashing, copy_pairs
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client.errors import DaemonError


def _bytes(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def copy_parts(dst: memoryview, views) -> None:
    """Concatenate ``views`` into ``dst``, on all cores when big (kernels/parallel_copy.py)."""
    pairs, off = [], 0
    for v in views:
        pairs.append((_bytes(dst[off : off + v.nbytes]), _bytes(v)))
        off += v.nbytes
    copy_pairs(pairs)


def seal_into(dst: memoryview, blob) -> None:
    """An ``UnsealedBlob`` (kvstore/blob.py) written into ``dst``: its payload copied after
    the header's room and hashed by the copy threads as it lands (one pass over the bytes,
    not a hash pass and a copy pass), then the header packed from that checksum in front."""
    from kvstore.blob import HEADER_BYTES

    payload = _bytes(blob.payload)
    copy_hashing([(_bytes(dst[HEADER_BYTES : HEADER_BYTES + payload.size]), payload)], blob.restart())
    dst[:HEADER_BYTES] = blob.seal()


def copy_out(placed, pool: memoryview | None) -> None:
    """Chunks' bytes into their ``dst``: for each (dst, reply, slot), from the host pool
    ranges the reply names, else its slot; all in one copy over every core (one hand-off
    to the copy threads for the whole Get, not one a chunk)."""
    pairs = []
    for dst, reply, slot in placed:
        runs = reply.pool_runs
        if not runs:
            pairs.append((_bytes(dst), _bytes(slot[: reply.chunk_bytes])))
            continue
        if pool is None or sum(runs[1::2]) != dst.nbytes or any(o + n > pool.nbytes for o, n in zip(runs[::2], runs[1::2])):
            raise DaemonError(grpc.StatusCode.INTERNAL, "the daemon named host pool ranges that do not fit the chunk")
        off = 0
        for start, length in zip(runs[::2], runs[1::2]):
            pairs.append((_bytes(dst[off : off + length]), _bytes(pool[start : start + length])))
            off += length
    copy_pairs(pairs)


def merged_runs(runs) -> list[tuple[int, int]]:
    """A reply's flat ``pool_runs`` (offset, length, offset, length, ...) as (offset, length)
    pairs, adjacent ones joined: pages the pool allocated back to back are one piece."""
    out: list[tuple[int, int]] = []
    for start, length in zip(runs[::2], runs[1::2]):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


class Lender:
    """``ClientCore.get_with``'s chunks, handed to ``consume(index, tensor)`` in order while the
    daemon keeps them pinned; it stops at the first ``consume`` that returns False."""

    def __init__(self, ns, consume) -> None:
        self.ns, self.consume = ns, consume
        self.taken = 0  # leading chunks consumed (a retried Get hands the same ones again)
        self.stopped = False

    def wants(self) -> bool:
        return not self.stopped

    def _lend(self, index: int, view) -> None:
        if index < self.taken:  # a retried Get hands over what an earlier attempt did
            return
        if self.stopped or index > self.taken:
            self.stopped = True  # a chunk missing in between: the rest is not a prefix
            return
        import torch

        with warnings.catch_warnings():  # read-only by contract: consume only reads it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=self.ns.torch_dtype).view(self.ns.chunk_shape)
        if self.consume(index, tensor):
            self.taken = max(self.taken, index + 1)
        else:
            self.stopped = True

    def _pooled_view(self, reply, pool: memoryview | None, spare) -> memoryview:
        """A reply's chunk: straight from the host pool when it lies there in one piece, else
        gathered into ``spare()`` (or already there: a slot the daemon filled)."""
        chunk_bytes = self.ns.chunk_bytes
        if reply.chunk_bytes != chunk_bytes:
            raise DaemonError(grpc.StatusCode.INTERNAL, f"chunk of {reply.chunk_bytes} bytes, {chunk_bytes} expected")
        runs = merged_runs(reply.pool_runs)
        if len(runs) == 1 and pool is not None and runs[0][0] + chunk_bytes <= pool.nbytes:
            return pool[runs[0][0]: runs[0][0] + chunk_bytes]
        view = spare()
        if runs:
            copy_out([(view, reply, None)], pool)
        return view

    def lend_placed(self, placed, pool: memoryview | None) -> None:
        """For each (index, reply, slot): the chunk straight from the host pool when it lies
        there in one piece, else gathered into its slot (ours again once the Get is answered)."""
        for index, reply, slot in sorted(placed, key=lambda p: p[0]):
            self._lend(index, self._pooled_view(reply, pool, lambda: slot[: self.ns.chunk_bytes]))
            if self.stopped:
                return

    def lend_streamed(self, outs, pooled, pool: memoryview, base: int) -> None:
        """The chunks of a Get without slots, in order from index ``base``: those that came as
        bytes, in ``outs``; those named by the replies in ``pooled`` (index in ``outs`` ->
        reply), straight from the host pool where they lie in one piece, else gathered into
        a fresh buffer."""
        for i, out in enumerate(outs):
            reply = pooled.get(i)
            if reply is not None:
                out = self._pooled_view(reply, pool, lambda: memoryview(bytearray(self.ns.chunk_bytes)))
            elif out is None:
                return  # the Get ended before it
            self._lend(base + i, out)
            if self.stopped:
                return


def check_size(out: memoryview, chunk_bytes: int) -> None:
    if out.nbytes != chunk_bytes:
        raise DaemonError(grpc.StatusCode.INTERNAL, f"chunk of {chunk_bytes} bytes for a {out.nbytes}-byte tensor")


class StreamSink:
    """Where the chunks of a Get that carries bytes (gRPC pieces or bulk frames) go: into
    ``outs`` (views to fill, or None entries replaced by new buffers)."""

    def __init__(self, outs: list) -> None:
        self.outs, self.got = outs, 0
        self._buf, self._off = None, 0

    def take(self, reply: pb.GetReply, data_len: int, bulk: bool) -> memoryview | None:
        """Place one reply's bytes: inline pieces are copied here; for a bulk frame, the view
        to receive its ``data_len`` bytes into is returned."""
        if not 0 <= reply.index < len(self.outs):
            raise DaemonError(grpc.StatusCode.INTERNAL, f"reply for chunk {reply.index} of {len(self.outs)}")
        out = self.outs[reply.index]
        if reply.chunk_bytes:
            if out is not None:
                check_size(out, reply.chunk_bytes)
            self._buf = out if out is not None else memoryview(bytearray(reply.chunk_bytes))
            self._off = 0
        if self._buf is None:
            raise DaemonError(grpc.StatusCode.INTERNAL, "a chunk's piece arrived before its first one")
        if bulk:
            if data_len != reply.chunk_bytes:
                raise ConnectionError(f"bulk chunk of {data_len} bytes announced as {reply.chunk_bytes}")
            return self._buf[:data_len]
        data = reply.data  # each access copies: read it once
        if self._off + len(data) > self._buf.nbytes:
            raise DaemonError(grpc.StatusCode.INTERNAL, "a chunk's pieces are longer than the chunk")
        self._buf[self._off : self._off + len(data)] = data
        self._off += len(data)
        return None

    def pooled(self, reply: pb.GetReply, data_len: int) -> pb.GetReply:
        """A reply naming the chunk's pool ranges instead of carrying its bytes: counted."""
        if not 0 <= reply.index < len(self.outs) or data_len or not reply.last:
            raise DaemonError(grpc.StatusCode.INTERNAL, f"pool ranges for chunk {reply.index} of {len(self.outs)} "
                                                        f"with {data_len} bytes")
        out = self.outs[reply.index]
        if out is not None:
            check_size(out, reply.chunk_bytes)
        self.got += 1
        return reply

    def pooled_into(self, pooled) -> list:
        """(dst, reply, None) for ``copy_out``: each pooled chunk's place in ``outs``, a new
        buffer where none was given."""
        placed = []
        for index, reply in pooled.items():
            if self.outs[index] is None:
                self.outs[index] = memoryview(bytearray(reply.chunk_bytes))
            placed.append((self.outs[index], reply, None))
        return placed

    def done(self, reply: pb.GetReply) -> None:
        if reply.last:
            if self.outs[reply.index] is None:
                self.outs[reply.index] = self._buf
            self.got += 1
