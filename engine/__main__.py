"""``python -m engine generate --model PATH --prompt TEXT [...]``: run prompts and print the outputs."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from connector import ConnectorConfig, load_connector_config
from engine.config import EngineConfig
from engine.llm import LLM
from engine.policies import POLICIES
from engine.sampling import SamplingParams
from tiers.base import TierError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="The bundled paged-attention engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("--model", required=True, help="HF folder (config.json + safetensors) or .gguf file")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--policy", choices=sorted(POLICIES), default="fcfs")
    gen.add_argument("--num-blocks", type=int, default=512)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: one less than the cores this process may use, at least 1)")
    gen.add_argument("--connector", nargs="?", const="", default=None, metavar="TOML",
                     help="load and save KV through a store (docs/connector.md): the defaults (the daemon holding "
                          "the default data directory, else an in-process store on it), or a TOML configuration")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return parser


def generate(args) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    connector = None
    if args.connector is not None:
        connector = load_connector_config(args.connector) if args.connector else ConnectorConfig()
    config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, policy=args.policy,
                          threads=args.threads, connector=connector)
    with LLM(args.model, config) as llm:
        prompts = args.prompt
        if args.chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
            m = out.metrics
            if args.json:
                print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                                  "ttft_s": m.ttft, "tpot_s": m.tpot, "prompt_tokens": m.num_prompt_tokens,
                                  "cached_tokens": m.num_cached_tokens, "loaded_tokens": m.num_loaded_tokens,
                                  "output_tokens": m.num_output_tokens}))
            else:
                print(out.text)
                print(f"[{m.num_prompt_tokens} prompt tokens ({m.num_cached_tokens} cached, {m.num_loaded_tokens} "
                      f"loaded from the store), {m.num_output_tokens} generated, ttft {m.ttft:.3f}s, "
                      f"finish: {out.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command. A mistake of the user's (a bad flag value or configuration, a model or
    data directory that cannot be used, more host RAM than the machine has) is one line on
    stderr and exit code 2; Ctrl-C is one line and 130."""
    args = build_parser().parse_args(argv)
    _log_the_engine_start()
    try:
        return generate(args)
    except (ValueError, OSError, TierError) as exc:
        print(f"engine {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"engine {args.command}: interrupted", file=sys.stderr)
        return 130


class _Stderr(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (a redirected or captured one), like
    logging's last-resort handler."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _log_the_engine_start() -> None:
    """The engine's INFO lines (its thread count, the store its connector chose) on stderr, as
    ``engine: ...``, unless the program configured the engine's logger itself; the store's
    and the rest of the connector's loggers keep their defaults (warnings and errors)."""
    if logging.getLogger("engine").handlers:
        return
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("engine: %(message)s"))
    for name in ("engine", "connector.backend"):
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
