"""Host time per engine step spent in the scheduler and KV bookkeeping (a script, not a test).

The GPU waits for this work every step (one sync per step), so it adds to every step's time.
Simulates `--batch` sequences decoding after `--prompt`-token prompts, all submitted at once:
schedule() and computed() per step, no model; decode-only steps and steps with prompt chunks
are reported apart. Runs anywhere (pure Python).

    PYTHONPATH=src python benchmarks/bench_scheduler.py [--batch 256] [--prompt 1024] [--steps 400]
"""

from __future__ import annotations

import argparse
import random
import time

from gptoss_cli.runtime.api import RequestOutput, SamplingParams
from gptoss_cli.runtime.gpu.kv_manager import KvManager
from gptoss_cli.runtime.gpu.scheduler import Scheduler
from gptoss_cli.runtime.gpu.sequence import Sequence

BLOCK_SIZE, WINDOW = 64, 128


def bench(batch: int, prompt: int, steps: int, seed: int = 0) -> dict:
    blocks = batch * (prompt + steps) // BLOCK_SIZE + 2 * batch
    # A prompt chunk holds sliding blocks for all its positions until the window passes them.
    kv = KvManager(blocks, batch * (prompt // BLOCK_SIZE + 4) + 8, BLOCK_SIZE, WINDOW)
    sched = Scheduler(kv, batch, max(8192, batch))
    rng = random.Random(seed)
    for i in range(batch):
        tokens = [rng.randrange(199998) for _ in range(prompt)]
        sched.add(Sequence(RequestOutput(f"r{i}", tokens), SamplingParams(), 1, steps + 8, tokens=list(tokens)))
    decode_ms, mixed_ms = [], []
    for _ in range(steps):
        t = time.perf_counter()
        plan = sched.schedule()
        for seq, n in plan.chunks:
            kv.computed(seq, n)
            if seq.num_pending == 0:
                seq.tokens.append(5)
                seq.out.token_ids.append(5)
        kv.updates.clear()
        (decode_ms if plan.decode_only else mixed_ms).append((time.perf_counter() - t) * 1e3)
    decode_ms.sort()
    mixed_ms.sort()
    return {"batch": batch, "decode_steps": len(decode_ms),
            "median_ms": decode_ms[len(decode_ms) // 2] if decode_ms else float("nan"),
            "mixed_steps": len(mixed_ms), "mixed_median_ms": mixed_ms[len(mixed_ms) // 2] if mixed_ms else float("nan"),
            "mixed_max_ms": mixed_ms[-1] if mixed_ms else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    for b in args.batch:
        r = bench(b, args.prompt, args.steps)
        print(f"batch {r['batch']:>4}: {r['median_ms']:.3f} ms host time per decode step (median of {r['decode_steps']}); "
              f"steps with prompt chunks: median {r['mixed_median_ms']:.3f} ms, max {r['mixed_max_ms']:.3f} ms "
              f"({r['mixed_steps']} steps)")


if __name__ == "__main__":
    main()
