python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
t0=$SECONDS
python -m pytest -q tests/kernels/test_moe.py -k "decode_tiles or pick_config" 2>&1 | tail -3
echo "tests done $((SECONDS-t0)) s"
python benchmarks/bench_moe.py --tokens 8 16 48 64 --variants default s13-tiles 2>&1 | awk '$3!="route" && $3!="combine"' > $OUT/moe_new.txt; grep -v "^$" $OUT/moe_new.txt | cut -c1-80
echo "bench new done $((SECONDS-t0)) s"
python benchmarks/bench_moe.py --tokens 96 128 192 256 --variants default m32 m32-t32k128 k128-free 2>&1 | awk '$3!="route" && $3!="combine"' > $OUT/moe_m32.txt; grep -v "^$" $OUT/moe_m32.txt | cut -c1-80
echo "bench m32 done $((SECONDS-t0)) s"
python -m gptoss_cli bench random:20b --batch 8,16,64 --json $OUT/b20.json > $OUT/b20.txt 2>&1; tail -25 $OUT/b20.txt
echo "gptoss bench done $((SECONDS-t0)) s"
python scripts/gpu_check.py tput --out $OUT 2>&1 | tail -8
echo "tput done $((SECONDS-t0)) s"
