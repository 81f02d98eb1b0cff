python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
t0=$SECONDS
python benchmarks/bench_moe.py --tokens 2 4 12 24 48 --variants default k128-free 2>&1 | awk '$3!="route" && $3!="combine"' | tee $OUT/moe_small.txt
echo "small done $((SECONDS-t0)) s"
python benchmarks/bench_moe.py --tokens 96 128 192 256 512 --variants default m32 m32-t32k128 k128-free 2>&1 | awk '$3!="route" && $3!="combine"' | tee $OUT/moe_m32.txt
echo "m32 done $((SECONDS-t0)) s"
