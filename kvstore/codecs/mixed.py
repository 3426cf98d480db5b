"""Lossy codec: per-token mixed precision under a byte budget (SpectrumKV-style).

Each token of each layer (its K and V across all heads: a *row*) is stored at one of three
levels: int4 (the int4 codec's groups), int8 (the int8 codec's rows) or full (the input
dtype, exact). The payload is at most ``budget`` times the raw tensor's size: every row
starts at the cheapest level, then rows are upgraded in order of importance, first to int8
(the upgrade that removes the most error per byte) and, once every row is int8, to full.

Importance is the inverse of a row's key norm relative to its layer's mean key norm: the
smaller a token's key, the more bits it keeps. Measured on SmolLM2 (docs/codecs.md), this
ranking distorts the model 2-4x less than a random one, while ranking large keys first is
2x worse than random: unusually large keys seem to sit in channels queries barely read,
so those tokens draw little attention. Normalising per layer keeps one layer's scale from
deciding the whole budget. Layout, allocation and error bound: docs/codecs.md.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from kvstore.codecs import int4, int8
from kvstore.codecs.base import Codec
from kvstore.codecs.sections import Sections, pack, require_finite

INT4, INT8, FULL = 0, 1, 2


def level_costs(heads: int, head_dim: int, element_size: int) -> dict[int, int]:
    """Payload bytes of one row (K and V of ``heads`` heads) at each level."""
    width = int4.padded_width(head_dim)
    units = 2 * heads
    return {
        INT4: units * (width // 2 + 8 * width // int4.GROUP),
        INT8: units * (head_dim + 4),
        FULL: units * head_dim * element_size,
    }


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """Two bits per row, four rows per byte, first row in the lowest bits."""
    padded = torch.zeros(-(-levels.numel() // 4) * 4, dtype=torch.uint8)
    padded[: levels.numel()] = levels
    q = padded.reshape(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def unpack_levels(packed: torch.Tensor, rows: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    levels = ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)
    if bool((levels[:rows] > FULL).any()) or bool(levels[rows:].any()):
        raise ValueError("mixed payload has an invalid level map")
    return levels[:rows]


def allocate(importance: torch.Tensor, allowed: int, costs: dict[int, int]) -> torch.Tensor:
    """The level of each row, spending at most ``allowed`` bytes, most important rows first.

    A level that costs no less than a better one (tiny head_dim) is never chosen.
    """
    usable = [lvl for lvl in (INT4, INT8) if costs[lvl] < min(costs[h] for h in range(lvl + 1, FULL + 1))]
    usable.append(FULL)
    rows = importance.numel()
    levels = torch.full((rows,), usable[0], dtype=torch.uint8)
    left = allowed - rows * costs[usable[0]]
    if left < 0:
        raise ValueError("budget is smaller than the cheapest encoding of this shape")
    order = torch.argsort(importance, descending=True, stable=True)
    for low, high in zip(usable, usable[1:]):
        upgraded = min(rows, left // (costs[high] - costs[low]))
        levels[order[:upgraded]] = high
        left -= upgraded * (costs[high] - costs[low])
        if upgraded < rows:
            break
    return levels


class MixedPrecisionCodec(Codec):
    lossless = False

    def __init__(self, budget: float, name: str, codec_id: int):
        if not 0 < budget <= 1:
            raise ValueError(f"budget must be a fraction of the raw size in (0, 1], not {budget}")
        self.budget = budget
        self.name = name
        self.codec_id = codec_id

    def importance(self, keys: torch.Tensor) -> torch.Tensor:
        """``keys [layers, tokens, heads, head_dim]`` -> importance ``[layers, tokens]``."""
        norms = keys.float().flatten(2).norm(dim=2)
        return norms.mean(dim=1, keepdim=True) / norms.clamp_min(torch.finfo(torch.float32).tiny)

    def with_importance(self, importance: Callable[[torch.Tensor], torch.Tensor]) -> "MixedPrecisionCodec":
        """This codec (same name, id and budget) ranking rows by ``importance(keys)`` instead of
        the key norms: a caller that knows more (sink tokens, attention) decides the levels;
        decoding reads them from the payload, so any reader decodes it with the registered codec."""
        ranked = copy.copy(self)
        ranked.importance = importance
        return ranked

    def encode(self, tensor: torch.Tensor) -> bytes:
        layers, heads, head_dim = _check_shape(tuple(tensor.shape), self.name)
        require_finite(tensor, self.name)
        rows = tensor.permute(0, 2, 1, 3, 4).reshape(-1, 2 * heads, head_dim)
        costs = level_costs(heads, head_dim, tensor.element_size())
        map_bytes = -(-rows.shape[0] // 4)
        allowed = int(self.budget * tensor.numel() * tensor.element_size()) - 1 - map_bytes
        levels = allocate(self.importance(tensor[:, 0]).reshape(-1), allowed, costs)
        q8, s8 = int8.quantize_rows(rows[levels == INT8].reshape(-1, head_dim))
        p4, s4, z4 = int4.quantize_rows(rows[levels == INT4].reshape(-1, head_dim))
        return pack(pack_levels(levels), rows[levels == FULL], q8, s8, p4, s4, z4)

    def decode_into(self, payload, out: torch.Tensor) -> None:
        layers, heads, head_dim = _check_shape(tuple(out.shape), self.name)
        tokens = out.shape[2]
        rows = layers * tokens
        width = int4.padded_width(head_dim)
        sections = Sections(payload, self.name)
        levels = unpack_levels(sections.take(-(-rows // 4), torch.uint8), rows)
        n_full, n8, n4 = (int((levels == lvl).sum()) * 2 * heads for lvl in (FULL, INT8, INT4))
        full = sections.take(n_full * head_dim, out.dtype).reshape(-1, head_dim)
        q8 = sections.take(n8 * head_dim, torch.int8).reshape(n8, head_dim)
        s8 = sections.take(n8, torch.float32)
        p4 = sections.take(n4 * width // 2, torch.uint8).reshape(n4, width // 2)
        s4 = sections.take(n4 * width // int4.GROUP, torch.float32).reshape(n4, width // int4.GROUP)
        z4 = sections.take(n4 * width // int4.GROUP, torch.float32).reshape(n4, width // int4.GROUP)
        sections.finish()
        int8.check_scales(s8, self.name)
        decoded = torch.empty(rows, 2 * heads, head_dim, dtype=out.dtype)
        decoded[levels == FULL] = full.reshape(-1, 2 * heads, head_dim)
        decoded[levels == INT8] = int8.dequantize_rows(q8, s8, out.dtype).reshape(-1, 2 * heads, head_dim)
        decoded[levels == INT4] = int4.dequantize_rows(p4, s4, z4, head_dim, out.dtype).reshape(-1, 2 * heads, head_dim)
        out.copy_(decoded.reshape(layers, tokens, 2, heads, head_dim).permute(0, 2, 1, 3, 4))


def _check_shape(shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"{name} encodes chunks shaped [layers, 2, tokens, heads, head_dim], not {list(shape)}")
    return shape[0], shape[3], shape[4]
