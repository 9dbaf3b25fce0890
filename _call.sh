export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
timeout 330 ncu --clock-control none -k regex:"attention|_split_kernel" --metrics gpu__time_duration.sum --csv python benchmarks/attention_ncu_gpu.py --batches 4,1 --plans 64x256,128x256,128x512,64x512 --warps 2,4 --stages 3 --calls 3 --manifest $OUT/m.json > $OUT/ncu.csv 2> $OUT/err.txt
echo rc $?; grep -v "^==PROF==" $OUT/ncu.csv | grep -v '^"' | tail -12; tail -3 $OUT/err.txt
python benchmarks/attention_ncu_gpu.py --summarize $OUT/ncu.csv --manifest $OUT/m.json --out $OUT/plans.json
