"""Planned chunks -> device batch -> forward -> sampled tokens. Owns CUDA graphs and every sync.

Two paths. Eager: any mix of prefill chunks and decode tokens, metadata built on the host and
copied once. Graph: steps where every sequence has one pending token replay a decode graph
captured at warm-up for the smallest bucket >= the batch; padded rows point at scratch row 0
(block 0) and produce nothing. Inside the graph the sampled tokens become the next step's
inputs and positions advance (kernels.decode_step), so a steady decode step only copies changed
block-table entries in and the sampled ids out (the one host sync per step).
`launch_decode_graph` / `collect` split that step so the engine can queue the next replay before
reading the ids (overlap_steps).
A step that is one sequence's whole remaining prompt, up to PROMPT_BUCKETS[-1] tokens, replays a
prompt graph captured for the smallest length bucket >= it: launching its ~400 kernels one by one
cost the host ~22 ms, three times their GPU time at 128 tokens (H200, 20b; docs/performance.md,
session 16). Pad tokens come after the chunk, outside its cu_seqlens (no real query sees them),
write their K/V to scratch block 0 and are not sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ...kernels import SamplingRows, advance_decode, choose_num_splits, decode_slots, sample
from ...kernels.decode_step import SeenSets
from ...kernels.penalty import apply_penalty, mark_seen
from .kv_cache import KvCache
from .model import ForwardBatch, GpuModel
from .seen_rows import SeenRows, has_penalty
from .sequence import Sequence

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)  # prompt-graph lengths (tokens)


def _sampling_host(seqs: list[Sequence]) -> list[np.ndarray]:
    p = [s.params for s in seqs]
    return [np.array([x.temperature for x in p], np.float32), np.array([x.top_k for x in p], np.int32),
            np.array([x.top_p for x in p], np.float32), np.array([x.min_p for x in p], np.float32),
            np.array([s.seed for s in seqs], np.int64), np.array([s.num_generated for s in seqs], np.int64)]


@dataclass
class DecodeLaunch:
    """A replayed decode step whose sampled ids are on their way to the host."""

    ids: torch.Tensor  # [n] int64 host (pinned) buffer, valid once `done` has completed
    done: torch.cuda.Event | None  # None on the CPU: the copy was synchronous


class Runner:
    def __init__(self, model: GpuModel, kv: KvCache, max_batch: int, use_graphs: bool = True,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        self.model = model
        self.kv = kv
        self.block_size = kv.plan.block_size
        self.device = model.w.embed.device
        self.max_batch = max_batch
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_seqs: list[Sequence] | None = None  # batch the static buffers describe
        max_step = model.moe_workspace.max_tokens
        self.prompt_buckets = tuple(b for b in PROMPT_BUCKETS if b <= max_step)
        self._p_len = max(self.prompt_buckets, default=0)  # tokens per slab of the static prompt buffer
        self._prompt_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Whole-prompt steps go through the padded prompt step (a graph where captured); the CPU
        # tests turn it on to run the padded step eagerly.
        self.pad_prompts = self.use_graphs
        self.seen = SeenRows(kv.full_table.shape[0], model.w.lm_head.shape[0], self.device)
        self._alloc_static()
        self._alloc_prompt_static()

    # ---- eager path ----------------------------------------------------------------------
    def run_eager(self, chunks: list[tuple[Sequence, int]]) -> list[int | None]:
        """Any mix of chunks; returns the sampled token per chunk (None mid-prompt). One sequence's
        whole remaining prompt replays a prompt graph where one was captured for its length."""
        if self.pad_prompts and len(chunks) == 1 and self.prompt_bucket(*chunks[0]):
            return [self.run_prompt(*chunks[0])]
        self._graph_seqs = None  # the eager step moves positions past the static buffers
        batch, sampled = self._build_eager(chunks)
        logits = self.model.forward(batch)
        tokens = [None] * len(chunks)
        if sampled:
            seqs = [chunks[i][0] for i in sampled]
            params = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in _sampling_host(seqs)]
            seen = self._eager_seen(seqs)
            if seen is not None:
                apply_penalty(logits, seen.bits, seen.rows, seen.penalty)
            ids = sample(logits, *params)
            if seen is not None:
                mark_seen(seen.bits, seen.rows, ids, seen.penalty)
            for i, tok in zip(sampled, ids.tolist()):
                tokens[i] = tok
        return tokens

    def _eager_seen(self, seqs: list[Sequence]) -> SeenSets | None:
        """The penalty's operands for an eager step's sampled rows; None when none has a penalty."""
        if not any(has_penalty(s) for s in seqs):
            return None
        self.seen.prepare(seqs)
        rows = torch.tensor([s.row for s in seqs], dtype=torch.int64).to(self.device, non_blocking=True)
        pen = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=torch.float32)
        return SeenSets(self.seen.bits, rows, pen.to(self.device, non_blocking=True))

    def logits_all(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits of every token of the chunks (diagnostics: engine-vs-reference checks)."""
        self._graph_seqs = None
        batch, _ = self._build_eager(chunks)
        batch.logits_rows = None
        return self.model.forward(batch)

    def _build_eager(self, chunks: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[int]]:
        bs = self.block_size
        tok, pos, fslot, sslot, cu, ctx, rows, sampled, last_rows = [], [], [], [], [0], [], [], [], []
        for i, (seq, n) in enumerate(chunks):
            start = seq.num_computed
            p = np.arange(start, start + n, dtype=np.int64)
            tok.append(np.asarray(seq.tokens[start:start + n], dtype=np.int64))
            pos.append(p)
            fslot.append(np.asarray(seq.full_blocks, np.int64)[p // bs] * bs + p % bs)
            sslot.append(np.asarray(seq.slide_blocks, np.int64)[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
            ctx.append(start)
            rows.append(seq.row)
            if start + n == len(seq.tokens):
                sampled.append(i)
                last_rows.append(cu[-1] - 1)
        host = {
            "tokens": np.concatenate(tok), "positions": np.concatenate(pos),
            "full_slots": np.concatenate(fslot), "slide_slots": np.concatenate(sslot),
            "logits_rows": np.asarray(last_rows, np.int64),
        }
        dev = {k: torch.from_numpy(v).to(self.device, non_blocking=True) for k, v in host.items()}
        row_idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        batch = ForwardBatch(
            tokens=dev["tokens"], positions=dev["positions"], full_slots=dev["full_slots"],
            slide_slots=dev["slide_slots"],
            full_tables=self.kv.full_table.index_select(0, row_idx),
            slide_tables=self.kv.slide_table.index_select(0, row_idx),
            logits_rows=dev["logits_rows"], decode=False,
            cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(self.device, non_blocking=True),
            ctx_lens=torch.tensor(ctx, dtype=torch.int32).to(self.device, non_blocking=True),
            max_seqlen_q=max(n for _, n in chunks), max_ctx_len=max(ctx))
        return batch, sampled

    # ---- prompt graphs -------------------------------------------------------------------
    def prompt_bucket(self, seq: Sequence, n: int) -> int | None:
        """The prompt-graph length for a chunk of n tokens of seq, if it is the whole rest of the
        prompt (so a token is sampled) and a bucket holds it."""
        if seq.num_computed + n != len(seq.tokens):
            return None
        return next((b for b in self.prompt_buckets if b >= n), None)

    def run_prompt(self, seq: Sequence, n: int) -> int:
        """The rest of seq's prompt (n tokens) through its length bucket's graph (or, where none
        was captured, the same padded step run eagerly: CPU tests); returns the sampled token."""
        bucket = self.prompt_bucket(seq, n)
        if bucket is None:
            raise ValueError(f"no prompt bucket for {n} tokens ending the prompt")
        self._graph_seqs = None  # as for any eager step: the decode buffers must be reloaded
        self.seen.prepare([seq])
        self._load_prompt(seq, n, bucket)
        if bucket in self._prompt_graphs:
            self._prompt_graphs[bucket].replay()
        else:
            self._prompt_body(bucket)
        return int(self._p_out.item())

    def _alloc_prompt_static(self) -> None:
        p, dev = self._p_len, self.device
        # tokens, positions, full slots, slide slots [p]; then the table row, the logits row,
        # the sampling seed and offset: one host buffer, one copy per replay
        self._p_host = torch.zeros(4 * p + 4, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._p_i64 = torch.zeros(4 * p + 4, dtype=torch.int64, device=dev)
        # cu_seqlens [2], ctx_lens [1], top_k [1]
        self._p_host32 = torch.zeros(4, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._p_i32 = torch.zeros(4, dtype=torch.int32, device=dev)
        self._p_hostf = torch.zeros(4, dtype=torch.float32, pin_memory=dev.type == "cuda")
        # temperature, top_p, min_p, repetition penalty
        self._p_f32 = torch.zeros(4, dtype=torch.float32, device=dev)
        self._p_out = torch.zeros(1, dtype=torch.int64, device=dev)

    def _load_prompt(self, seq: Sequence, n: int, bucket: int) -> None:
        """The chunk's metadata into the static prompt buffers, padded to the bucket: pad tokens
        are token 0 at position 0, writing their K/V to slot 0 (scratch block 0)."""
        p, bs, start = self._p_len, self.block_size, seq.num_computed
        pos = np.arange(start, start + n, dtype=np.int64)
        h = self._p_host.numpy()
        h[:] = 0
        h[:n] = seq.tokens[start:start + n]
        h[p:p + n] = pos
        h[2 * p:2 * p + n] = np.asarray(seq.full_blocks, np.int64)[pos // bs] * bs + pos % bs
        h[3 * p:3 * p + n] = np.asarray(seq.slide_blocks, np.int64)[pos // bs] * bs + pos % bs
        h[4 * p:4 * p + 4] = (seq.row, n - 1, seq.seed, seq.num_generated)
        self._p_host32.numpy()[:] = (0, n, start, seq.params.top_k)
        sp = seq.params
        self._p_hostf.numpy()[:] = (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty)
        for dst, src in ((self._p_i64, self._p_host), (self._p_i32, self._p_host32), (self._p_f32, self._p_hostf)):
            dst.copy_(src, non_blocking=True)

    def _prompt_body(self, bucket: int) -> None:
        """The captured prompt step for one sequence padded to `bucket` tokens: forward, penalty,
        sample, and the sampled id into the seen set (the penalty kernels exit at penalty 1)."""
        p, i64, i32, f32 = self._p_len, self._p_i64, self._p_i32, self._p_f32
        row, last, seed, offset = (i64[4 * p + j:4 * p + j + 1] for j in range(4))
        batch = ForwardBatch(
            tokens=i64[:bucket], positions=i64[p:p + bucket], full_slots=i64[2 * p:2 * p + bucket],
            slide_slots=i64[3 * p:3 * p + bucket],
            full_tables=self.kv.full_table.index_select(0, row), slide_tables=self.kv.slide_table.index_select(0, row),
            logits_rows=last, decode=False, cu_seqlens=i32[:2], ctx_lens=i32[2:3],
            max_seqlen_q=bucket, max_ctx_len=0)  # max_ctx_len: a hint prefill_attention does not need
        logits = self.model.forward(batch)
        apply_penalty(logits, self.seen.bits, row, f32[3:4])
        self._p_out.copy_(sample(logits, f32[0:1], i32[3:4], f32[1:2], f32[2:3], seed, offset))
        mark_seen(self.seen.bits, row, self._p_out, f32[3:4])

    def _capture_prompts(self, pool, progress: Callable[[], None] | None) -> None:
        """One prompt graph per length bucket, largest first, into the decode graphs' pool. The
        buffers hold an empty chunk meanwhile (no real token: nothing attends, K/V go to scratch)."""
        self._p_i64.zero_()
        self._p_i32.zero_()
        self._p_f32.copy_(torch.tensor([1.0, 1.0, 0.0, 1.0]))  # temperature, top_p, min_p, penalty
        for b in sorted(self.prompt_buckets, reverse=True):
            pool, self._prompt_graphs[b] = self._capture(partial(self._prompt_body, b), pool)
            if progress:
                progress()

    # ---- graph path ----------------------------------------------------------------------
    def can_replay(self, n: int) -> bool:
        return self.use_graphs and n <= self.max_batch and bool(self._graphs)

    def run_decode_graph(self, seqs: list[Sequence]) -> list[int]:
        """One decode step for sequences that each have exactly one pending token."""
        return self.collect(self.launch_decode_graph(seqs))

    def holds(self, seqs: list[Sequence]) -> bool:
        """Whether the static buffers describe exactly this batch: its next step can be replayed
        from the device state alone (the sampled ids and positions the last replay left there)."""
        return self._graph_seqs == seqs

    def launch_decode_graph(self, seqs: list[Sequence]) -> DecodeLaunch:
        """Replay without waiting: the ids land in a pinned host buffer behind an event, so the
        next replay may be queued before they are read (`collect`)."""
        if not self.holds(seqs):
            self._load_static(seqs)
        bucket = next(b for b in self.buckets if b >= len(seqs))
        self._graphs[bucket].replay()
        self._out_slot ^= 1  # two host buffers: the previous launch's ids may still be unread
        host, done = self._host_out[self._out_slot][: len(seqs)], self._out_done[self._out_slot]
        host.copy_(self._s_out[: len(seqs)], non_blocking=True)
        if done is not None:
            done.record()
        return DecodeLaunch(host, done)

    @staticmethod
    def collect(launch: DecodeLaunch) -> list[int]:
        """The sampled ids of a launch (the step's one host sync)."""
        if launch.done is not None:
            launch.done.synchronize()
        return launch.ids.tolist()

    def _alloc_static(self) -> None:
        m, dev = self.max_batch, self.device
        self._s_tokens = torch.zeros(m, dtype=torch.int64, device=dev)
        self._s_positions = torch.zeros(m, dtype=torch.int64, device=dev)
        self._s_rows = torch.zeros(m, dtype=torch.int64, device=dev)
        self._s_active = torch.zeros(m, dtype=torch.int64, device=dev)
        self._s_sampling = SamplingRows(
            torch.zeros(m, dtype=torch.float32, device=dev), torch.zeros(m, dtype=torch.int32, device=dev),
            torch.ones(m, dtype=torch.float32, device=dev), torch.zeros(m, dtype=torch.float32, device=dev),
            torch.zeros(m, dtype=torch.int64, device=dev), torch.zeros(m, dtype=torch.int64, device=dev))
        self._s_penalty = torch.ones(m, dtype=torch.float32, device=dev)
        self._s_out = torch.zeros(m, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self._host_out = [torch.zeros(m, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._out_done = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._out_slot = 0

    def _load_static(self, seqs: list[Sequence]) -> None:
        n, m = len(seqs), self.max_batch
        pad = lambda a, fill=0: np.concatenate([a, np.full(m - n, fill, a.dtype)])  # noqa: E731
        host = [pad(np.array([s.tokens[s.num_computed] for s in seqs], np.int64)),
                pad(np.array([s.num_computed for s in seqs], np.int64)),
                pad(np.array([s.row for s in seqs], np.int64)),
                pad(np.ones(n, np.int64))]
        for dst, src in zip((self._s_tokens, self._s_positions, self._s_rows, self._s_active), host):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
        fills = (1.0, 0, 1.0, 0.0, 0, 0)
        for dst, src, fill in zip(self._s_sampling.args(), _sampling_host(seqs), fills):
            dst.copy_(torch.from_numpy(pad(src, fill)), non_blocking=True)
        penalty = np.array([s.params.repetition_penalty for s in seqs], np.float32)
        # No seen.prepare here: a decoding sequence sampled its first token in an eager or prompt
        # step on this row, which built the row's bits.
        self._s_penalty.copy_(torch.from_numpy(pad(penalty, 1.0)), non_blocking=True)
        self._graph_seqs = list(seqs)

    def _decode_body(self, b: int) -> None:
        """The captured step for bucket b: forward, repetition penalty (its programs exit at
        penalty 1), sample, advance inputs in place (the bookkeeping on either side of the forward
        is one launch each: kernels.decode_step)."""
        tok, pos, rows, active = self._s_tokens[:b], self._s_positions[:b], self._s_rows[:b], self._s_active[:b]
        m = decode_slots(pos, rows, active, self.kv.full_table, self.kv.slide_table, self.block_size)
        batch = ForwardBatch(tok, pos, m.full_slots, m.slide_slots, m.full_tables, m.slide_tables, None, True,
                             m.seq_lens, self._splits[b])
        logits = self.model.forward(batch)
        seen = SeenSets(self.seen.bits, rows, self._s_penalty[:b])
        apply_penalty(logits, seen.bits, seen.rows, seen.penalty)
        s = self._s_sampling
        nxt = sample(logits, *(t[:b] for t in s.args()))
        advance_decode(nxt, self._s_out[:b], tok, pos, s.offsets[:b], active, seen)

    def capture(self, max_context: int, progress: Callable[[int, int], None] | None = None) -> None:
        """Warm up (compile) and capture one decode graph per batch bucket and one prompt graph per
        length bucket, largest first."""
        cfg = self.model.cfg
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        self._splits = {b: (choose_num_splits(b, cfg.num_key_value_heads, max_context, sms),
                            choose_num_splits(b, cfg.num_key_value_heads, cfg.sliding_window, sms))
                        for b in self.buckets}
        if not self.use_graphs:
            return
        self._load_static([])
        pool, done, total = None, 0, len(self.buckets) + len(self.prompt_buckets)

        def tick() -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, total)

        for b in sorted(self.buckets, reverse=True):
            pool, self._graphs[b] = self._capture(partial(self._decode_body, b), pool)
            tick()
        self._load_static([])
        self._graph_seqs = None
        self._capture_prompts(pool, tick)

    def _capture(self, body: Callable[[], None], pool) -> tuple[object, torch.cuda.CUDAGraph]:
        """Run `body` once on a side stream (Triton compiles outside the capture), then capture it
        into a graph sharing `pool`; returns (the pool, the graph)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body()
        return graph.pool(), graph
