"""What the connector reports: per-request and engine totals, the Prometheus endpoint, and
``python -m engine generate --connector`` (a TOML configuration; its errors are one line)."""

import json
import urllib.request

import pytest

from connector import ConnectorConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.__main__ import main as engine_main
from engine.prometheus import serve_metrics
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.store import Store

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def test_totals_and_the_prometheus_endpoint(tiny, tmp_path):
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=8 << 20, page_bytes=4096),
                      disk=DiskTierConfig(path=str(tmp_path / "disk")))
    prompt = list(range(3, 3 + 16 * 3 + 2))
    with Store(cfg) as store, LLM(tiny, EngineConfig(num_blocks=64, block_size=4), kv_store=store) as base, \
            base.with_config(connector=ConnectorConfig(chunk_tokens=16)) as cold:
        cold.generate(prompt, GREEDY)
        cold.flush_saves()
        with base.with_config(connector=ConnectorConfig(chunk_tokens=16)) as warm:
            (out,) = warm.generate(prompt, GREEDY)
            assert (out.metrics.num_loaded_tokens, out.metrics.num_prefilled_tokens) == (48, 2)
            stats = warm.stats()
            assert (stats.requests, stats.prompt_tokens, stats.loaded_tokens, stats.prefilled_tokens) == (1, 50, 48, 2)
            assert stats.connector.loaded_chunks == 3 and stats.kv_load_s == out.metrics.kv_load_s > 0
            server = serve_metrics(warm, "127.0.0.1:0")
            try:
                url = f"http://127.0.0.1:{server.server_port}/metrics"
                text = urllib.request.urlopen(url, timeout=10).read().decode()
            finally:
                server.shutdown()
    assert 'engine_tokens_total{kind="loaded"} 48.0' in text
    assert "engine_connector_loaded_chunks_total 3.0" in text
    assert "engine_requests_finished_total 1.0" in text


def test_generate_with_a_connector_configuration_saves_then_loads(tiny, tmp_path, capsys):
    config = tmp_path / "connector.toml"
    config.write_text(f'chunk_tokens = 16\n[store.host]\ncapacity_bytes = "8MiB"\npage_bytes = 4096\n'
                      f'[store.disk]\npath = "{tmp_path / "disk"}"\n')
    args = ["generate", "--model", str(tiny), "--prompt", "the quick brown fox jumps over the lazy dog " * 2,
            "--max-tokens", "3", "--block-size", "4", "--connector", str(config), "--json"]
    assert engine_main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert engine_main(args) == 0  # a new engine process would do the same: the chunks are on disk
    second = json.loads(capsys.readouterr().out)
    assert first["loaded_tokens"] == 0  # then its full chunks and its tail of whole 4-token blocks:
    assert second["loaded_tokens"] == second["prompt_tokens"] // 4 * 4 > 64
    assert second["text"] == first["text"]


def test_a_bad_connector_configuration_is_one_line_and_exit_2(tiny, tmp_path, capsys):
    config = tmp_path / "connector.toml"
    config.write_text('backend = "nfs"\n')
    assert engine_main(["generate", "--model", str(tiny), "--prompt", "hi", "--connector", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "engine generate: connector.backend: unknown value 'nfs'; known: auto, store, daemon"
    config.write_text("chunk_tokens = 24\n")
    assert engine_main(["generate", "--model", str(tiny), "--prompt", "hi", "--connector", str(config)]) == 2
    assert capsys.readouterr().err.strip() == ("engine generate: connector.chunk_tokens 24 is not a multiple "
                                               "of the engine block size 16")
