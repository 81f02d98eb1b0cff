"""Is the random 20b chaotic? bf16 reference vs transformers bf16, and fp32 vs bf16 reference."""
import torch
from pathlib import Path
from gptoss_cli.runtime.checkpoint import load_checkpoint
from gptoss_cli.runtime.model_ref import ReferenceModel
path = Path("/tmp/random-20b")
ids = torch.randint(0, 199998, (200,), generator=torch.Generator().manual_seed(1)).tolist()
def rel(a, b): a, b = a.float(), b.float(); return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()
r16 = ReferenceModel(load_checkpoint(path, device="cuda"), dtype=torch.bfloat16)
a = r16.forward([(ids, r16.new_cache())], all_logits=True)
del r16
r32 = ReferenceModel(load_checkpoint(path, device="cuda"), dtype=torch.float32)
b = r32.forward([(ids, r32.new_cache())], all_logits=True)
print("bf16 ref vs fp32 ref mean row rel err", rel(a, b), flush=True)
del r32
from transformers import GptOssForCausalLM, Mxfp4Config
# Dequantised explicitly: with the `kernels` package (a dependency from transformers 5.25) it would
# otherwise fetch MXFP4 kernels from the Hub, which the GPU machine cannot reach.
hf = GptOssForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                       quantization_config=Mxfp4Config(dequantize=True)).eval()
with torch.no_grad():
    c = hf(torch.tensor([ids], device="cuda")).logits[0]
print("bf16 ref vs transformers bf16", rel(a, c), " transformers bf16 vs fp32 ref", rel(c, b), flush=True)
