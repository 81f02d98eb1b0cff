"""Does a smaller block-output gain make random 20b less chaotic (bf16 vs fp32 reference)?"""
import math, sys
import torch
import gptoss_cli.runtime.random_checkpoint as rc
from gptoss_cli.runtime.model_ref import ReferenceModel
gain = float(sys.argv[1])
orig_f, orig_p = rc._float_tensor, rc._packed_tensor
def f(name, shape, g, device):
    t = orig_f(name, shape, g, device)
    return (t.float() * gain).to(torch.bfloat16) if name.endswith("o_proj.weight") else t
def pk(name, shape, g, device):
    t = orig_p(name, shape, g, device)
    if name.endswith("down_proj_scales"):
        t = (t.int() + round(math.log2(gain))).to(torch.uint8)
    return t
rc._float_tensor, rc._packed_tensor = f, pk
ids = torch.randint(0, 199998, (200,), generator=torch.Generator().manual_seed(1)).tolist()
def rel(a, b): a, b = a.float(), b.float(); return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()
out = {}
for dt in (torch.bfloat16, torch.float32):
    m = ReferenceModel(rc.random_weights("20b", seed=0, device="cuda"), dtype=dt)
    out[dt] = m.forward([(ids, m.new_cache())], all_logits=True)
    del m
    torch.cuda.empty_cache()
a, b = out[torch.bfloat16], out[torch.float32]
print(f"gain {gain}: bf16 vs fp32 mean row rel err {rel(a, b):.4f}, argmax agree {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.3f}", flush=True)
