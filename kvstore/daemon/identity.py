"""Who a caller is: the tenant its credential belongs to.

A tenant is an authenticated identity, never a field the client fills in. Three modes:

- no credentials: every caller is the one default tenant (loopback, single user);
- one bearer token (``auth_token_file``): every caller holding it is the default tenant;
- a tenants file (``tenants_file``, TOML, below): each tenant has its own bearer token (its
  SHA-256 is stored, not the token) and/or the common name of its client certificate (mutual
  TLS), its quotas, its access to the shared tenant and the label its metrics carry.

::

    [shared]                  # optional: chunks several tenants may use on purpose
    name = "system-prompts"   # a client names this tenant in its Namespace to address them
    host_bytes = "1GiB"       # its quotas (0 = none)
    disk_bytes = "8GiB"

    [tenants.alice]
    token_sha256 = "<hex>"    # printf %s "$TOKEN" | sha256sum
    cert_cn = "alice"         # with tls_client_ca: the client certificate's common name
    host_bytes = "4GiB"
    disk_bytes = "40GiB"
    shared = "read"           # none | read | write
    metrics_label = "team-a"  # default: tenant1, tenant2, ... in file order

Tenant names never leave the daemon (metrics use the labels).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass

from kvstore.config import ConfigError, config_from_dict
from kvstore.wire.auth import read_token_file

SHARED_ACCESS = ("none", "read", "write")
_NAME = re.compile(r"[A-Za-z0-9._@+-]{1,128}")
_BEARER = b"Bearer "


@dataclass(frozen=True)
class Tenant:
    name: str  # what the daemon binds the caller's namespaces to
    label: str  # what its metrics say instead of the name
    host_bytes: int = 0  # quotas; 0 = none
    disk_bytes: int = 0
    shared: str = "write"  # access to the shared tenant's chunks: none | read | write

    def may(self, access: str) -> bool:
        """Whether this tenant may ``access`` ("read" or "write") the shared tenant's chunks."""
        return SHARED_ACCESS.index(self.shared) >= SHARED_ACCESS.index(access)


DEFAULT = Tenant(name="", label="default")


@dataclass
class TenantConfig:
    """One ``[tenants.NAME]`` table of a tenants file."""

    token_sha256: str = ""
    cert_cn: str = ""
    host_bytes: int = 0
    disk_bytes: int = 0
    shared: str = "none"
    metrics_label: str = ""


@dataclass
class SharedTenantConfig:
    """The ``[shared]`` table of a tenants file."""

    name: str = ""
    host_bytes: int = 0
    disk_bytes: int = 0


