"""Triton kernels for gpt-oss on Hopper, each with a plain-torch twin that defines its meaning.

The runtime's GPU engine imports kernels only through this package. Under TRITON_INTERPRET=1
the same kernels run on the CPU (tests); bf16 is loaded and computed in fp32 there.
"""

from .attention import prefill_attention
from .decode_attention import choose_num_splits, decode_attention
from .decode_step import advance_decode, decode_slots
from .kv_store import kv_store
from .linear import row_linear, supports_row_linear
from .moe import MoeWorkspace, moe_block, moe_forward
from .moe_config import MoeConfig
from .moe_matmul import MoeWeights, prepare_moe_weights
from .qkv_rope import qkv_rope_store, qkv_rope_store_tokens, supports_qkv_rope_tokens
from .rmsnorm import rms_norm
from .rope import apply_rope, apply_rope_qkv, rope_cos_sin
from .sampling import SamplingRows, sample
from .skinny_linear import SkinnyScratch, skinny_linear, supports_skinny_linear

__all__ = [
    "MoeConfig", "MoeWeights", "MoeWorkspace", "advance_decode", "apply_rope", "apply_rope_qkv", "choose_num_splits",
    "decode_attention", "decode_slots", "kv_store", "moe_block", "moe_forward", "prefill_attention", "prepare_moe_weights",
    "qkv_rope_store", "qkv_rope_store_tokens", "rms_norm", "rope_cos_sin", "row_linear", "sample", "SamplingRows",
    "SkinnyScratch", "skinny_linear", "supports_qkv_rope_tokens", "supports_row_linear", "supports_skinny_linear",
]
