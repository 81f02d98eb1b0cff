"""Warm-up of the eager step: the Triton kernels that prompt chunks and mixed prefill/decode steps
use are compiled at engine start, not inside the first requests.

Triton compiles a kernel once per set of constexpr values (here the MoE tiles that
kernels.moe.pick_config chooses from the step's token count) and once per specialisation of its
int arguments (a value of 1, divisibility by 16). CUDA-graph capture (runner.py) compiles the pure
decode steps and the whole-prompt steps of its length buckets only (which is why the warm-up runs
its prompts eagerly), so a benchmark's first long prompts used to pay for these compiles: 6 kernels
in the 256-request H200 run, ~1-3 s each (docs/performance.md, session 4). The sampler's
kernels also compile once per launch layout, which depends on how many rows need a token
(kernels.sampling.split_classes); a step can have any row count up to max_batch, so each class is
sampled once on dummy logits. Counts that are not a function of T alone (MoE tiles, routing
blocks, prefill query tiles) are marked do_not_specialize in their kernels, so they add no
classes. With a warm Triton cache on disk the warm-up costs a few forward passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...kernels.moe import pick_config
from ...kernels.sampling import sample, split_classes
from ..api import SamplingParams

if TYPE_CHECKING:
    from .engine import GpuEngine


def step_sizes(max_step_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """One token count per class of eager step that Triton compiles separately: the MoE tile
    configuration, T == 1, T divisible by 16; plus the largest step."""
    first: dict[tuple, int] = {}
    for t in range(1, max_step_tokens + 1):
        first.setdefault((pick_config(t, num_experts, top_k), t == 1, t % 16 == 0), t)
    return sorted(set(first.values()) | {max_step_tokens})


def _prompt(index: int, length: int, vocab: int) -> list[int]:
    """Dummy tokens, different in every prompt from the first token on (no prefix-cache hits)."""
    return [(1000 + 7919 * index + 31 * i) % vocab for i in range(length)]


def warm_eager_steps(engine: GpuEngine, max_step_tokens: int, progress: Callable[[int, int], None] | None = None) -> None:
    """Run one eager step of every size class, then mixed rounds, through the engine's own API.
    The caller drops the prefix cache and resets its counters afterwards."""
    cfg = engine.config
    room = engine.max_context - 4  # prompt + the new tokens must fit the context
    if room < 1:
        return
    def fits(n: int) -> bool:  # the engine's admission rule (GpuEngine._admit), with 3 new tokens
        return n <= room and engine.kv.blocks_for(n + 3) < engine.kv.full.num_blocks

    sizes = [t for t in step_sizes(max_step_tokens, cfg.num_local_experts, cfg.num_experts_per_tok) if fits(t)]
    # Single prompts would replay the prompt graphs (runner.py), whose lengths were compiled at
    # capture; the eager kernels of every size class are what mixed steps need.
    padded, engine.runner.pad_prompts = engine.runner.pad_prompts, False
    try:
        _run_warm_up(engine, sizes, max_step_tokens, fits, progress)
    finally:
        engine.runner.pad_prompts = padded


def _run_warm_up(engine: GpuEngine, sizes: list[int], max_step_tokens: int, fits: Callable[[int], bool],
                 progress: Callable[[int, int], None] | None) -> None:
    cfg = engine.config
    # A multi-sequence round: a prompt longer than one step (its second chunk reads the first from
    # the paged cache), shorter ones beside it (several sequences per step), then decode rows.
    mixed = [n for n in (max_step_tokens + max(1, max_step_tokens // 4), max(2, max_step_tokens // 3), 7) if fits(n)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    total = len(sizes) + 1
    for i, t in enumerate(sizes):
        engine.generate([_prompt(i, t, cfg.vocab_size)], one)
        if progress:
            progress(i + 1, total)
    few = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    if mixed:
        engine.generate([_prompt(len(sizes) + j, n, cfg.vocab_size) for j, n in enumerate(mixed)], few)
    # Then up to 16 sequences in one step (a sequence count divisible by 16 specialises too).
    many = min(16, engine.options.max_batch, max_step_tokens // 20)
    if many > 1 and fits(20):
        engine.generate([_prompt(len(sizes) + len(mixed) + j, 20, cfg.vocab_size) for j in range(many)], few)
    if progress:
        progress(total, total)


def warm_sampling(max_batch: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Sample once per launch layout up to max_batch rows (dummy logits; nothing is kept)."""
    for rows in split_classes(max_batch, device):
        logits = torch.zeros(rows, vocab, dtype=dtype, device=device)
        ones = torch.ones(rows, device=device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        sample(logits, ones, zeros.int(), ones, 0 * ones, zeros, zeros)
