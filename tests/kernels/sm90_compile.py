"""Compile kernels for Hopper (sm_90) without a GPU, the way the launcher specialises them.

Run as a script (`python tests/kernels/sm90_compile.py [CASE ...]`) in a process without
TRITON_INTERPRET: under the interpreter @triton.jit functions are not compilable objects. Prints
one line per case, "OK <case>" or "FAIL <case>: <error>"; test_sm90_compile.py drives it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback

FLOAT_ARGS = {"limit", "alpha", "qk_scale", "eps"}
DIV16_ARGS = {"hidden", "inter", "n", "k", "k_per_split", "k_chunk"}


def compile_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                 maxnreg: int = 0):
    """Compile `fn` for sm_90: `pointers` names the pointer arguments' types, `constexprs` holds the
    constexpr parameters and any int argument the launcher would specialise (value 1); `maxnreg`
    caps the registers per thread as MoeConfig.maxnreg does (0: no cap)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # Constexpr parameters left out take their defaults, as the launcher binds them; so do optional
    # pointers (default None) not named in `pointers`: the launcher specialises a None as a constant.
    constexprs = ({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
                  | {p.name: None for p in fn.params if not p.is_constexpr and p.has_default and p.default is None
                     and p.name not in pointers} | constexprs)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in FLOAT_ARGS else "i32")
    # Pointers of fresh tensors arrive 16-byte aligned, and the launcher marks ints divisible by 16
    # as such: at gpt-oss shapes that is every stride and size named here.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature[n].startswith("*") or n.startswith("stride_") or n in DIV16_ARGS}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    if not kernel.asm.get("cubin"):
        raise RuntimeError("no cubin")
    return kernel


