"""The GPU engine: the Engine API over the scheduler, paged KV cache, runner and Triton model.

step() = schedule -> copy block-table changes -> forward (graph or eager) -> sample -> record
computed tokens -> emit events -> retire finished sequences. Everything that synchronises with
the device is in runner.py; everything that decides who runs is in scheduler.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.moe_matmul import ROW_GROUP
from ...kernels.skinny_linear import MAX_TOKENS as SKINNY_MAX_TOKENS
from ..api import Engine, RequestOutput, RequestTimings, SamplingParams, TokenEvent, record_token
from ..checkpoint import ModelWeights
from ..errors import RequestError
from .kv_cache import KvCache, plan_kv_memory
from .kv_manager import KvManager
from .model import GpuModel, SkinnyPlan
from .preflight import check_device, kv_budget_bytes, want_split_copy
from .runner import DecodeLaunch, Runner
from .scheduler import Scheduler
from .sequence import PENDING_TOKEN, Sequence, Status
from .warmup import warm_eager_steps, warm_sampling
from .weights import prepare_weights


@dataclass(frozen=True)
class GpuEngineConfig:
    max_context: int | None = None  # default: the model's max_position_embeddings
    max_batch: int = 64
    max_step_tokens: int = 8192  # prefill chunk budget per step (decode tokens included)
    block_size: int = 64
    memory_fraction: float = 0.92  # of the free memory after weights, for KV + workspace
    cuda_graphs: bool = True
    kv_memory_bytes: int | None = None  # fixed KV budget instead of sizing from free memory
    dtype: str = "bfloat16"  # activations, KV and dense weights; float32 for exactness checks
    # Compile the eager (prompt and mixed) steps' kernels at start (warmup.py). None: on CUDA only
    # (under the CPU interpreter every step costs seconds).
    warm_up: bool | None = None
    # One-token qkv / o projections in kernels.linear.row_linear instead of cuBLAS (batch 1).
    row_linear: bool = True
    # With row_linear: the batch-1 decode qkv projection also applies RoPE and writes K/V to the
    # cache (kernels.qkv_rope), one launch less per layer. H200, 20b batch 1: 539 -> 552 tok/s
    # (docs/performance.md, session 11).
    fused_qkv_rope: bool = True
    # Steps of 2 to this many tokens (at most kernels.skinny_linear.MAX_TOKENS) project o (and a
    # short prompt chunk's qkv) in kernels.skinny_linear instead of cuBLAS; 0: cuBLAS. H200, 20b ms
    # per step with qkv there too: batch 2 2.667 -> 2.530, 16 4.859 -> 4.706, 32 5.637 -> 5.507;
    # batch 64 6.000 -> 6.091 stays on cuBLAS (docs/performance.md, session 27).
    skinny_tokens: int = 32
    # The same for the decode qkv projection, with RoPE and the K/V store fused (as fused_qkv_rope
    # says); from skinny_qkv_unsplit_from tokens (0: never) in one K split, 80 programs of 64 rows.
    # H200 kernel bench (session 27), qkv us per layer, split / one split / cuBLAS + rope: T=16
    # 11.30 / 10.72 / 14.30, T=32 12.54 / 11.15 / 14.47, T=64 15.79 / 12.51 / 14.75. Engine, 20b ms
    # per step (session 28): batch 64 6.055 -> 5.991 (qkv here); batches 8-32 unchanged by the one
    # split (3.994 / 4.735 / 5.518 either way).
    skinny_qkv_tokens: int = 64
    skinny_qkv_unsplit_from: int = 8
    # Steady decode queues the next graph replay before reading this one's tokens, so host work
    # overlaps the GPU (tokens reach the caller one step later). H200, 20b: batch 64 8.17 -> 7.53
    # ms per step, batch 1 ~1.90 -> 1.85 ms (docs/performance.md, session 7).
    overlap_steps: bool = True
    # Rows per contiguous group of the packed expert bytes (kernels.MoeWeights.row_group; 1 = the
    # checkpoint's row-major order): each K step of a MoE kernel then reads whole pieces.
    moe_row_group: int = ROW_GROUP
    # Also the experts' scales in fragment order (kernels.MoeWeights.w1_scales_frag / w2_scales_frag,
    # +1/32 of the expert bytes: 0.6 GB for 20b, 3.6 GB for 120b, taken from the KV cache), which the
    # prefill tiles then read. H200, 20b: TTFT of a 4k prompt 75.0 -> 72.2 ms (gemm1's), 120b
    # prefill MoE at 64-row tiles -9 % (both; docs/performance.md, session 16).
    moe_frag_scales: bool = True
    # Also the experts' blocks in the split-word order (kernels.MoeWeights.w1_split / w2_split, as
    # many bytes again: 8.9 GiB for 20b, taken from the KV cache), which the decode tiles (batches
    # above the grouped kernels') dequantise with about half the integer instructions. None: on
    # where max_batch's decode steps run those tiles and the copy takes at most a quarter of the
    # GPU and half of what the weights left free (preflight.want_split_copy: 20b at batches of
    # 17+ on an 80 GB or larger GPU; not for chat's batch 1, never 120b on one H200).
    moe_split_copy: bool | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_step_tokens < self.max_batch:
            raise ValueError("max_batch must be >= 1 and max_step_tokens >= max_batch")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise ValueError("block_size must be a power of two in 16..256")
        if not 0.1 <= self.memory_fraction <= 0.99:
            raise ValueError("memory_fraction must be in [0.1, 0.99]")
        for name in ("skinny_tokens", "skinny_qkv_tokens"):
            if not 0 <= getattr(self, name) <= SKINNY_MAX_TOKENS:
                raise ValueError(f"{name} must be in 0..{SKINNY_MAX_TOKENS}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError("dtype must be bfloat16 or float32")


class GpuEngine(Engine):
    def __init__(self, weights: ModelWeights, progress: Callable[[str, int, int], None] | None = None,
                 **options):
        super().__init__()
        self.options = opts = GpuEngineConfig(**options)
        self.config = cfg = weights.config
        self.max_context = min(opts.max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        device = weights.device
        check_device(device)
        dtype = getattr(torch, opts.dtype)
        split_copy = want_split_copy(cfg, torch.device(device), opts.moe_split_copy, opts.max_batch, dtype)
        gpu_weights = prepare_weights(weights, dtype, opts.moe_row_group, opts.moe_frag_scales, split_copy)
        plan = plan_kv_memory(cfg, kv_budget_bytes(device, opts, cfg), opts.block_size, self.max_context,
                              opts.max_batch, opts.max_step_tokens, dtype.itemsize)
        self.kv_cache = KvCache(cfg, plan, opts.max_batch, device, dtype)
        self.kv = KvManager(plan.full_blocks, plan.slide_blocks, opts.block_size, cfg.sliding_window)
        self.scheduler = Scheduler(self.kv, opts.max_batch, opts.max_step_tokens)
        on_cuda = torch.device(device).type == "cuda"
        model = GpuModel(gpu_weights, self.kv_cache, self.max_context + 1, opts.max_step_tokens, opts.row_linear,
                         opts.fused_qkv_rope,
                         SkinnyPlan(opts.skinny_tokens, opts.skinny_qkv_tokens, opts.skinny_qkv_unsplit_from))
        self.runner = Runner(model, self.kv_cache, opts.max_batch, opts.cuda_graphs)
        self.runner.capture(self.max_context, (lambda i, n: progress("capturing CUDA graphs", i, n)) if progress else None)
        self.weights_bytes = gpu_weights.nbytes
        self.num_steps = 0
        self._ahead: tuple[list[Sequence], DecodeLaunch] | None = None  # decode step launched, ids unread
        if opts.warm_up if opts.warm_up is not None else on_cuda:
            warm_eager_steps(self, opts.max_step_tokens,
                             (lambda i, n: progress("compiling prompt kernels", i, n)) if progress else None)
            warm_sampling(opts.max_batch, cfg.vocab_size, dtype, torch.device(device))
            self.kv.drop_prefix_cache()
            self.num_steps = 0

    # ---- Engine API ----------------------------------------------------------------------
    def _admit(self, request_id, prompt, params, seed) -> RequestOutput:
        max_new = self.max_new_tokens(len(prompt), params)
        if self.kv.blocks_for(len(prompt) + max_new) >= self.kv.full.num_blocks:
            raise RequestError(f"prompt of {len(prompt)} tokens plus {max_new} new ones does not fit in the KV cache",
                               "lower --max-tokens or --context", code="context_length_exceeded")
        out = RequestOutput(request_id, prompt, timings=RequestTimings(time.perf_counter()))
        self.scheduler.add(Sequence(out, params, seed, max_new, tokens=list(prompt)))
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return None
        seq.out.finish_reason = "abort"
        seq.out.timings.finished = time.perf_counter()
        return seq.out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenEvent]:
        events = []
        if self._ahead is not None:
            if self._can_stay_ahead():
                return self._step_ahead()
            events = self._drain()
        plan = self.scheduler.schedule()
        if plan is None:
            return events
        self.kv_cache.apply(self.kv.updates)
        seqs = [seq for seq, _ in plan.chunks]
        if plan.decode_only and self.runner.can_replay(len(seqs)):
            if self.options.overlap_steps:
                self._launch_ahead(seqs)
                return events
            tokens = self.runner.run_decode_graph(seqs)
        else:
            tokens = self.runner.run_eager(plan.chunks)
        self.num_steps += 1
        now = time.perf_counter()
        for (seq, n), tok in zip(plan.chunks, tokens):
            self.kv.computed(seq, n)
            if tok is not None:
                events.append(self._emit(seq, tok, now))
        return events

    # ---- overlapped decode (overlap_steps) ----------------------------------------------
    # Between calls a launched step k is "ahead": its KV is recorded (kv.computed: its input
    # tokens are known), and each of its sequences ends in PENDING_TOKEN, its unread sample. The
    # next call may queue step k+1 from the device state alone, then read k's ids. A sequence
    # that k's token finishes (a stop token) got a speculative k+1 row, which is dropped; freeing
    # its blocks meanwhile is safe, as every later launch that could reuse them queues behind.
    def _launch_ahead(self, seqs: list[Sequence]) -> None:
        launch = self.runner.launch_decode_graph(seqs)
        self.num_steps += 1
        self._record_launched(seqs, launch)

    def _record_launched(self, seqs: list[Sequence], launch: DecodeLaunch) -> None:
        """The launched step's KV is recorded (its input tokens are known by now) and its samples
        are pending. The whole batch is kept: the launch's ids are in its order, and rows that
        finished meanwhile are skipped when read."""
        for seq in seqs:
            if seq.status is Status.RUNNING:
                self.kv.computed(seq, 1)
                seq.tokens.append(PENDING_TOKEN)
        self._ahead = (seqs, launch)

    def _can_stay_ahead(self) -> bool:
        """The next step is the same decode batch, planned without admission or preemption, and
        no sequence can end by length at the step ahead (so only a stop token wastes a row)."""
        seqs, _ = self._ahead
        sched = self.scheduler
        if sched.waiting or sched.running != seqs or not self.runner.holds(seqs):
            return False
        if any(s.num_generated + 2 > s.max_new for s in seqs):
            return False
        costs = [self.kv.step_cost(s, 1) for s in seqs]
        return self.kv.can_run((sum(c[0] for c in costs), sum(c[1] for c in costs)))

    def _step_ahead(self) -> list[TokenEvent]:
        seqs, previous = self._ahead
        plan = self.scheduler.schedule()
        if plan is None or not plan.decode_only or [s for s, _ in plan.chunks] != seqs:
            raise RuntimeError("overlapped decode: the scheduler did not plan the same decode batch")
        self.kv_cache.apply(self.kv.updates)
        launch = self.runner.launch_decode_graph(seqs)
        self.num_steps += 1
        events = self._emit_ahead(seqs, self.runner.collect(previous))
        self._record_launched(seqs, launch)
        return events

    def _drain(self) -> list[TokenEvent]:
        seqs, launch = self._ahead
        self._ahead = None
        return self._emit_ahead(seqs, self.runner.collect(launch))

    def _emit_ahead(self, seqs: list[Sequence], ids: list[int]) -> list[TokenEvent]:
        """Emit a launched step's ids for the sequences still running (not aborted or finished)."""
        now = time.perf_counter()
        events = []
        for seq, tok in zip(seqs, ids):
            if seq.status is Status.RUNNING and seq.tokens and seq.tokens[-1] == PENDING_TOKEN:
                seq.tokens.pop()
                events.append(self._emit(seq, tok, now))
        return events

    def _emit(self, seq: Sequence, token: int, now: float) -> TokenEvent:
        seq.tokens.append(token)
        event = record_token(seq.out, token, seq.params, seq.max_new, now)
        if event.finish_reason is not None:
            self.scheduler.finish(seq)
        return event

    # ---- introspection (tests, bench) -------------------------------------------------
    @torch.inference_mode()
    def score(self, prompt: list[int]) -> torch.Tensor:
        """fp32 logits [T, V] at every prompt position through the prefill path (engine idle)."""
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        seq = Sequence(RequestOutput("score", list(prompt)), SamplingParams(), 0, 1, tokens=list(prompt) + [0])
        seq.row = self.options.max_batch  # any row works while nothing else runs
        chunks = []
        try:
            while seq.num_computed < len(prompt):
                n = min(self.options.max_step_tokens, len(prompt) - seq.num_computed)
                self.kv.reserve(seq, n)
                self.kv_cache.apply(self.kv.updates)
                chunks.append(self.runner.logits_all([(seq, n)]).float())
                seq.num_computed += n
        finally:
            self.kv.free(seq)
            self.kv.updates.clear()
        return torch.cat(chunks)

    def free_blocks(self) -> tuple[int, int]:
        """(full, sliding) blocks that can be handed out: returns to its start value when idle."""
        return self.kv.full.num_free, self.kv.slide.num_free
