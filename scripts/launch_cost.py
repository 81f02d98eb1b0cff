"""What one more link in the decode step's chain of dependent launches costs (H200 machine).

    PYTHONPATH=src:scripts python scripts/launch_cost.py [--model 20b] [--hops 0 1 2] [--rounds 2]

Fusing two launches into one saves the work moved plus one link of the chain: the drain of one
kernel, the start of the next and, with PDL, the wait between them. This measures the link alone:
engines whose decode graphs carry `hops` extra one-program launches per layer (after the MoE
block, where the next layer's qkv would wait for them), each doing nothing but the PDL wait, are
built in turn (0, 1, 2, 0, 1, 2, ...) and each times batch-1 decode after a 128-token prompt.
The slope of step time over hops per layer is the cost of a link; the outputs are unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl
from gpu_check import _bench_engine, _release

from gptoss_cli.kernels.pdl import pdl_enabled, pdl_launch, wait_for_previous


@triton.jit
def _hop_kernel(PDL: tl.constexpr):
    wait_for_previous(PDL)


class Hops:
    """Wraps runtime.gpu.model.moe_block so every call is followed by `count` empty launches."""

    def __init__(self):
        from gptoss_cli.runtime.gpu import model

        self.model, self.base, self.count = model, model.moe_block, 0
        model.moe_block = self._block

    def _block(self, *args, **kwargs):
        h, residual = self.base(*args, **kwargs)
        for _ in range(self.count):
            _hop_kernel[(1,)](**pdl_launch(pdl_enabled(h)))
        return h, residual


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20b", choices=["tiny", "20b", "120b"])
    parser.add_argument("--hops", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from gptoss_cli.runtime.gpu.engine import GpuEngine
    from gptoss_cli.runtime.random_checkpoint import random_weights

    hops = Hops()
    tok_s: dict[int, list[float]] = {n: [] for n in args.hops}
    layers = 0
    for rnd in range(args.rounds):
        for n in args.hops:
            hops.count = n
            eng = GpuEngine(random_weights(args.model, device="cuda"), max_batch=1)
            layers = eng.config.num_hidden_layers
            tok_s[n].append(_bench_engine(f"hops {n} round {rnd}", eng, 1, 128, 256))
            del eng
            _release()
    print()
    ms = {n: 1e3 / statistics.median(v) for n, v in tok_s.items()}
    for n, v in tok_s.items():
        print(f"{n} extra launches per layer: median {statistics.median(v):,.1f} tok/s ({ms[n]:.4f} ms/step) over "
              f"{[round(x, 1) for x in v]}")
    if len(ms) > 1 and layers:
        ns = sorted(ms)
        slope = (ms[ns[-1]] - ms[ns[0]]) / (ns[-1] - ns[0]) / layers * 1e3
        print(f"one more dependent launch per layer: {slope:.2f} us each ({layers} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
