"""The bearer token as it travels: ``authorization: Bearer <token>`` gRPC metadata, read from
a token file. The daemon checks it (kvstore/daemon/auth.py); the client sends it."""

from __future__ import annotations

from pathlib import Path

METADATA_KEY = "authorization"


def read_token_file(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token


def bearer(token: str) -> tuple[str, str]:
    return (METADATA_KEY, f"Bearer {token}")
