"""scripts/profile_decode.py's MoeConfig overrides (also used by ab_options.py): which steps they reach."""

from __future__ import annotations

import dataclasses

from helpers import load_script

from gptoss_cli.kernels.moe_matmul import pick_config


def test_gemv_fields_reach_only_the_gemv_and_tile_fields_only_the_tiles():
    apply = load_script("scripts/profile_decode.py").moe_changes_apply
    gemv, tiles = pick_config(1, 32, 4), pick_config(64, 32, 4)
    assert gemv.gemv and not tiles.gemv
    assert apply(gemv, {"gemv_tma": True}) and not apply(tiles, {"gemv_tma": True})
    assert apply(tiles, {"block_k": 128}) and not apply(gemv, {"block_k": 128})
    # Every step the override reaches must build a valid config (gemv_tma needs gemv=True).
    for changes in ({"gemv_tma": True}, {"gemv_pairs": True, "block_k": 128}):
        for cfg in (gemv, tiles):
            if apply(cfg, changes):
                dataclasses.replace(cfg, **changes)
