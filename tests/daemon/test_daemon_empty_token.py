"""A tenants file whose ``token_sha256`` is the SHA-256 of the empty string
(what the documented recipe ``printf %s "$TOKEN" | sha256sum`` prints when $TOKEN is unset) is
taken, and then a caller with no secret at all, ``authorization: Bearer `` and nothing after,
is that tenant. The one-token mode refuses an empty token file; a tenants file must refuse the
empty token's hash as well."""

import hashlib

import pytest

from kvstore.config import ConfigError
from kvstore.daemon.identity import Credentials

EMPTY = hashlib.sha256(b"").hexdigest()
GOOD = hashlib.sha256(b"bob-token").hexdigest()


def test_the_empty_tokens_hash_is_refused_and_names_no_tenant(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.alice]\ntoken_sha256 = "{EMPTY}"\n\n[tenants.bob]\ntoken_sha256 = "{GOOD}"\n')
    try:
        credentials = Credentials.from_file(str(path))
    except ConfigError as exc:
        assert "tenants.alice" in str(exc)
        return
    tenant = credentials.identify("Bearer ", None, False)
    assert tenant is None, f"a caller with an empty bearer token is tenant {tenant.name!r}"
    pytest.fail("a tenants file with the hash of the empty token was accepted")
