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

from ..api import Engine, RequestOutput, RequestTimings, SamplingParams, TokenEvent, record_token
from ..checkpoint import ModelWeights
from ..errors import RequestError
from .kv_cache import KvCache, plan_kv_memory
from .kv_manager import KvManager
from .model import GpuModel
from .preflight import check_device, kv_budget_bytes
from .runner import Runner
from .scheduler import Scheduler
from .sequence import Sequence
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

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_step_tokens < self.max_batch:
            raise ValueError("max_batch must be >= 1 and max_step_tokens >= max_batch")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise ValueError("block_size must be a power of two in 16..256")
        if not 0.1 <= self.memory_fraction <= 0.99:
            raise ValueError("memory_fraction must be in [0.1, 0.99]")
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
        gpu_weights = prepare_weights(weights, dtype)
        plan = plan_kv_memory(cfg, kv_budget_bytes(device, opts, cfg), opts.block_size, self.max_context,
                              opts.max_batch, opts.max_step_tokens, dtype.itemsize)
        self.kv_cache = KvCache(cfg, plan, opts.max_batch, device, dtype)
        self.kv = KvManager(plan.full_blocks, plan.slide_blocks, opts.block_size, cfg.sliding_window)
        self.scheduler = Scheduler(self.kv, opts.max_batch, opts.max_step_tokens)
        on_cuda = torch.device(device).type == "cuda"
        model = GpuModel(gpu_weights, self.kv_cache, self.max_context + 1, opts.max_step_tokens, opts.row_linear)
        self.runner = Runner(model, self.kv_cache, opts.max_batch, opts.cuda_graphs)
        self.runner.capture(self.max_context, (lambda i, n: progress("capturing CUDA graphs", i, n)) if progress else None)
        self.weights_bytes = gpu_weights.nbytes
        self.num_steps = 0
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
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        self.kv_cache.apply(self.kv.updates)
        seqs = [seq for seq, _ in plan.chunks]
        if plan.decode_only and self.runner.can_replay(len(seqs)):
            tokens = self.runner.run_decode_graph(seqs)
        else:
            tokens = self.runner.run_eager(plan.chunks)
        self.num_steps += 1
        now = time.perf_counter()
        events = []
        for (seq, n), tok in zip(plan.chunks, tokens):
            self.kv.computed(seq, n)
            if tok is not None:
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
