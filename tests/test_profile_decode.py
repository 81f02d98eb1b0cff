"""scripts/profile_decode.py's MoeConfig overrides (also used by ab_options.py): which steps they reach."""

from __future__ import annotations

from helpers import load_script

from gptoss_cli.kernels.moe_config import pick_config


def test_gemv_fields_reach_only_the_gemv_and_tile_fields_only_the_tiles():
    apply = load_script("scripts/profile_decode.py").moe_changes_apply
    gemv, tiles = pick_config(1, 32, 4), pick_config(64, 32, 4)
    assert gemv.gemv and not tiles.gemv
    assert apply(gemv, {"gemv_f16": False}) and not apply(tiles, {"gemv_f16": False})
    assert apply(gemv, {"gemv_topk": False, "block_k": 256}) and not apply(tiles, {"gemv_topk": False, "block_k": 256})
    assert apply(tiles, {"block_k": 128}) and not apply(gemv, {"block_k": 128})
    assert apply(gemv, {"combine_block": 256}) and apply(tiles, {"combine_block": 256})
    assert apply(tiles, {"combine_block": 256, "block_k": 128}) and not apply(gemv, {"combine_block": 256, "block_k": 128})


def test_critical_shares_count_each_kernel_past_the_latest_end_before_it():
    shares = load_script("scripts/profile_decode.py").critical_shares
    # a runs 0-10; b (PDL) starts at 2 and ends at 14: 4 past a; c ends inside b: 0;
    # d starts after a 6 us gap: its whole 3 us, not the gap.
    events = [(2.0, 14.0, "b"), (0.0, 10.0, "a"), (5.0, 12.0, "c"), (20.0, 23.0, "d"), (21.0, 25.0, "b")]
    assert shares(events) == {"a": 10.0, "b": 4.0 + 2.0, "c": 0.0, "d": 3.0}
