"""How each ``kvbench daemon`` client authenticates: its credential, and the tenants file
that makes a daemon the benchmark starts know every one of them (one tenant per client,
each naming its own tenant in its namespace)."""

from __future__ import annotations

import dataclasses
import hashlib
import os


@dataclasses.dataclass(frozen=True)
class Credential:
    """How one client authenticates, and the tenant its namespace names."""

    token: str | None = None
    token_file: str | None = None
    tenant: str = ""


def tenants_file(root: str, count: int) -> tuple[str, list[Credential]]:
    """A tenants file with ``count`` tenants, and their credentials."""
    creds = [Credential(token=f"kvbench-token-{i}", tenant=f"bench{i}") for i in range(count)]
    path = os.path.join(root, "tenants.toml")
    with open(path, "w") as f:
        for c in creds:
            f.write(f'[tenants.{c.tenant}]\ntoken_sha256 = "{hashlib.sha256(c.token.encode()).hexdigest()}"\n')
    return path, creds
