"""CPU engine invariants on random:tiny: seeds reproduce, batching and prefix reuse change
nothing, stop tokens and max_tokens end requests, abort removes a request, bad requests fail."""

import pytest
import torch

from gptoss_cli.runtime.api import SamplingParams
from gptoss_cli.runtime.cpu_engine import CpuEngine
from gptoss_cli.runtime.errors import RequestError
from gptoss_cli.runtime.random_checkpoint import random_weights


@pytest.fixture(scope="module")
def weights():
    return random_weights("tiny", seed=2)


@pytest.fixture
def engine(weights):
    return CpuEngine(weights, max_context=4096)


def _prompt(n, seed):
    return torch.randint(0, 199998, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_seed_reproduces_and_differs(engine):
    p = _prompt(40, 1)
    a = engine.generate([p], SAMPLED)[0].token_ids
    b = engine.generate([p], SAMPLED)[0].token_ids
    c = engine.generate([p], SamplingParams(**{**SAMPLED.__dict__, "seed": 99}))[0].token_ids
    assert a == b and a != c and len(a) == 12


def test_batched_equals_one_at_a_time(weights):
    prompts = [_prompt(n, n) for n in (5, 60, 133)]
    together = CpuEngine(weights, prefill_chunk=64).generate(prompts, SAMPLED)
    alone = [CpuEngine(weights).generate([p], SAMPLED)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_prefix_reuse_gives_same_tokens(weights):
    engine = CpuEngine(weights)
    first = _prompt(150, 3)
    out1 = engine.generate([first], GREEDY)[0]
    follow = first + out1.token_ids[:5] + _prompt(20, 4)
    cached = engine.generate([follow], GREEDY)[0]
    fresh = CpuEngine(weights).generate([follow], GREEDY)[0]
    assert cached.cached_prompt_tokens == 155 and fresh.cached_prompt_tokens == 0
    assert cached.token_ids == fresh.token_ids


def test_stop_token_ends_request(engine):
    p = _prompt(30, 5)
    free = engine.generate([p], GREEDY)[0].token_ids
    stop_at = free[3]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_at,))
    out = engine.generate([p], params)[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(stop_at) + 1]


def test_length_limit_and_context_limit(weights):
    engine = CpuEngine(weights, max_context=40)
    out = engine.generate([_prompt(35, 6)], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stream_events_and_abort(engine):
    p = _prompt(20, 7)
    events = []
    for ev in engine.stream(p, SAMPLED):
        events.append(ev)
        if len(events) == 3:
            break
    assert [e.index for e in events] == [0, 1, 2] and events[-1].finish_reason is None
    assert not engine.has_unfinished()
    rid = engine.add_request(p, SAMPLED)
    engine.step()
    assert engine.abort(rid).finish_reason == "abort"
    assert not engine.has_unfinished() and engine.step() == []


def test_final_event_carries_output_and_timestamps(engine):
    events = list(engine.stream(_prompt(10, 8), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    out = events[-1].output
    assert out is not None and out.token_ids == [e.token_id for e in events]
    t = out.timings
    assert t.arrival <= t.first_token <= t.finished


@pytest.mark.parametrize("prompt, code", [([], "empty_prompt"), ([1] * 4096, "context_length_exceeded"),
                                          ([201088], "invalid_token")])
def test_bad_requests_raise(engine, prompt, code):
    with pytest.raises(RequestError) as info:
        engine.add_request(prompt, GREEDY)
    assert info.value.code == code


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                                          ("top_k", -1), ("min_p", 2.0), ("max_tokens", 0),
                                          ("temperature", float("nan"))])
def test_bad_sampling_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unfiltered_fast_path_equals_the_twin():
    from gptoss_cli.kernels.sampling import sample_ref
    from gptoss_cli.runtime.cpu_engine import _sample_unfiltered

    class _S:  # the fields the sampler reads
        def __init__(self, seed, n):
            self.seed, self.out = seed, type("O", (), {"token_ids": [0] * n})()

    logits = torch.randn(5, 3001) * 3
    params = [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0, 1.7, 1.0)]
    seqs = [_S(11 * i + 1, i) for i in range(5)]
    f = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    want = sample_ref(logits, f([p.temperature for p in params]), torch.zeros(5, dtype=torch.long), f([1.0] * 5),
                      f([0.0] * 5), torch.tensor([s.seed for s in seqs]), torch.tensor([len(s.out.token_ids) for s in seqs]))
    assert _sample_unfiltered(logits, params, seqs) == want.tolist()


def test_load_many_requests_each_equals_running_alone(weights):
    """Random lengths and sampling settings, all at once through continuous batching: every
    output equals the same request run alone (seeded, counter-based sampling is batch-free)."""
    import random

    rng = random.Random(3)
    reqs = []
    for i in range(40):
        params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([0, 0, 50]), seed=rng.randrange(1 << 30),
                                max_tokens=rng.randint(1, 4), ignore_eos=True)
        reqs.append((_prompt(rng.randint(1, 90), 100 + i), params))
    engine = CpuEngine(weights, max_batch=16, prefill_chunk=128)
    for prompt, params in reqs:
        engine.add_request(prompt, params)
    together = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.output is not None:
                together[ev.request_id] = ev.output.token_ids
    alone = [CpuEngine(weights).generate([p], params)[0].token_ids for p, params in reqs]
    assert [together[f"req-{i}"] for i in range(40)] == alone


def _greedy_penalised(weights, prompt, n, penalty):
    """Step-by-step greedy decoding with the repetition penalty's twin over prompt + output."""
    from gptoss_cli.kernels.penalty import apply_penalty_mask_ref
    from gptoss_cli.runtime.model_ref import ReferenceModel

    ref = ReferenceModel(weights)
    cache, ids, out = ref.new_cache(), prompt, []
    for _ in range(n):
        logits = ref.forward([(ids, cache)])[0]
        seen = torch.zeros(1, logits.shape[0], dtype=torch.bool)
        seen[0, prompt + out] = True
        out.append(int(apply_penalty_mask_ref(logits[None], seen, torch.tensor([penalty]))[0].argmax()))
        ids = [out[-1]]
    return out


def test_repetition_penalty(weights):
    # Below 1 from a one-token prompt, the boosted tokens it generated come back (a loop): the
    # generated tokens are in the seen set. Above 1 with a prompt that starts with greedy's own
    # next token, that token is pushed off the top: the prompt is in the seen set.
    engine = CpuEngine(weights)
    loop_prompt = _prompt(1, 7)
    favour = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=0.5)
    looped = engine.generate([loop_prompt], favour)[0].token_ids
    assert looped == _greedy_penalised(weights, loop_prompt, 8, 0.5)
    assert len(set(looped)) < len(looped) and looped != engine.generate([loop_prompt], GREEDY)[0].token_ids[:8]
    base = _prompt(12, 8)
    prompt = engine.generate([base], GREEDY)[0].token_ids[:1] + base
    avoid = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, repetition_penalty=3.0)
    got = engine.generate([prompt], avoid)[0].token_ids
    assert got == _greedy_penalised(weights, prompt, 4, 3.0)
    assert got[0] != engine.generate([prompt], GREEDY)[0].token_ids[0]
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)
