import pytest

from kvstore.config import ConfigError, StoreConfig, config_from_dict, load_config, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("4096", 4096), ("8GiB", 8 << 30), ("1.5GB", 1_500_000_000), ("512 MiB", 512 << 20), ("10kb", 10_000), (7, 7)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "8 GiBs", "-1", -5, True, "1e9"])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_load_toml(tmp_path):
    path = tmp_path / "store.toml"
    path.write_text(
        """
eviction_policy = "lru"
[host]
capacity_bytes = "64MiB"
[disk]
path = "/tmp/kv"
capacity_bytes = "1GiB"
fsync = true
[placement]
enabled = true
codecs = ["int8"]
verdicts = ["bench/data/verdicts/SmolLM2-135M-Instruct.Q4_1.float16.json"]
quality_weight_s = 0.02
assumed_read_bytes_per_s = "2GB/s"
"""
    )
    cfg = load_config(path)
    assert cfg.placement.enabled and cfg.placement.codecs == ["int8"] and cfg.placement.quality_weight_s == 0.02
    assert cfg.placement.assumed_read_bytes_per_s == 2 * 10**9 and cfg.placement.tiers == ["host", "disk"]
    assert cfg.host.capacity_bytes == 64 << 20
    assert cfg.disk.capacity_bytes == 1 << 30 and cfg.disk.fsync and cfg.disk.path == "/tmp/kv"
    assert cfg.eviction_policy == "lru"
    assert config_from_dict({}) == StoreConfig()


@pytest.mark.parametrize(
    "data,where",
    [
        ({"hots": {}}, "hots"),
        ({"host": {"capacity": 1}}, "capacity"),
        ({"disk": {"fsync": "yes"}}, "disk.fsync"),
        ({"host": {"capacity_bytes": "big"}}, "host.capacity_bytes"),
        ({"host": 3}, "host"),
        ({"placement": {"lambda": 1}}, "placement"),
        ({"placement": {"codecs": "int8"}}, "placement.codecs"),
        ({"codec": "zstd"}, "codec: unknown codec 'zstd'"),
        ({"eviction_policy": "fifo"}, "eviction_policy: unknown policy 'fifo'"),
        ({"replicate_to": ["tape"]}, "replicate_to: unknown tiers"),
        ({"placement": {"tiers": ["tape"]}}, "placement.tiers: unknown tiers"),
        ({"placement": {"codecs": ["zstd"]}}, "placement.codecs: unknown codecs"),
        ({"write_behind": {"stall_s": 0}}, "write_behind.stall_s: must be positive"),
        ({"replication": {"mode": "some"}}, "replication.mode: expected"),
        ({"placement": {"pfs_read_bytes_per_s": -1}}, "placement.pfs_read_bytes_per_s: size must not be negative"),
    ],
)
def test_errors_name_the_key(data, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        config_from_dict(data)


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[host\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_a_nested_store_config_is_checked_at_load_with_its_key_path(tmp_path):
    from kvstore.daemon.config import DaemonConfig

    path = tmp_path / "daemon.toml"
    path.write_text('[store]\ncodec = "zstd"\n')
    with pytest.raises(ConfigError, match=r"^store\.codec: unknown codec 'zstd'"):
        load_config(path, DaemonConfig)
