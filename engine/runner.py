"""Turns a scheduled batch into flat model inputs, runs the model, and returns the rows to sample.

Owns the paged KV cache: one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]`` for all layers (``kv_cache[l]`` is vLLM's per-layer layout), so block gather and
scatter (``kernels.block_copy``) move every layer of a block in one call.

With a KV connector the forward is wrapped as vLLM's model runner wraps it: start the step's
loads, run the model (a layer-wise load is waited for before each layer), save the chunks
the forward completed, and collect what the connector finished.
"""

from __future__ import annotations

import torch

from connector import ConnectorMetadata, ConnectorOutput, KVConnector
from engine.attention import AttentionMetadata, PrefillChunk
from engine.config import DTYPES
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: str = "cpu"):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        # > 0: record, for prompts whose last tokens a step computes, the attention of that many
        # last queries over the prompt (a prefill producer ranks tokens by it: connector/roles.py)
        self.observe_window = 0
        self._observed: dict[str, torch.Tensor] = {}
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=DTYPES[cfg.dtype], device=self.device,
        )

    def _slots(self, seq: Sequence, start: int, n: int) -> list[int]:
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def prepare(self, batch: ScheduledBatch):
        """Flat ``input_ids``, ``positions``, attention metadata, and which rows end a sequence."""
        ids, positions, slots, sample_rows = [], [], [], []
        decodes = [(s, n) for s, n in batch.items if n == 1 and s.num_computed > 0]
        prefills = [(s, n) for s, n in batch.items if not (n == 1 and s.num_computed > 0)]
        chunks = []
        for is_prefill, (seq, n) in [(False, x) for x in decodes] + [(True, x) for x in prefills]:
            start = seq.num_computed
            if is_prefill:
                table = torch.tensor(seq.block_table[: -(-(start + n) // self.block_size)], dtype=torch.long)
                ends_prompt = self.observe_window and start + n == seq.num_prompt_tokens
                chunks.append(PrefillChunk(len(ids), n, start + n, table.to(self.device),
                                           self.observe_window if ends_prompt else 0))
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += self._slots(seq, start, n)
            if start + n == len(seq):
                sample_rows.append((len(ids) - 1, seq))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                                 num_decodes=len(decodes), prefills=chunks)
        if decodes:
            width = max(len(s.block_table) for s, _ in decodes)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s, _ in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int32, device=self.device)
            meta.decode_context_lens = torch.tensor([s.num_computed + 1 for s, _ in decodes], dtype=torch.int32,
                                                    device=self.device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids_t, positions_t, meta, sample_rows

    def _attention_mass(self, batch: ScheduledBatch, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
        """request id -> ``[layers, prompt tokens]`` observed attention (see ``observe_window``)."""
        if not meta.attention_mass:
            return {}
        prefills = [s for s, n in batch.items if not (n == 1 and s.num_computed > 0)]
        observed = [s for s, c in zip(prefills, meta.prefills) if c.observe]
        return {s.request_id: torch.stack([layer[i] for layer in meta.attention_mass]).cpu()
                for i, s in enumerate(observed)}

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[tuple[Sequence, torch.Tensor]]:
        """Compute the batch's KV; return float32 logits for each sequence that reached its end."""
        return self._forward(batch)

    @torch.inference_mode()
    def run_with_connector(self, batch: ScheduledBatch, connector: KVConnector,
                           plan: ConnectorMetadata) -> tuple[list[tuple[Sequence, torch.Tensor]], ConnectorOutput]:
        """``run`` with the connector's step around the forward; also returns what it finished."""
        connector.start_load_kv(plan)
        layerwise = plan.loads and connector.config.load_mode == "layerwise"
        results = self._forward(batch, connector.wait_for_layer_load if layerwise else None)
        if self._observed:
            connector.set_attention_mass(self._observed)
        connector.wait_for_save()
        return results, connector.get_finished()

    def _forward(self, batch: ScheduledBatch, before_layer=None) -> list[tuple[Sequence, torch.Tensor]]:
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, before_layer)
        self._observed = self._attention_mass(batch, meta)
        if not sample_rows:
            return []
        rows = torch.tensor([r for r, _ in sample_rows], device=self.device)
        logits = self.model.compute_logits(hidden[rows]).cpu()
        return [(seq, logits[i]) for i, (_, seq) in enumerate(sample_rows)]