def _cuobjdump(kernel, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(kernel) -> str:
    """The SASS listing of a compiled kernel's cubin (cuobjdump, bundled with Triton)."""
    return _cuobjdump(kernel, "-sass")


def spilled_bytes(kernel) -> int:
    """Stack bytes of a compiled kernel (> 0: ptxas spilled registers), from cuobjdump's resource
    usage of its cubin (Triton bundles cuobjdump)."""
    usage = _cuobjdump(kernel, "--dump-resource-usage")
    return sum(int(n) for n in re.findall(r"STACK:(\d+)", usage))


def _no_spills(kernel, what: str) -> None:
    """A register cap (MoeConfig.maxnreg) must not make ptxas spill: that would cost more than the
    occupancy it buys."""
    spilled = spilled_bytes(kernel)
    if spilled:
        raise RuntimeError(f"{what} spills {spilled} stack bytes under its register cap")


def _combine(splits: int):
    from gptoss_cli.kernels import moe_matmul as mm

    compile_sm90(mm._combine_kernel, {"y_ptr": "*fp32", "out_ptr": "*bf16"},
                 {"num_tokens": 1, "TOP_K": 4, "SPLITS": splits, "BLOCK_T": 1, "BLOCK_C": mm.COMBINE_BLOCK})


def _combine_norm():
    from gptoss_cli.kernels import moe_matmul as mm

    compile_sm90(mm._combine_norm_kernel, {"y_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                           "h_ptr": "*bf16"},
                 {"num_tokens": 1, "TOP_K": 4, "SPLITS": 1, "BLOCK_C": 4096, "PDL": True}, num_warps=8)


def _combine_norm_blocks():
    from gptoss_cli.kernels import moe_matmul as mm

    compile_sm90(mm._combine_norm_blocks_kernel, {"y_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16",
                                                  "out_ptr": "*bf16", "h_ptr": "*bf16", "arrivals_ptr": "*i32"},
                 {"num_tokens": 1, "TOP_K": 4, "SPLITS": 2, "BLOCK": 256, "BLOCK_C": 4096, "PDL": True}, num_warps=4)


def _decode_tiles(num_tokens: int, fmt: str = "asm-folded"):
    """pick_config's decode tiles at `num_tokens` (asm dequantisation, even/odd K; 16 or 32 rows):
    gemm1 and gemm2 under the config's warps, each with its own K step and register cap. Each K
    step's scales must reach shared memory through cp.async like the weights (no byte-wide global
    load: one waited on inside every step was the 4-warp tiles' top stall), and neither may spill."""
    import triton.language as tl

    from gptoss_cli.kernels import moe_matmul as mm
    from gptoss_cli.kernels.moe_config import regime_config

    # The tiles as pick_config chooses them where the grouped kernels do not run (group_mma).
    config = regime_config("decode", num_tokens, 32, 4, group=False)
    ptrs = {n: "*i32" for n in ("sorted_slots_ptr", "tile_expert_ptr", "tile_start_ptr", "offsets_ptr")}
    ptrs |= {"w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*fp32"}
    common = {"BLOCK_M": config.block_m, "GROUP_M": config.group_m,
              "DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32", "A_FORMAT": fmt, "FAST_MATH": False,
              "OPERANDS": config.operands, "SCALES": "bytes", "ROW_GROUP": mm.ROW_GROUP}
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    g1 = compile_sm90(mm._gemm1_swiglu_kernel, ptrs | {"x_ptr": "*bf16", "act_ptr": "*bf16"},
                      common | {"TOP_K": 4, "SUB_M": 1, "BLOCK_N": config.block_n1, "BLOCK_K": config.block_k,
                                "EVEN_K": 2880 % config.block_k == 0},
                      maxnreg=config.maxnreg, **launch)
    g2 = compile_sm90(mm._gemm2_kernel, ptrs | {"act_ptr": "*bf16", "y_ptr": "*fp32", "gamma_ptr": "*fp32"},
                      common | {"SPLIT_K": config.split_k, "BLOCK_N": config.block_n2, "BLOCK_K": config.gemm2_block_k,
                                "EVEN_K": 2880 % config.gemm2_block_k == 0},
                      maxnreg=config.gemm2_maxnreg, **launch)
    for name, kernel in (("gemm1", g1), ("gemm2", g2)):
        _no_spills(kernel, name)
        if "LDG.E.U8" in sass(kernel) or "LDG.E.U16" in sass(kernel):
            raise RuntimeError(f"{name}: the scales are a byte-wide global load, outside the cp.async ring")
    return g1, g2


def _split_words_tiles(num_tokens: int):
    """The decode tiles on split-word bytes (mxfp4_split.py) against checkpoint order: the point of the
    layout is fewer integer instructions per K step, so each K loop must lose at least a quarter of
    its LOP3 + PRMT (offline at 64 tokens: 176 -> 96) and neither may spill (_decode_tiles)."""
    def alu(kernel) -> int:
        body = _loop_body(sass(kernel))
        return len(re.findall(r"\b(?:LOP3|PRMT)\b", body))

    split = _decode_tiles(num_tokens, "asm-split-folded")
    for name, old, new in zip(("gemm1", "gemm2"), _decode_tiles(num_tokens), split):
        if alu(new) > 0.75 * alu(old):
            raise RuntimeError(f"{name}: {alu(new)} LOP3 + PRMT per K step on split words, {alu(old)} on bytes")


def _loop_bodies(text: str, count: int = 1) -> list[str]:
    """The SASS of a kernel's `count` longest backward branches (its main K loops), longest first."""
    rows = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    loops = [(int(t.group(1), 16), a) for a, ins in rows if (t := re.search(r"BRA\s+0x([0-9a-f]+)", ins))]
    spans = sorted(((s, e) for s, e in loops if s < e), key=lambda se: se[0] - se[1])[:count]
    return ["\n".join(ins for a, ins in rows if start <= a <= end) for start, end in spans]


def _loop_body(text: str) -> str:
    """The SASS of a kernel's longest backward branch (its main K loop)."""
    return _loop_bodies(text)[0]


def _prefill(block_m: int, num_stages: int = 3, fmt: str = "asm-folded", scales: tuple[str, str] = ("bytes", "bytes"),
             short: int = 0, pairs: bool = False):
    """Prefill tiles (weights as wgmma's register operand) at a given tile height; gemm1 takes tiles
    taller than 128 rows in 128-row slices. `scales`: gemm1's and gemm2's SCALES (_scale_mode). Words
    must reach shared memory through cp.async like the weights (no byte-wide global load); with
    "join" or "frag" gemm1's dequantised tile must reach the wgmmas without a shared-memory round
    trip (no 4-matrix ldmatrix in its K loop) and the wgmmas must overlap (no wait for all of them
    inside it); with "frag" the scale tile needs no conversion either (at most 3 barriers per step).
    With every scale mode the wgmmas of a K step must overlap (no wait for all of them in the loop).
    `short`: MoeConfig.short_tiles, so each kernel holds a half-height copy of its K loop too (and a
    quarter-height one with 2); `pairs`: MoeConfig.pair_tiles, gemm2's two loops of two dots each.
    The checks then hold for every loop, and neither kernel may spill."""
    import triton.language as tl

    from gptoss_cli.kernels import moe_matmul as mm

    ptrs = {n: "*i32" for n in ("sorted_slots_ptr", "tile_expert_ptr", "tile_start_ptr", "offsets_ptr")}
    ptrs |= {"w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*fp32"}
    common = {"BLOCK_M": block_m, "BLOCK_K": 64, "GROUP_M": 8, "DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32",
              "A_FORMAT": fmt, "FAST_MATH": False, "OPERANDS": "swapped", "ROW_GROUP": mm.ROW_GROUP, "EVEN_K": True}
    g1 = compile_sm90(mm._gemm1_swiglu_kernel, ptrs | {"x_ptr": "*bf16", "act_ptr": "*bf16"},
                      common | {"TOP_K": 4, "BLOCK_N": 64, "BLOCK_M": min(block_m, 128),
                                "SUB_M": max(1, block_m // 128), "SCALES": scales[0],
                                **_tile_heights(min(block_m, 128), short)},
                      num_warps=8, num_stages=num_stages)
    # y in bf16: the prefill tiles round their slot outputs (MoeConfig.round_slots)
    g2 = compile_sm90(mm._gemm2_kernel, ptrs | {"act_ptr": "*bf16", "y_ptr": "*bf16", "gamma_ptr": "*fp32"},
                      common | {"BLOCK_N": 128, "SPLIT_K": 1, "SCALES": scales[1],
                                **_tile_heights(block_m, short, pairs)},
                      num_warps=8, num_stages=num_stages)
    for name, kernel, mode in (("gemm1", g1, scales[0]), ("gemm2", g2, scales[1])):
        byte_loads = "LDG.E.U8" in sass(kernel)  # the scales were the kernels' only byte-wide load
        if num_stages > 1 and byte_loads != (mode == "bytes"):
            raise RuntimeError(f"{name}: scales {mode!r} but byte-wide global loads: {byte_loads}")
        bodies = 1 + short + (2 if pairs and name == "gemm2" else 0)  # one K loop per tile height
        loops = [loop for loop in _loop_bodies(sass(kernel), bodies + 2) if "HGMMA" in loop]
        if len(loops) != bodies:
            raise RuntimeError(f"{name}: {len(loops)} wgmma K loops, expected {bodies} (short={short}, pairs={pairs})")
        for loop in loops:
            if num_stages > 1 and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in loop:  # _mx_matmul's note on tl.assume
                raise RuntimeError(f"{name}: scales {mode!r}, but the K loop waits for each wgmma (serialised)")
            if mode in ("join", "frag") and "LDSM.16.M88.4" in loop:
                raise RuntimeError(f"{name}: {mode} scale words, but the K loop has ldmatrix")
            if mode == "frag" and loop.count("BAR.SYNC") > 3:  # "join" has 7: its scale tile is converted
                raise RuntimeError(f"{name}: fragment-order scale words, but {loop.count('BAR.SYNC')} barriers per K step")
        if short:
            _no_spills(kernel, f"{name} with short tiles")


def _tile_heights(rows: int, short: int, pairs: bool = False) -> dict:
    """The SHORT_M / TINY_M (gemm2 with `pairs`: and PAIR_M) a launch passes for
    MoeConfig.short_tiles = `short` and pair_tiles = `pairs`."""
    from gptoss_cli.kernels.moe_config import MoeConfig
    from gptoss_cli.kernels.moe_matmul import _tile_heights

    config = MoeConfig("prefill", 16, 16, 16, 32, swap_ab=True, short_tiles=short, pair_tiles=pairs)
    return _tile_heights(config, rows, pairs)


def _gemv(which: str, block_n: int = 16, block_k: int = 256, f16: bool = False, num_warps: int = 4,
          experts: int = 0, mma: bool = False, ahead: int = 1, pairs: bool = False):
    """experts > 0: the gemv taking the top-k from that many router logits (MoeConfig.gemv_topk,
    gemv2_topk). pairs: the activations also in fp16_pairs form (xp_ptr / ap_ptr), which the K loop
    must then read without converting (no F2FP). The
    weights must arrive in 16-byte loads on the grouped layout (MoeWeights.row_group); with `mma`
    (MoeConfig.gemv_mma) they are 4-byte words of mma fragments, the K loop must hold the
    tensor-core instructions, and ptxas must not spill the software-pipelined registers."""
    from gptoss_cli.kernels import moe_gemv as mg
    from gptoss_cli.kernels.moe_gemv_mma import mma_splits
    from gptoss_cli.kernels.moe_matmul import ROW_GROUP

    pointers = {"w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*fp32", "sorted_slots_ptr": "*i32",
                "topk_ids_ptr": "*i32"}
    rows = 2 * block_n if which == "gemv1" else block_n
    common = {"BLOCK_N": block_n, "BLOCK_K": block_k, "ASM": True, "F16": f16 or mma, "PDL": True,
              "ROW_GROUP": ROW_GROUP, "MMA": mma, "MMA_SPLITS": mma_splits(rows, block_k, num_warps) if mma else 1,
              "MMA_AHEAD": ahead}
    if pairs:  # gemv1 also writes act's pairs for gemv2
        pointers |= {"xp_ptr": "*fp16", "ap_out_ptr": "*fp16"} if which == "gemv1" else {"ap_ptr": "*fp16"}
    if which == "gemv1":
        pointers |= {"x_ptr": "*bf16", "act_ptr": "*bf16", "logits_ptr": "*fp32", "topk_weights_ptr": "*fp32"}
        logits = {"LOGITS": experts > 0, "BLOCK_TK": 4 if experts else 1, "BLOCK_E": experts or 1, "KEYS": experts > 0}
        kernel = compile_sm90(mg._gemv1_swiglu_kernel, pointers, {"TOP_K": 4, **common, **logits}, num_warps)
    else:
        pointers |= {"act_ptr": "*bf16", "y_ptr": "*fp32", "gamma_ptr": "*fp32", "logits_ptr": "*fp32"}
        logits = {"LOGITS": True, "TOP_K": 4, "BLOCK_TK": 4, "BLOCK_E": experts, "KEYS": True} if experts else {}
        kernel = compile_sm90(mg._gemv2_kernel, pointers, common | logits, num_warps)
        if experts and mma:
            _loads_before_wait(kernel)
    if mma:
        if "HMMA.16816.F32" not in _loop_body(sass(kernel)):
            raise RuntimeError(f"{which}: no mma in the K loop")
        _no_spills(kernel, which)
        _lanes_last(kernel, which)
        if pairs == ("F2FP" in _loop_body(sass(kernel))):
            raise RuntimeError(f"{which}: the K loop {'converts' if pairs else 'does not convert'} the activations")
        _x_loaded_ahead(_loop_body(sass(kernel)), which)
    elif "LDG.E.128" not in sass(kernel):
        raise RuntimeError(f"{which}: the weights are not loaded in 16-byte vectors")
    return kernel


def _x_loaded_ahead(body: str, which: str) -> None:
    """The tensor-core K loop's activation loads (128-bit) are for the next step: the loop's first mma
    comes before them, so each step's B registers arrived during the step before (moe_gemv_mma._k_loop;
    read at the top of the step that uses them, they held up its first mma)."""
    first_mma, first_x = body.find("HMMA"), body.find("LDG.E.128")
    if first_x < 0 or first_mma > first_x:
        raise RuntimeError(f"{which}: the K loop loads its activations before its first mma, for its own step")


def _loads_before_wait(kernel) -> None:
    """gemv2 with the top-k from the router logits (MoeConfig.gemv2_topk): weight loads (32-bit LDG,
    plain: ptxas hoists the wait above read-only ones) must be issued before the PDL wait
    (ACQBULK), and no activation load (128-bit) before it."""
    listing = sass(kernel)
    wait = listing.find("ACQBULK")
    if wait < 0:
        raise RuntimeError("gemv2: no PDL wait")
    before = listing[:wait]
    if not re.search(r"LDG\.E R", before) or re.search(r"LDG\.E\.128 ", before):
        raise RuntimeError("gemv2: the weight loads do not all precede the PDL wait, or an activation load does")


def _group(which: str, block_n: int, block_k: int, num_warps: int = 4, ahead: int = 2):
    """The grouped decode kernels (moe_group_mma.py, MoeConfig.group_mma): both group bodies must hold
    mmas in their K loops (the fp32 fallback's loops have none), and ptxas must not spill."""
    from gptoss_cli.kernels import moe_group_mma as mg
    from gptoss_cli.kernels.moe_gemv_mma import mma_splits
    from gptoss_cli.kernels.moe_matmul import ROW_GROUP

    pointers = {"w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*fp32", "sorted_slots_ptr": "*i32",
                "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "offsets_ptr": "*i32"}
    rows = 2 * block_n if which == "gemm1" else block_n
    common = {"BLOCK_N": block_n, "BLOCK_K": block_k, "ROW_GROUP": ROW_GROUP,
              "KS": mma_splits(rows, block_k, num_warps), "AHEAD": ahead}
    if which == "gemm1":
        pointers |= {"x_ptr": "*bf16", "act_ptr": "*bf16"}
        kernel = compile_sm90(mg._group_gemm1_swiglu_kernel, pointers, {"TOP_K": 4, **common}, num_warps)
    else:
        pointers |= {"act_ptr": "*bf16", "y_ptr": "*fp32", "gamma_ptr": "*fp32"}
        kernel = compile_sm90(mg._group_gemm2_kernel, pointers, common, num_warps)
    if sum("HMMA.16816.F32" in b for b in _loop_bodies(sass(kernel), 6)) < 2:
        raise RuntimeError(f"{which}: the two group bodies' K loops do not both hold mmas")
    _no_spills(kernel, which)
    _lanes_last(kernel, which)
    return kernel


def _lanes_last(kernel, what: str) -> None:
    """Every operand of the tensor-core asm steps ([KS, P, 32]) must keep the 32 lanes of a warp on
    its last dimension: a tl.load of that shape anchored another layout once (session 24), and
    the asm then ran on the wrong lanes."""
    ir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.MULTILINE))
    for line in ir.split("\n"):
        if "elementwise_inline_asm" not in line:
            continue
        for name in set(re.findall(r"tensor<\d+x\d+x32x\w+, (#\w+)>", line)):
            if "threadsPerWarp = [1, 1, 32]" not in layouts[name]:
                raise RuntimeError(f"{what}: an asm step's operands have layout {layouts[name]}")


def _decode_step():
    from gptoss_cli.kernels import decode_step as ds
    from gptoss_cli.kernels import penalty, rmsnorm

    i64 = {n: "*i64" for n in ("pos_ptr", "rows_ptr", "active_ptr", "full_slots_ptr", "slide_slots_ptr")}
    compile_sm90(ds._decode_slots_kernel, i64 | {n: "*i32" for n in ("full_ptr", "slide_ptr", "ft_ptr", "st_ptr",
                                                                       "seq_lens_ptr")},
                 {"BLOCK_SIZE": 64, "BLOCK": ds.TABLE_BLOCK})
    advance = {n: "*i64" for n in ("sampled_ptr", "out_ptr", "tokens_ptr", "pos_ptr", "offsets_ptr", "active_ptr",
                                   "rows_ptr")} | {"seen_ptr": "*i32", "pen_ptr": "*fp32"}
    compile_sm90(ds._advance_kernel, advance, {"BLOCK": 64, "SEEN": True}, num_warps=1)
    compile_sm90(penalty._apply_kernel, {"logits_ptr": "*bf16", "seen_ptr": "*i32", "rows_ptr": "*i64",
                                         "pen_ptr": "*fp32"}, {"BLOCK_V": penalty.BLOCK})
    compile_sm90(penalty._mark_kernel, {"seen_ptr": "*i32", "rows_ptr": "*i64", "ids_ptr": "*i64", "pen_ptr": "*fp32"},
                 {"BLOCK_B": 64}, num_warps=1)
    compile_sm90(rmsnorm._rms_norm_kernel, {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                            "h_ptr": "*bf16", "ids_ptr": "*i64"},
                 {"HAS_RES": False, "STORE_H": True, "ROWS": 1, "BLOCK_C": 4096, "ROW_IDS": True}, num_warps=8)


def _decode_min_chunk():
    import importlib

    import triton.language as tl

    # The package exports the function decode_attention, which hides the module of that name.
    da = importlib.import_module("gptoss_cli.kernels.decode_attention")

    pointers = {n: "*bf16" for n in ("q_ptr", "kc_ptr", "vc_ptr", "sinks_ptr", "out_ptr")}
    pointers |= {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    tiles = da.decode_tiles(num_splits=32)
    compile_sm90(da._decode_split_kernel, pointers, {
        "GROUP": 8, "BLOCK_G": 16, "HEAD_DIM": 64, "BLOCK_SIZE": 64, "BLOCK_N": tiles.block_n, "NUM_SPLITS": 32,
        "MIN_CHUNK": tiles.min_chunk, "DOT_DTYPE": tl.bfloat16, "PDL": True}, tiles.num_warps, tiles.num_stages)
    compile_sm90(da._decode_reduce_kernel, {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "sinks_ptr": "*bf16",
                                            "out_ptr": "*bf16"},
                 {"HEAD_DIM": 64, "NUM_SPLITS": 33, "BLOCK_S": 64, "PDL": True})


def _rope_store():
    from gptoss_cli.kernels import rope

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr")}
    pointers |= {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}
    compile_sm90(rope._rope_kernel, pointers, {
        "HALF": 32, "BLOCK_HALF": 32, "BLOCK_H": 64, "BLOCK_HKV": 8, "STORE_KV": True, "BLOCK_SIZE": 64,
        "PDL": True})


def _row_linear(block_n: int, num_warps: int):
    from gptoss_cli.kernels import linear

    compile_sm90(linear._row_linear_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"},
                 {"BLOCK_N": block_n, "BLOCK_K": 4096, "PDL": True}, num_warps=num_warps)


def _qkv_rope():
    from gptoss_cli.kernels import qkv_rope

    pointers = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "kc_ptr", "vc_ptr")}
    pointers |= {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}
    kernel = compile_sm90(qkv_rope._qkv_rope_kernel, pointers, {
        "H": 64, "HKV": 8, "HEAD_DIM": 64, "PAIRS": 1, "BLOCK_K": 4096, "BLOCK_SIZE": 64, "PDL": True})
    _no_spills(kernel, "the fused qkv + rope")


def _skinny(which: str, num_tokens: int):
    """The few-token projections at the default tiles: the K loop must stream W through cp.async
    (LDGSTS, Triton's pipeliner) into tensor-core products (HMMA, or HGMMA at 64-row tiles), with
    nothing spilled."""
    import importlib

    import triton.language as tl

    from gptoss_cli.kernels import qkv_rope

    sl = importlib.import_module("gptoss_cli.kernels.skinny_linear")  # the package exports a function of that name

    tiles, block_t = sl.SkinnyTiles(), sl.token_block(num_tokens)
    pointers = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "kc_ptr", "vc_ptr")}
    pointers |= {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64", "part_ptr": "*fp32",
                 "count_ptr": "*i32"}
    common = {"BLOCK_T": block_t, "BLOCK_K": tiles.block_k, "SPLITS": 3, "DOT": tl.bfloat16, "PDL": True}
    if which == "linear":
        kernel = compile_sm90(sl._skinny_linear_kernel, pointers, common | {"BLOCK_N": tiles.block_n},
                              tiles.num_warps, tiles.num_stages)
    else:
        kernel = compile_sm90(qkv_rope._qkv_rope_tokens_kernel, pointers, common | {
            "H": 64, "HKV": 8, "HEAD_DIM": 64, "PAIRS": min(tiles.block_n // 2, 32), "BLOCK_SIZE": 64},
            tiles.num_warps, tiles.num_stages)
    _no_spills(kernel, f"skinny {which}")
    loop = _loop_body(sass(kernel))
    if "LDGSTS" not in loop or not ("HMMA" in loop or "HGMMA" in loop):
        raise RuntimeError(f"skinny {which}: the K loop lacks cp.async (LDGSTS) or tensor-core products")


def _router_topk(tokens: int, experts: int, norm: bool = False, topk: bool = True, pairs: bool = False):
    """pairs: the normalised rows in fp16_pairs form too (RouterNorm.pairs)."""
    from gptoss_cli.kernels import moe_router as mr

    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "logits_ptr": "*fp32", "arrivals_ptr": "*i32",
                "weights_ptr": "*fp32", "ids_ptr": "*i32", "hist_ptr": "*i32", "res_ptr": "*bf16", "nw_ptr": "*bf16",
                "y_ptr": "*bf16", "h_ptr": "*bf16"} | ({"yp_ptr": "*fp16"} if pairs else {})
    block_t, block_ta, block_c = mr.launch_blocks(tokens, experts, 2880)
    constexprs = {"TOP_K": 4, "BLOCK_K": 4, "BLOCK_T": block_t, "BLOCK_E": experts, "GROUP_E": mr.GROUP_E,
                  "BLOCK_C": block_c, "NORM": norm, "ONE_STEP": block_c >= 2880, "PDL": True, "TOPK": topk,
                  "BLOCK_TA": block_ta}
    if tokens == 1:
        constexprs["num_tokens"] = 1  # the launcher specialises an int argument equal to 1
    kernel = compile_sm90(mr._router_split_kernel, pointers, constexprs, num_warps=8)
    if norm and "STG.E.U16" in sass(kernel):
        # Each program's slice is whole groups of 8 columns: its stores are 16-byte vectors (2-byte
        # scatters, with a division per column for the ownership test, made the kernel twice as long).
        raise RuntimeError("router norm: the slice stores are 2-byte scatters, not 16-byte vectors")


def _router_tiles(tokens: int, experts: int):
    """The router's K-split tiles: W streamed through cp.async into tensor-core products, no spills."""
    import triton.language as tl

    from gptoss_cli.kernels import moe_router_tiles as rt
    from gptoss_cli.kernels.moe_routing import token_block

    tiles = rt.RouterTiles()
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
                "weights_ptr": "*fp32", "ids_ptr": "*i32", "hist_ptr": "*i32"}
    constexprs = {"TOP_K": 4, "BLOCK_TOPK": 4, "BLOCK_T": token_block(tokens, experts), "BLOCK_E": experts,
                  "BLOCK_K": tiles.block_k, "SPLITS": 6, "DOT": tl.bfloat16, "PDL": True}
    kernel = compile_sm90(rt._router_tiles_kernel, pointers, constexprs, tiles.num_warps, tiles.num_stages)
    _no_spills(kernel, "router tiles")
    loop = _loop_body(sass(kernel))
    if "LDGSTS" not in loop or not ("HMMA" in loop or "HGMMA" in loop):
        raise RuntimeError("router tiles: the K loop lacks cp.async (LDGSTS) or tensor-core products")


