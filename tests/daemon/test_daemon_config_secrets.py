"""The Config RPC answered any authenticated tenant with the daemon's whole
configuration, credentials included: the Redis tier's URL with its password. With it, a
tenant reads (and could overwrite) every other tenant's chunks straight from Redis, which the
daemon's isolation promise (docs/daemon.md, "Isolation") rules out."""

import hashlib
import tomllib

import pytest
import redis
import torch

from helpers import in_process_daemon
from kvstore.client import Client
from kvstore.daemon.config import DaemonConfig
from kvstore.keys import Namespace, chunk_keys

SECRETS_NS = Namespace("secrets", 2, 2, 8, chunk_tokens=8)  # 1 KiB fp16 chunks
TOKENS = {"alice": "alice-token", "bob": "bob-token"}
PASSWORD = "hunter2-redis-password"


@pytest.fixture
def daemon(tmp_path, own_redis_server):
    admin = redis.Redis(host="127.0.0.1", port=own_redis_server.port)
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{n}]\ntoken_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n\n'
                               for n, t in TOKENS.items()))
    config = DaemonConfig(listen="127.0.0.1:0", tenants_file=str(tenants))
    config.shm.dir = str(tmp_path)
    config.store.host.capacity_bytes = 8 << 20
    config.store.host.page_bytes = 4096
    config.store.host.prefault = False
    config.store.disk.path = str(tmp_path / "data")
    config.store.disk.capacity_bytes = 16 << 20
    config.store.redis.enabled = True
    config.store.redis.url = f"redis://:{PASSWORD}@127.0.0.1:{own_redis_server.port}/0"
    config.store.redis.key_prefix = "kvs-secrets:"
    with in_process_daemon(config) as d:
        yield d


def test_a_tenant_cannot_learn_the_redis_password_and_read_another_tenants_chunks(daemon):
    key = chunk_keys(list(range(8)), SECRETS_NS)[0]
    secret = torch.full(SECRETS_NS.chunk_shape, 7.25, dtype=torch.float16)
    with Client(daemon.address, token=TOKENS["alice"], transport="grpc") as alice:
        alice.put(key, secret, durable=True)  # acknowledged once it is in Redis too

    with Client(daemon.address, token=TOKENS["bob"], transport="grpc") as bob:
        text = bob.config()
    url = tomllib.loads(text)["store"]["redis"]["url"]
    stolen = []
    try:
        r = redis.Redis.from_url(url, socket_timeout=5)
        for name in r.scan_iter(match="kvs-secrets:*"):
            value = r.get(name)
            if isinstance(value, bytes) and secret.numpy().tobytes() in value:
                stolen.append(name)
        r.close()
    except redis.exceptions.AuthenticationError:
        pass  # the URL bob got carries no usable password
    assert not stolen, f"tenant bob read alice's chunk from Redis with the URL the Config RPC gave it: {url}"
    assert PASSWORD not in text, "the Config RPC gives every tenant the Redis password"
