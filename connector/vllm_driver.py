"""One real vLLM engine (CPU, fp32) serving commands, so a test or benchmark pays for an engine
start once and sends it many requests. Runs under the vLLM venv's python
(``connector.vllm_process.VllmEngine`` starts it); the project's own venv has no vLLM.

Commands are JSON lines on stdin; each reply is one JSON line on the file descriptor
``--reply-fd`` (vLLM's processes write their logs to stdout and stderr):

    {"op": "generate", "prompts": [[token ids], ...], "max_tokens": 16}
        -> {"outputs": [[ids], ...], "cached": [num_cached_tokens, ...], "preemptions": [...], "seconds": x}
        (the prompts go in one call, so they are batched; ``seconds`` is the call's wall time: with
        ``max_tokens`` 1 and one prompt, its time to first token)
    {"op": "namespace"}  -> the connector's namespace fields (the test computes chunk keys)
    {"op": "reset_prefix_cache"}  -> {"ok": bool} (vLLM's own prefix cache emptied: a prompt
        sent again reaches the connector)
    {"op": "quit"}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-transfer-config", default="", help="JSON, as vllm serve takes it; empty: none")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--reply-fd", type=int, required=True, help="where replies go, one JSON line each")
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from its size)")
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()
    os.set_inheritable(args.reply_fd, False)  # vLLM's own processes have no business with it
    replies = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(payload: dict) -> None:
        replies.write(json.dumps(payload) + "\n")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = KVTransferConfig(**json.loads(args.kv_transfer_config)) if args.kv_transfer_config else None
    started = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=4, max_num_batched_tokens=args.max_batched_tokens,
              enable_prefix_caching=args.prefix_caching, num_gpu_blocks_override=args.num_blocks,
              kv_transfer_config=kv, disable_log_stats=False)
    reply({"ready": True, "start_s": time.monotonic() - started})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "namespace":
            from connector.vllm import connector_config, vllm_namespace

            config = llm.llm_engine.vllm_config
            ns = vllm_namespace(config, connector_config(config))
            reply({f.name: getattr(ns, f.name) for f in dataclasses.fields(ns) if f.init})
        elif cmd["op"] == "reset_prefix_cache":
            reply({"ok": bool(llm.reset_prefix_cache())})
        elif cmd["op"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16), ignore_eos=True)
            t0 = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], params, use_tqdm=False)
            seconds = time.monotonic() - t0
            reply({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                   "cached": [o.num_cached_tokens for o in outs], "seconds": seconds,
                   "preemptions": [o.metrics.num_preemptions if o.metrics is not None else None for o in outs]})
        else:
            reply({"error": f"unknown op {cmd['op']!r}"})


if __name__ == "__main__":
    main()
