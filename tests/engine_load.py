"""Load check for any Engine (helper, no tests here): many requests of random lengths and sampling
settings arrive in waves while others run; every completed output must equal the same request run
alone, and the KV free-block count must return to its starting value.

    report = run_load_check(engine, num_requests=1000, seed=0, max_prompt=600, max_new=32)
    assert report.ok, report.summary()

Greedy and sampled mismatches are reported apart: greedy outputs must match; seeded sampling
(uniforms keyed by seed and token index, not by batch row) should match too. On an engine with
`score()`, each mismatch gets a `gap`: at the first difference, in the fp32 logits of the shared
context, how far the alone run's token beats the batched one (greedy: logit difference; sampled:
difference of the sampler's scores l + T*G over the kept set, inf if the batched token is filtered
out). A gap near 0 is a numerical near-tie (batch-dependent summation order); a large one is a bug.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gptoss_cli.runtime.api import Engine, RequestOutput, SamplingParams

PROMPT_VOCAB = 199998  # ordinary token ids 0..199997 (no special tokens)


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: list[int]
    params: SamplingParams
    abort_at_step: int | None = None  # abort after this many load steps since its arrival (< max_tokens)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0


@dataclass
class Mismatch:
    index: int
    greedy: bool
    position: int  # first differing token index (the shorter length if one is a prefix of the other)
    batched: list[int]
    alone: list[int]
    gap: float | None = None  # see the module docstring; near 0: a numerical near-tie, large: a bug


@dataclass
class LoadReport:
    requests: int
    greedy: int
    sampled: int
    aborted: int = 0  # requests aborted before finishing, waiting or running (not compared)
    greedy_compared: int = 0  # completed requests rerun alone and compared
    sampled_compared: int = 0
    greedy_mismatches: list[Mismatch] = field(default_factory=list)
    sampled_mismatches: list[Mismatch] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # API misbehaviour: lengths, events, finish reasons
    free_blocks_before: object = None
    free_blocks_after_load: object = None
    free_blocks_after: object = None  # after the alone runs too
    generated_tokens: int = 0  # in the load run
    steps: int = 0  # engine steps of the load run
    max_concurrent: int = 0  # most tokens one load step emitted
    mixed_steps: int = 0  # load steps that emitted first tokens (prefills) and later ones (decodes)
    cached_prompt_tokens: int = 0  # prefix-cache hits over the load run's completed requests
    preemptions: int | None = None
    load_seconds: float = 0.0
    alone_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def blocks_restored(self) -> bool:
        return self.free_blocks_before == self.free_blocks_after_load == self.free_blocks_after

    @property
    def ok(self) -> bool:
        return not (self.greedy_mismatches or self.sampled_mismatches or self.errors) and self.blocks_restored

    def summary(self) -> str:
        lines = [
            (f"{self.requests} requests ({self.greedy} greedy, {self.sampled} sampled, {self.aborted} aborted), "
             f"{self.generated_tokens} tokens in {self.steps} steps (max {self.max_concurrent}/step, "
             f"{self.mixed_steps} mixed prefill+decode, {self.preemptions} preemptions, "
             f"{self.cached_prompt_tokens} prefix-cached prompt tokens); load {self.load_seconds:.1f}s, alone {self.alone_seconds:.1f}s"),
            (f"greedy mismatches {len(self.greedy_mismatches)}/{self.greedy_compared}, "
             f"sampled mismatches {len(self.sampled_mismatches)}/{self.sampled_compared}, errors {len(self.errors)}"),
            (f"free blocks before {self.free_blocks_before}, after load {self.free_blocks_after_load}, "
             f"after alone runs {self.free_blocks_after}"),
        ]
        for m in (self.greedy_mismatches + self.sampled_mismatches)[:10]:
            gap = "" if m.gap is None else f", gap {m.gap:.3g}"
            lines.append(f"  request {m.index} ({'greedy' if m.greedy else 'sampled'}) differs at token {m.position}"
                         f"{gap}: batched {m.batched[m.position:m.position + 4]} alone {m.alone[m.position:m.position + 4]}")
        lines += [f"  error: {e}" for e in self.errors[:10]]
        return "\n".join(lines)


def make_requests(num_requests: int, seed: int, max_prompt: int, max_new: int, *, greedy_fraction: float = 0.5,
                  filter_prob: float = 1 / 3, shared_prefix: float = 0.25,
                  abort_fraction: float = 0.0) -> list[LoadRequest]:
    """Seeded random requests. Sampled ones: temperature in [0.3, 1.5], each of top_k / top_p / min_p
    with probability `filter_prob`, own seed. `shared_prefix` of the prompts start with a prefix of an
    earlier prompt (prefix cache and shared blocks under load); `abort_fraction` are aborted before
    they can finish. ignore_eos, so every output has exactly max_tokens tokens."""
    rng = random.Random(seed)
    out: list[LoadRequest] = []
    for i in range(num_requests):
        length = rng.randint(1, max_prompt)
        prompt = [rng.randrange(PROMPT_VOCAB) for _ in range(length)]
        if out and rng.random() < shared_prefix:
            donor = rng.choice(out).prompt
            keep = rng.randint(1, min(len(donor), length))
            prompt[:keep] = donor[:keep]
        max_tokens = rng.randint(1, max_new)
        if rng.random() < greedy_fraction:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(
                temperature=round(rng.uniform(0.3, 1.5), 3),
                top_k=rng.randint(1, 200) if rng.random() < filter_prob else 0,
                top_p=round(rng.uniform(0.5, 1.0), 3) if rng.random() < filter_prob else 1.0,
                min_p=round(rng.uniform(0.0, 0.2), 3) if rng.random() < filter_prob else 0.0,
                seed=rng.randrange(2**63), max_tokens=max_tokens, ignore_eos=True)
        abort = rng.randint(0, max_tokens - 1) if rng.random() < abort_fraction else None
        out.append(LoadRequest(i, prompt, params, abort))
    return out


def _free_blocks(engine: Engine):
    fn = getattr(engine, "free_blocks", None)
    return fn() if fn is not None else None


def _preemptions(engine: Engine) -> int | None:
    return getattr(getattr(engine, "scheduler", None), "num_preemptions", None)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _gap(engine: Engine, request: LoadRequest, m: Mismatch) -> float:
    """Score of the alone token minus that of the batched one where they first differ."""
    import torch

    from gptoss_cli.kernels.sampling import filter_ref, row_key, uniform_ref

    logits = engine.score(request.prompt + m.alone[:m.position])[-1].float().cpu()
    a, b = m.alone[m.position], m.batched[m.position]
    p = request.params
    if p.temperature > 0:
        def one(x, dtype=torch.float32):
            return torch.tensor([x], dtype=dtype)

        _, drop = filter_ref(logits[None], one(p.temperature), one(p.top_k, torch.int64), one(p.top_p),
                             one(p.min_p))
        u = uniform_ref(row_key(one(p.seed, torch.int64), one(m.position, torch.int64)), logits.shape[0])[0]
        logits = (logits - p.temperature * torch.log(-torch.log(u))).masked_fill(drop[0], float("-inf"))
    return float(logits[a] - logits[b])


def run_load_check(engine: Engine | Callable[[], Engine], num_requests: int = 1000, seed: int = 0,
                   max_prompt: int = 600, max_new: int = 32, *, initial: int | None = None,
                   per_step: int | None = None, requests: list[LoadRequest] | None = None,
                   diagnose: bool = True, progress: Callable[[str], None] | None = None,
                   **request_options) -> LoadReport:
    """Run the load on `engine` (or a zero-argument factory), then each request alone on the same engine.

    `initial` requests are queued before the first step, then `per_step` more before each step until
    all are in (defaults: a quarter at once, then about 2% of them per step), so new prompts are
    prefilled next to running decodes. `requests` overrides the generated ones; `request_options`
    go to `make_requests`. `progress` gets a line every 250 load steps, after the load and every 100 alone runs.
    """
    say = progress or (lambda line: None)
    t_start = time.perf_counter()
    engine = engine if isinstance(engine, Engine) else engine()
    if requests is None:
        requests = make_requests(num_requests, seed, max_prompt, max_new, **request_options)
    n = len(requests)
    initial = max(1, n // 4) if initial is None else initial
    per_step = max(1, n // 50) if per_step is None else per_step
    report = LoadReport(n, sum(r.greedy for r in requests), sum(not r.greedy for r in requests))
    if engine.has_unfinished():
        raise RuntimeError("run_load_check needs an idle engine")
    report.free_blocks_before = _free_blocks(engine)
    preempt0 = _preemptions(engine)

    # ---- load: waves of arrivals while earlier requests run --------------------------------
    rid = {r.index: f"load-{r.index}" for r in requests}
    streamed: dict[str, list[int]] = {v: [] for v in rid.values()}
    outputs: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    arrived: dict[str, int] = {}
    pending = deque(requests)
    to_abort: list[LoadRequest] = []
    idle_steps, stuck = 0, False
    t = time.perf_counter()
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), initial if report.steps == 0 else per_step)):
            r = pending.popleft()
            engine.add_request(r.prompt, r.params, request_id=rid[r.index])
            arrived[rid[r.index]] = report.steps
            if r.abort_at_step is not None:
                to_abort.append(r)
        for r in [r for r in to_abort if report.steps - arrived[rid[r.index]] >= r.abort_at_step]:
            to_abort.remove(r)
            key = rid[r.index]
            if key in outputs:
                continue  # finished before its abort time: compared like the others
            out = engine.abort(key)
            aborted.add(key)
            if out is None or out.finish_reason != "abort" or out.token_ids != streamed[key]:
                report.errors.append(f"abort of {key} returned {out and (out.finish_reason, out.token_ids)}")
        events = engine.step()
        report.steps += 1
        if report.steps % 250 == 0:
            say(f"load: step {report.steps}, {len(pending)} not yet queued, {len(outputs)} done, "
                f"{time.perf_counter() - t:.1f}s")
        report.max_concurrent = max(report.max_concurrent, len(events))
        report.mixed_steps += len({ev.index == 0 for ev in events}) == 2
        idle_steps = 0 if events else idle_steps + 1
        if idle_steps > 1000:  # stuck: drop what is left so the engine is idle for the alone runs
            report.errors.append(f"no tokens for 1000 steps; {len(pending)} requests not yet queued")
            for key in arrived.keys() - outputs.keys() - aborted:
                engine.abort(key)
                aborted.add(key)
            stuck = True
            break
        for ev in events:
            if ev.request_id not in streamed or ev.request_id in outputs or ev.request_id in aborted:
                report.errors.append(f"unexpected event for {ev.request_id} (index {ev.index})")
                continue
            if ev.index != len(streamed[ev.request_id]):
                report.errors.append(f"{ev.request_id}: event index {ev.index}, expected {len(streamed[ev.request_id])}")
            streamed[ev.request_id].append(ev.token_id)
            report.generated_tokens += 1
            if ev.output is not None:
                outputs[ev.request_id] = ev.output
                report.cached_prompt_tokens += ev.output.cached_prompt_tokens
    report.load_seconds = time.perf_counter() - t
    say(f"load: {report.steps} steps, {report.generated_tokens} tokens in {report.load_seconds:.1f}s")
    report.aborted = len(aborted)
    report.free_blocks_after_load = _free_blocks(engine)

    # ---- each completed request alone, compared token by token -----------------------------
    t = time.perf_counter()
    for done, r in enumerate(requests if not stuck else []):  # a stuck engine would hang in generate() too
        if done and done % 100 == 0:
            say(f"alone: {done}/{n} in {time.perf_counter() - t:.1f}s")
        key = rid[r.index]
        if key in aborted:
            continue
        out = outputs.get(key)
        want_len = engine.max_new_tokens(len(r.prompt), r.params)
        if out is None:
            report.errors.append(f"{key}: no final event")
            continue
        if out.token_ids != streamed[key] or out.finish_reason != "length" or len(out.token_ids) != want_len:
            report.errors.append(f"{key}: finish {out.finish_reason}, {len(out.token_ids)} tokens (want {want_len}), "
                                 f"output {'==' if out.token_ids == streamed[key] else '!='} streamed tokens")
        alone = engine.generate([r.prompt], r.params)[0].token_ids
        report.greedy_compared += r.greedy
        report.sampled_compared += not r.greedy
        pos = _first_diff(out.token_ids, alone)
        if pos is not None:
            m = Mismatch(r.index, r.greedy, pos, list(out.token_ids), list(alone))
            (report.greedy_mismatches if r.greedy else report.sampled_mismatches).append(m)
    report.alone_seconds = time.perf_counter() - t
    report.free_blocks_after = _free_blocks(engine)
    p1 = _preemptions(engine)
    report.preemptions = None if p1 is None or preempt0 is None else p1 - preempt0

    if diagnose and hasattr(engine, "score"):
        by_index = {r.index: r for r in requests}
        for m in report.greedy_mismatches + report.sampled_mismatches:
            if m.position < min(len(m.batched), len(m.alone)):
                m.gap = _gap(engine, by_index[m.index], m)
    report.wall_seconds = time.perf_counter() - t_start
    return report
