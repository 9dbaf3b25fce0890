export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks
python -m pytest -p no:warnings -q -rs tests/test_wait.py 2>&1 | tail -3
timeout 150 python benchmarks/dropin_overhead.py --real --kernels twin --layer-loop scan --steps 100 2>&1 | grep -v "^W\|^I0\|WARNING" | tail -3 | tee $OUT/dropin.txt
timeout 240 python benchmarks/scale_bench.py --out $OUT/sb --kernels twin --loops scan --batches 1,4 --mimi-batches 4 2>&1 | grep -v "^W\|^I0\|WARNING" | cut -c1-300 | tail -5