class Credentials:
    """Maps what a caller presents (a bearer token, a client certificate) to its tenant."""

    def __init__(self, mode: str, by_token: dict[bytes, Tenant], by_cert: dict[str, Tenant],
                 shared: Tenant | None, anyone: Tenant | None = None, named: bool = False) -> None:
        self.mode = mode  # what the start-up line says
        self._by_token, self._by_cert, self._anyone = by_token, by_cert, anyone
        self._named = named  # tenants come from a file (certificates name them too)
        self.shared = shared
        self.tenants = sorted({*by_token.values(), *by_cert.values(), *([anyone] if anyone else [])},
                              key=lambda t: t.label)

    @classmethod
    def none(cls) -> "Credentials":
        return cls("off (every caller is one tenant; loopback only)", {}, {}, None, anyone=DEFAULT)

    @classmethod
    def single_token(cls, path: str) -> "Credentials":
        return cls("one bearer token (one tenant)", {_digest(read_token_file(path).encode()): DEFAULT}, {}, None)

    @classmethod
    def from_file(cls, path: str) -> "Credentials":
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        unknown = set(data) - {"shared", "tenants"}
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; known: ['shared', 'tenants']")
        tables = data.get("tenants", {})
        if not isinstance(tables, dict) or not tables:
            raise ConfigError(f"{path}: no [tenants.NAME] tables")
        shared = _shared_tenant(path, data.get("shared"))
        by_token: dict[bytes, Tenant] = {}
        by_cert: dict[str, Tenant] = {}
        labels: set[str] = set()
        for i, (name, table) in enumerate(tables.items(), 1):
            where = f"{path}: tenants.{name}"
            if not _NAME.fullmatch(name) or (shared is not None and name == shared.name):
                raise ConfigError(f"{where}: a tenant name is 1-128 of A-Z a-z 0-9 . _ @ + - and not the shared one")
            try:
                entry = config_from_dict(table, TenantConfig)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if entry.shared not in SHARED_ACCESS:
                raise ConfigError(f"{where}.shared: expected one of {SHARED_ACCESS}, got {entry.shared!r}")
            label = entry.metrics_label or f"tenant{i}"
            if not _NAME.fullmatch(label) or label in labels or label == "shared":
                raise ConfigError(f"{where}.metrics_label: {label!r} is not a unique label")
            labels.add(label)
            tenant = Tenant(name, label, entry.host_bytes, entry.disk_bytes, entry.shared)
            if not (entry.token_sha256 or entry.cert_cn):
                raise ConfigError(f"{where}: needs token_sha256 or cert_cn")
            if entry.token_sha256:
                try:
                    digest = bytes.fromhex(entry.token_sha256)
                except ValueError:
                    digest = b""
                if len(digest) != 32 or digest in by_token:
                    raise ConfigError(f"{where}.token_sha256: not a unique SHA-256 in hex")
                if digest == _digest(b""):
                    raise ConfigError(f"{where}.token_sha256: the SHA-256 of an empty token (was $TOKEN "
                                      "set?): anyone would be this tenant")
                by_token[digest] = tenant
            if entry.cert_cn:
                if entry.cert_cn in by_cert:
                    raise ConfigError(f"{where}.cert_cn: {entry.cert_cn!r} names two tenants")
                by_cert[entry.cert_cn] = tenant
        return cls(f"tenants file ({len(tables)} tenants{', shared tenant' if shared else ''})",
                   by_token, by_cert, shared, named=True)

    @property
    def all_tenants(self) -> list[Tenant]:
        """Every tenant, the shared one included."""
        return self.tenants + ([self.shared] if self.shared else [])

    @property
    def authenticated(self) -> bool:
        return self._anyone is None

    def token_valid(self, header: str | bytes | None) -> bool:
        return self._anyone is not None or self._of_token(header) is not None

    def identify(self, header: str | bytes | None, certificate_cn: bytes | None, certificates: bool) -> Tenant | None:
        """The caller's tenant from its ``authorization`` header, or, with mutual TLS
        (``certificates``), from its certificate's common name; None if neither is known."""
        if self._anyone is not None:
            return self._anyone
        if certificates:
            if certificate_cn is None:
                return None
            if not self._named:
                return DEFAULT  # the CA vouches for every certificate it signed
            return self._by_cert.get(certificate_cn.decode(errors="replace"))
        return self._of_token(header)

    def _of_token(self, header: str | bytes | None) -> Tenant | None:
        if header is None:
            return None
        value = header.encode() if isinstance(header, str) else header
        if not value.startswith(_BEARER) or not value[len(_BEARER):].strip():
            return None  # no token at all is nobody's, whatever the file says
        return self._by_token.get(_digest(value[len(_BEARER):]))


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _shared_tenant(path: str, table) -> Tenant | None:
    if table is None:
        return None
    try:
        entry = config_from_dict(table, SharedTenantConfig)
    except ConfigError as exc:
        raise ConfigError(f"{path}: shared: {exc}") from None
    if not _NAME.fullmatch(entry.name):
        raise ConfigError(f"{path}: shared.name: a name is 1-128 of A-Z a-z 0-9 . _ @ + -")
    return Tenant(entry.name, "shared", entry.host_bytes, entry.disk_bytes, "write")
