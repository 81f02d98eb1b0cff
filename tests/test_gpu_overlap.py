"""The overlapped decode step (GpuEngineConfig.overlap_steps) keeps every request's tokens.

The engine's own scheduler, KV manager and bookkeeping run; the runner is replaced by a
simulated device whose sampled token depends only on (input token, position), with a graph
path that feeds its ids back on the "device" like the CUDA graphs do. So the overlapped engine
must produce exactly the tokens of the ordinary one, through stop tokens in the middle of a
launched-ahead step, lengths, aborts, admissions and preemption, and leave no block held.
"""

import pytest
import torch

from gptoss_cli.runtime.api import SamplingParams
from gptoss_cli.runtime.gpu.engine import GpuEngine
from gptoss_cli.runtime.gpu.runner import DecodeLaunch
from gptoss_cli.runtime.gpu.sequence import PENDING_TOKEN
from gptoss_cli.runtime.random_checkpoint import random_weights

STOP = 7


def _next(token: int, position: int) -> int:
    """The simulated model: a stop token at every 23rd position, otherwise a hash."""
    return STOP if position % 23 == 0 else (token * 31 + position) % 5000 + 10


class SimulatedRunner:
    """Runner stand-in: eager steps read the host tokens; graph launches continue from the
    device state of the last launch when the batch is unchanged (as the static buffers do)."""

    def __init__(self):
        self._graph_seqs = None
        self._device = {}  # id(seq) -> (next input token, its position): the static buffers
        self.graph_launches = 0

    def can_replay(self, n):
        return True

    def holds(self, seqs):
        return self._graph_seqs == seqs

    def run_eager(self, chunks):
        self._graph_seqs = None
        out = []
        for seq, n in chunks:
            last = seq.num_computed + n - 1
            assert PENDING_TOKEN not in seq.tokens[: last + 1], "an eager step read an unread token"
            out.append(_next(seq.tokens[last], last + 1) if last + 1 == len(seq.tokens) else None)
        return out

    def launch_decode_graph(self, seqs):
        if not self.holds(seqs):
            for s in seqs:
                assert s.tokens[s.num_computed] != PENDING_TOKEN, "static buffers loaded from an unread token"
                self._device[id(s)] = (s.tokens[s.num_computed], s.num_computed)
            self._graph_seqs = list(seqs)
        ids = []
        for s in seqs:
            token, pos = self._device[id(s)]
            nxt = _next(token, pos + 1)
            self._device[id(s)] = (nxt, pos + 1)
            ids.append(nxt)
        self.graph_launches += 1
        return DecodeLaunch(torch.tensor(ids), None)

    def run_decode_graph(self, seqs):
        return self.collect(self.launch_decode_graph(seqs))

    @staticmethod
    def collect(launch):
        return launch.ids.tolist()


def _engine(overlap, kv_memory_bytes=8 << 20):
    # The engine takes the tensors over, so each engine gets its own copy of the weights.
    eng = GpuEngine(random_weights("tiny", seed=1), max_batch=4, max_step_tokens=64, block_size=16, kv_memory_bytes=kv_memory_bytes,
                    max_context=512, dtype="float32", cuda_graphs=False, warm_up=False, overlap_steps=overlap)
    eng.runner = SimulatedRunner()
    eng.steps_ahead = 0
    step_ahead = eng._step_ahead

    def counted():
        eng.steps_ahead += 1
        return step_ahead()

    eng._step_ahead = counted
    return eng


def _drive(eng, requests, abort_at=None, late=()):
    """Run requests [(prompt, params)] to the end; optionally abort the second one after
    `abort_at` steps and add `late` requests after 5 steps. Returns [(tokens, reason)] in order."""
    ids = [eng.add_request(p, params) for p, params in requests]
    done = {}
    steps = 0
    while eng.has_unfinished():
        for e in eng.step():
            if e.finish_reason is not None:
                done[e.request_id] = (e.output.token_ids, e.finish_reason)
        steps += 1
        if steps == abort_at:
            out = eng.abort(ids[1])
            done[ids[1]] = (out.token_ids, out.finish_reason)
        if steps == 5:
            ids += [eng.add_request(p, params) for p, params in late]
        assert steps < 2000
    eng.step()  # a step still ahead is read (and dropped) by the next call
    return [done[i] for i in ids]


def _requests():
    stop = SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=(STOP,))
    run = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    return [([11] * n, stop if n % 2 else run) for n in (3, 20, 37, 50)]


@pytest.mark.parametrize("abort_at,late", [(None, ()), (9, ()), (None, (([5] * 9, SamplingParams(max_tokens=30, ignore_eos=True)),))])
def test_overlapped_steps_give_the_same_tokens(abort_at, late):
    want_eng, got_eng = _engine(False), _engine(True)
    want = _drive(want_eng, _requests(), abort_at, late)
    got = _drive(got_eng, _requests(), abort_at, late)
    if abort_at:
        # The overlapped engine is one token behind when the abort comes: its unread token goes.
        (g, g_reason), (w, w_reason) = got.pop(1), want.pop(1)
        assert g_reason == w_reason == "abort" and g == w[: len(g)] and len(w) - len(g) <= 1
    assert got == want
    assert any(reason == "stop" for _, reason in want) and any(reason == "length" for _, reason in want)
    assert got_eng.steps_ahead > 0.5 * got_eng.num_steps and want_eng.steps_ahead == 0  # the overlap did run
    assert got_eng.free_blocks() == want_eng.free_blocks()  # nothing held after the last request
    assert got_eng._ahead is None or not got_eng.has_unfinished()


def test_overlap_keeps_steps_ahead_and_survives_preemption():
    # A KV budget too small for all four at full length forces preemption (always after a drain).
    eng = _engine(True, kv_memory_bytes=4_000_000)
    ref = _engine(False, kv_memory_bytes=4_000_000)
    reqs = [([3] * 40, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)) for _ in range(4)]
    assert _drive(eng, reqs) == _drive(ref, reqs)
    assert eng.scheduler.num_preemptions == ref.scheduler.num_preemptions > 0
    assert eng.free_blocks() == ref.free_blocks() and eng.steps_ahead > 100
