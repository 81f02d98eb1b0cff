"""Device memory of the KV cache: one paged pool for full-attention layers, one for sliding
layers, and the block tables (row per running sequence, column per logical block).

Pool layout per layer: k and v [num_blocks, BLOCK, Hkv, D] bf16. Block 0 of each pool and row 0
of each table are scratch for padded CUDA-graph rows. Sizing from free memory is in
`plan_kv_memory`, which also says what would fit when nothing does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import HardwareError
from .kv_manager import BlockUpdate


@dataclass(frozen=True)
class KvPlan:
    block_size: int
    full_blocks: int
    slide_blocks: int
    max_blocks_per_seq: int
    bytes_per_block: int  # one block in one layer, k + v


def sliding_blocks_needed(cfg: ModelConfig, block_size: int, max_batch: int, max_step_tokens: int) -> int:
    """Every running sequence's window plus a step's worth of prefill chunk blocks, and as much
    again kept as prefix cache (plus the scratch block)."""
    window_blocks = -(-cfg.sliding_window // block_size) + 1
    return 2 * (max_batch * window_blocks + -(-max_step_tokens // block_size) + max_batch) + 1


def plan_kv_memory(cfg: ModelConfig, budget_bytes: int, block_size: int, max_context: int,
                   max_batch: int, max_step_tokens: int, element_bytes: int = 2) -> KvPlan:
    """Split `budget_bytes` between the pools; raise HardwareError naming what would fit."""
    per_block = 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * element_bytes  # k + v
    n_full = sum(1 for n in range(cfg.num_hidden_layers) if not cfg.is_sliding(n))
    n_slide = cfg.num_hidden_layers - n_full
    slide_needed = sliding_blocks_needed(cfg, block_size, max_batch, max_step_tokens)
    slide_bytes = slide_needed * per_block * n_slide
    full_blocks = (budget_bytes - slide_bytes) // max(1, per_block * n_full) if n_full else 1
    max_blocks = -(-max_context // block_size)
    if full_blocks < max_blocks + 1:
        fit_ctx = max(0, (full_blocks - 1) * block_size) if full_blocks > 1 else 0
        raise HardwareError(
            f"KV cache does not fit: {budget_bytes / 2**30:.1f} GiB free after weights holds "
            f"{fit_ctx} tokens of context, {max_context} requested",
            f"use --context {max(block_size, fit_ctx // 1024 * 1024)} or a smaller --max-batch")
    return KvPlan(block_size, int(full_blocks), int(slide_needed), max_blocks, per_block)


class KvCache:
    """The pools and block tables on the device."""

    def __init__(self, cfg: ModelConfig, plan: KvPlan, max_rows: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16):
        self.plan = plan
        shape = lambda n: (n, plan.block_size, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for n in range(cfg.num_hidden_layers):
            blocks = plan.slide_blocks if cfg.is_sliding(n) else plan.full_blocks
            self.k.append(torch.zeros(shape(blocks), dtype=dtype, device=device))
            self.v.append(torch.zeros(shape(blocks), dtype=dtype, device=device))
        rows = max_rows + 1
        self.full_table = torch.zeros(rows, plan.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slide_table = torch.zeros(rows, plan.max_blocks_per_seq, dtype=torch.int32, device=device)

    def apply(self, updates: list[BlockUpdate]) -> None:
        """Write changed block-table entries (one small copy per pool)."""
        for pool, table in (("full", self.full_table), ("slide", self.slide_table)):
            # The last write to an entry wins (a row can be freed and reused within one step).
            picked = list({(u.row, u.logical): u for u in updates if u.pool == pool}.values())
            if not picked:
                continue
            width = table.shape[1]
            flat = torch.tensor([u.row * width + u.logical for u in picked], dtype=torch.int64)
            vals = torch.tensor([u.block for u in picked], dtype=torch.int32)
            table.view(-1)[flat.to(table.device, non_blocking=True)] = vals.to(table.device, non_blocking=True)
        updates.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
