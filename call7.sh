python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q tests/kernels/test_moe.py -k "prefill_tiles or exact_over or pick_config or decode_tiles or real_shapes" > $OUT/pytest.txt 2>&1; tail -2 $OUT/pytest.txt
timeout 100 python3 benchmarks/bench_moe.py --tokens 4096 --variants default swap-m256 stages4 swap-s2 > $OUT/bm.txt 2>&1; grep -v " \(route\|combine\) " $OUT/bm.txt | head -30
timeout 130 python3 scripts/ab_options.py --model 20b --prefill-moe block_m1=0 --rounds 1 --batch 1 > $OUT/ab20.txt 2>&1; tail -3 $OUT/ab20.txt