CASES = {
    "combine-1-token": lambda: _combine(1),
    "combine-1-token-2-splits": lambda: _combine(2),
    "decode-tiles-2-tokens": lambda: _decode_tiles(2),
    "decode-tiles-48-tokens": lambda: _decode_tiles(48),
    "decode-tiles-256-tokens": lambda: _decode_tiles(256),
    "decode-tiles-64-tokens": lambda: _decode_tiles(64),
    "decode-tiles-64-tokens-unfolded": lambda: _decode_tiles(64, fmt="asm"),
    "decode-tiles-64-tokens-split-words": lambda: _split_words_tiles(64),
    "decode-tiles-32-tokens-split-words-unfolded": lambda: _decode_tiles(32, fmt="asm-split"),
    "prefill-swapped-128-unfolded": lambda: _prefill(128, fmt="asm"),
    "prefill-swapped-32": lambda: _prefill(32),
    "prefill-swapped-64": lambda: _prefill(64),
    "prefill-swapped-128": lambda: _prefill(128),
    "prefill-swapped-256": lambda: _prefill(256),
    "prefill-swapped-128-1-stage": lambda: _prefill(128, num_stages=1),
    "prefill-swapped-256-scale-words": lambda: _prefill(256, scales=("join", "gather")),
    "prefill-swapped-128-scale-words": lambda: _prefill(128, scales=("join", "gather")),
    "prefill-swapped-64-scale-words": lambda: _prefill(64, scales=("shift", "shift")),
    "prefill-swapped-256-scale-frag": lambda: _prefill(256, scales=("frag", "frag")),
    "prefill-swapped-64-scale-frag": lambda: _prefill(64, scales=("frag", "frag")),
    "prefill-swapped-256-scale-frag-short": lambda: _prefill(256, scales=("frag", "frag"), short=2),
    "prefill-swapped-256-scale-frag-pairs": lambda: _prefill(256, scales=("frag", "frag"), short=2, pairs=True),
    "decode-attention-min-chunk": _decode_min_chunk,
    "decode-step-bookkeeping": _decode_step,
    "gemv1-asm": lambda: _gemv("gemv1"),
    "gemv2-asm": lambda: _gemv("gemv2"),
    "router-topk-1-token": lambda: _router_topk(1, 32),
    "router-topk-4-tokens-128-experts": lambda: _router_topk(4, 128),
    "router-topk-norm-1-token": lambda: _router_topk(1, 32, norm=True),
    "router-topk-norm-4-tokens": lambda: _router_topk(4, 32, norm=True),
    "router-logits-norm-1-token": lambda: _router_topk(1, 32, norm=True, topk=False),
    "router-logits-norm-pairs-1-token": lambda: _router_topk(1, 32, norm=True, topk=False, pairs=True),
    "router-topk-norm-64-tokens": lambda: _router_topk(64, 32, norm=True),  # batch 64: a program per token
    "router-topk-norm-64-tokens-128-experts": lambda: _router_topk(64, 128, norm=True),
    "router-tiles-64-tokens": lambda: _router_tiles(64, 32),
    "router-tiles-64-tokens-128-experts": lambda: _router_tiles(64, 128),
    "combine-norm-1-token": _combine_norm,
    "combine-norm-blocks": _combine_norm_blocks,
    "rope-store-kv": _rope_store,
    "row-linear-2x4": lambda: _row_linear(2, 4),
    "qkv-rope-store": _qkv_rope,
    "row-linear-4x8": lambda: _row_linear(4, 8),
    "skinny-linear-4-tokens": lambda: _skinny("linear", 4),
    "skinny-linear-64-tokens": lambda: _skinny("linear", 64),
    "skinny-qkv-rope-16-tokens": lambda: _skinny("qkv", 16),
    "gemv1-f16": lambda: _gemv("gemv1", 16, 512, f16=True),
    "gemv1-f16-topk-32-experts": lambda: _gemv("gemv1", 16, 512, f16=True, experts=32),
    "gemv1-f16-topk-128-experts": lambda: _gemv("gemv1", 16, 512, f16=True, experts=128),
    "gemv2-f16": lambda: _gemv("gemv2", 16, 512, f16=True),
    "gemv1-mma-topk-32-experts": lambda: _gemv("gemv1", 32, 256, experts=32, mma=True),
    "gemv1-mma-ahead-2": lambda: _gemv("gemv1", 32, 256, experts=32, mma=True, ahead=2),
    "gemv1-mma-1-pair": lambda: _gemv("gemv1", 16, 512, experts=32, mma=True),
    "gemv1-mma-topk-128-experts": lambda: _gemv("gemv1", 32, 256, experts=128, mma=True),
    "gemv1-mma-1-pair-ahead-2": lambda: _gemv("gemv1", 16, 256, experts=32, mma=True, ahead=2),  # pick_config's
    "gemv2-mma": lambda: _gemv("gemv2", 32, 256, mma=True),
    "gemv2-mma-2-pairs": lambda: _gemv("gemv2", 64, 256, mma=True),
    "gemv2-mma-k512-ahead-2": lambda: _gemv("gemv2", 32, 512, mma=True, ahead=2),
    "gemv2-mma-k256-ahead-2": lambda: _gemv("gemv2", 32, 256, mma=True, ahead=2),  # split K: 736 per split
    "gemv2-mma-k512-ahead-2-topk": lambda: _gemv("gemv2", 32, 512, experts=32, mma=True, ahead=2),
    "gemv1-mma-pairs": lambda: _gemv("gemv1", 16, 256, experts=32, mma=True, ahead=2, pairs=True),
    "gemv2-mma-pairs": lambda: _gemv("gemv2", 32, 512, experts=32, mma=True, ahead=2, pairs=True),
    "gemv2-mma-k512-ahead-1-topk-128": lambda: _gemv("gemv2", 32, 512, experts=128, mma=True),
    "group-gemm1": lambda: _group("gemm1", 32, 128),  # pick_config's at <= 2 rows per expert (32 experts)
    "group-gemm2": lambda: _group("gemm2", 64, 128),
    "group-gemm1-k256": lambda: _group("gemm1", 32, 256),
}


def main(names: list[str]) -> int:
    failed = 0
    for name in names or list(CASES):
        try:
            CASES[name]()
            print(f"OK {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every case
            failed += 1
            last = traceback.format_exception_only(exc)[-1].strip().replace("\n", " ")
            print(f"FAIL {name}: {last[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
