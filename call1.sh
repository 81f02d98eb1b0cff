python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/scripts PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv | tee $OUT/smi.txt
t0=$SECONDS
python benchmarks/bench_moe.py --tokens 8 16 32 64 256 --variants default k128-free t32k128 2>&1 | grep -v "^\s*$" | tee $OUT/moe_decode.txt
echo "moe decode done $((SECONDS-t0)) s"
python benchmarks/bench_moe.py --tokens 4096 --variants default stages4 k128 swap-s2 2>&1 | tee $OUT/moe_prefill.txt
echo "moe prefill done $((SECONDS-t0)) s"
python benchmarks/bench_attention.py --sweep 2>&1 | tee $OUT/attn.txt
echo "attn done $((SECONDS-t0)) s"
for c in moe1 moe64 moe4096 attn32k; do
  timeout 150 ncu --clock-control none --profile-from-start off -k "regex:_gemv|_gemm|_decode" --section SourceCounters --section WarpStateStats --page source --print-source sass --csv python scripts/ncu_kernels.py $c > $OUT/ncu_$c.csv 2> $OUT/ncu_$c.err
  python scripts/ncu_stalls.py $OUT/ncu_$c.csv --top 15 > $OUT/stalls_$c.txt 2>&1; head -c 5000 $OUT/stalls_$c.txt
  echo "ncu $c done $((SECONDS-t0)) s"
done
