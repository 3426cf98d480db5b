"""``kvbench daemon --processes N``: N client processes, each its own tenant and chunks,
told to get at once in every round; their aggregate GB/s. The same module is each process's
side (``--worker``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from bench.daemon_credentials import Credential
from bench.limits import GB
from kvstore.client import Client
from kvstore.keys import ChunkKey, Namespace


def worker(args, ns: Namespace) -> int:
    """One of ``--processes``: put its chunks, say ``ready`` on stdout, then for each line on
    stdin get in a loop for ``--seconds`` and answer one JSON line; end when stdin closes. A
    Ctrl-C in a terminal reaches it too: it leaves the ending to its parent, which kills it and
    alone says so."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    ns = dataclasses.replace(ns, tenant=args.tenant)
    with Client(args.addr, transport=args.transport, token=args.token, token_file=args.auth_token_file,
                timeout_s=60) as client:
        chunk = torch.randn(ns.chunk_shape).to(torch.float16)
        keys = [ChunkKey(ns, hashlib.blake2b(f"{args.tenant}/{n}".encode(), digest_size=16).digest())
                for n in range(args.keys)]
        for k in keys:
            client.put(k, chunk)
        batch = min(args.batch, args.keys)
        outs = [torch.zeros_like(chunk) for _ in range(batch)]
        print("ready", flush=True)
        for _ in sys.stdin:  # blocks between rounds, spending no CPU the paths measured meanwhile need
            start = time.perf_counter()
            deadline, n = start + args.seconds, 0
            while time.perf_counter() < deadline:
                first = (n * batch) % (len(keys) - batch + 1)
                if client.get_many_into(keys[first : first + batch], outs) != batch:
                    raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
                n += 1
            elapsed = time.perf_counter() - start
            print(json.dumps({"bytes": n * batch * chunk.numel() * 2, "elapsed": elapsed}), flush=True)
    return 0


class Aggregate:
    """``--processes`` client processes of one transport, started once and told to get at once
    in every round: their aggregate GB/s."""

    def __init__(self, addr: str, transport: str, args, creds: list[Credential]) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.procs = []
        try:
            for c in creds[: args.processes]:
                cmd = [sys.executable, "-m", "bench", "daemon", "--worker", "--addr", addr, "--transport",
                       transport, "--tenant", c.tenant, "--chunk-bytes", args.chunk_bytes, "--seconds",
                       str(args.seconds), "--keys", str(args.keys), "--batch", str(args.batch)]
                cmd += ["--token", c.token] if c.token else ["--auth-token-file", c.token_file] if c.token_file else []
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                                   env={**os.environ, "PYTHONPATH": root}))
            if any(p.stdout.readline().strip() != "ready" for p in self.procs):
                raise RuntimeError("a benchmark client process failed to start")
        except BaseException:
            self.close()
            raise

    def round(self) -> dict:
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [p.stdout.readline() for p in self.procs]
        if not all(lines):
            raise RuntimeError("a benchmark client process failed")
        results = [json.loads(line) for line in lines]
        total = sum(r["bytes"] for r in results)
        return {"processes": len(results), "get_gbps": total / max(r["elapsed"] for r in results) / GB,
                "per_process_gbps": [r["bytes"] / r["elapsed"] / GB for r in results]}

    def close(self) -> None:
        """Each process ends when its stdin closes; one that does not within a minute is killed."""
        for p in self.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

