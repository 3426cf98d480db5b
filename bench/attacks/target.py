"""The daemon every attack runs against: a real process on loopback with tenants on (an
attacker, a victim, a shared tenant), short lease and pin deadlines, its files in a
temporary directory; and the victim's chunks, whose bytes every attack checks at the end."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field

import torch

from kvstore.client import Client
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

TOKENS = {"attacker": "attacker-token", "victim": "victim-token", "writer": "writer-token"}
SHARED = "system"
NS = Namespace("attack-model", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)  # 16 KiB fp16


def content(i: int, ns: Namespace = NS) -> torch.Tensor:
    """The bytes chunk ``i`` of an attack's workload always holds (so any read can be checked)."""
    gen = torch.Generator().manual_seed(i)
    return torch.randn(ns.chunk_shape, generator=gen).to(getattr(torch, ns.dtype))


def keys(start: int, n: int, ns: Namespace = NS):
    return chunk_keys(list(range(start * ns.chunk_tokens, (start + n) * ns.chunk_tokens)), ns)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Target:
    """A running daemon under attack; ``victim_keys`` hold ``content(i)``."""

    process: DaemonProcess
    root: str
    victim_keys: list = field(default_factory=list)

    @property
    def addr(self) -> str:
        return self.process.addr

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def client(self, tenant: str = "victim", **kw) -> Client:
        return Client(self.addr, token=TOKENS[tenant], **kw)

    def intact(self) -> int:
        """How many victim chunks read back wrong or not at all (0: the victim lost nothing)."""
        bad = 0
        with self.client("victim", transport="grpc", timeout_s=60) as client:
            for i, k in enumerate(self.victim_keys):
                out = torch.empty(NS.chunk_shape, dtype=torch.float16)
                if not client.get_into(k, out) or not torch.equal(out.view(torch.int16), content(i).view(torch.int16)):
                    bad += 1
        return bad

    def serving(self) -> bool:
        with self.client("victim", transport="grpc", timeout_s=10) as client:
            return client.ping()[0] == "SERVING"


def tenants_toml(tenant_extra: dict[str, str] | None = None) -> str:
    """The tenants file; ``tenant_extra[name]`` is appended to that tenant's table (quotas)."""
    text = f'[shared]\nname = "{SHARED}"\n'
    for name, access in (("attacker", "read"), ("victim", "read"), ("writer", "write")):
        text += (f'\n[tenants.{name}]\ntoken_sha256 = "{hashlib.sha256(TOKENS[name].encode()).hexdigest()}"\n'
                 f'shared = "{access}"\n{(tenant_extra or {}).get(name, "")}')
    return text


def start(root: str | None = None, victims: int = 32, extra: str = "", data_dir: str | None = None,
          prefault: bool = False, tenant_extra: dict[str, str] | None = None, **spawn) -> Target:
    """Start a target daemon (in ``root``, or a new temporary directory) holding ``victims``
    victim chunks, durable, its host pool ``prefault``ed or not. ``extra`` is appended to its
    TOML config (tables other than [shm], [bulk], [store.host] and [store.disk]);
    ``tenant_extra`` to tenants' tables of the tenants file."""
    root = root or tempfile.mkdtemp(prefix="kvbench-attack-")
    with open(os.path.join(root, "tenants.toml"), "w") as f:
        f.write(tenants_toml(tenant_extra))
    config = os.path.join(root, "daemon.toml")
    with open(config, "w") as f:
        f.write(f'listen = "127.0.0.1:0"\ntenants_file = "{os.path.join(root, "tenants.toml")}"\n'
                f'[shm]\ndir = "{root}"\nslots = 64\nslot_bytes = "64KiB"\nlease_ttl_s = 2.0\n'
                f'[bulk]\npin_ttl_s = 2.0\nhello_timeout_s = 1.0\n'
                f'[store.host]\ncapacity_bytes = "64MiB"\npage_bytes = 4096\nprefault = {str(prefault).lower()}\n'
                f'[store.disk]\npath = "{data_dir or os.path.join(root, "data")}"\ncapacity_bytes = "256MiB"\n'
                f'{extra}')
    target = Target(DaemonProcess(["--config", config], **spawn), root)
    target.victim_keys = keys(0, victims)
    if victims:
        with target.client("victim") as client:
            for i, k in enumerate(target.victim_keys):
                client.put(k, content(i), durable=True)
    return target
