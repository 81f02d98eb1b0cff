"""Checkpoint tensors rearranged once, at load, into what the GPU forward pass reads.

q/k/v are fused into one [H*D + 2*Hkv*D, C] matrix (one GEMM instead of three); experts stay
MXFP4 (kernels.prepare_moe_weights may re-lay the packed bytes, never dequantise); sinks and
norm gains become fp32 because the kernels compute in fp32 anyway. Source tensors are dropped
as they are converted, so peak memory stays near the checkpoint size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import prepare_moe_weights
from ..checkpoint import ModelWeights
from ..config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    o_w: torch.Tensor
    o_b: torch.Tensor
    sinks: torch.Tensor
    mlp_norm: torch.Tensor
    router_w: torch.Tensor
    router_b: torch.Tensor
    experts: object  # kernels.MoeWeights
    window: int  # 0 for full-attention layers


@dataclass
class GpuWeights:
    config: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held, packed experts included."""
        return _tensor_bytes(self, set())


def _tensor_bytes(obj, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def prepare_weights(weights: ModelWeights, dtype: torch.dtype, moe_row_group: int,
                    moe_frag_scales: bool, moe_split_copy: bool = False) -> GpuWeights:
    """Consume `weights.tensors` (entries are popped) into the GPU layout on their device;
    `moe_row_group`: the expert bytes' row grouping (kernels.MoeWeights.row_group);
    `moe_frag_scales`: also the experts' fragment-order scales (kernels.MoeWeights.w1_scales_frag,
    w2_scales_frag); `moe_split_copy`: also their blocks in the split-word order
    (kernels.MoeWeights.w1_split, w2_split)."""
    cfg, t = weights.config, weights.tensors
    cast = lambda x: x.to(dtype).contiguous()  # noqa: E731
    layers = [_layer(cfg, t, n, cast, moe_row_group, moe_frag_scales, moe_split_copy)
              for n in range(cfg.num_hidden_layers)]
    return GpuWeights(
        config=cfg,
        embed=cast(t.pop("model.embed_tokens.weight")),
        layers=layers,
        final_norm=t.pop("model.norm.weight").float(),
        lm_head=cast(t.pop("lm_head.weight")),
    )


def _layer(cfg: ModelConfig, t: dict[str, torch.Tensor], n: int, cast, moe_row_group: int,
           moe_frag_scales: bool, moe_split_copy: bool) -> LayerWeights:
    p = f"model.layers.{n}."
    pop = lambda name: t.pop(p + name)  # noqa: E731
    qkv_w = cast(torch.cat([pop(f"self_attn.{x}_proj.weight") for x in "qkv"]))
    qkv_b = cast(torch.cat([pop(f"self_attn.{x}_proj.bias") for x in "qkv"]))
    experts = prepare_moe_weights(
        pop("mlp.experts.gate_up_proj_blocks"), pop("mlp.experts.gate_up_proj_scales"),
        pop("mlp.experts.gate_up_proj_bias"), pop("mlp.experts.down_proj_blocks"),
        pop("mlp.experts.down_proj_scales"), pop("mlp.experts.down_proj_bias"), row_group=moe_row_group,
        frag_scales=moe_frag_scales, split_copy=moe_split_copy)
    return LayerWeights(
        attn_norm=pop("input_layernorm.weight").float(),
        qkv_w=qkv_w, qkv_b=qkv_b,
        o_w=cast(pop("self_attn.o_proj.weight")), o_b=cast(pop("self_attn.o_proj.bias")),
        sinks=pop("self_attn.sinks").float(),
        mlp_norm=pop("post_attention_layernorm.weight").float(),
        router_w=cast(pop("mlp.router.weight")), router_b=cast(pop("mlp.router.bias")),
        experts=experts,
        window=cfg.sliding_window if cfg.is_sliding(n) else 0,
    )
