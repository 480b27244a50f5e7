set -uo pipefail
export PYTHONUNBUFFERED=1
STAGES="tests" TESTS_TIMEOUT=200 bash tools/gpu_session.sh 2>&1 | tail -8
timeout 150 python3 -m pytest -q -m gpu tests/test_packed_attention.py -p no:cacheprovider -k "triton or Triton" 2>&1 | tail -4
export PYTHONPATH=/tmp/site:$PWD
timeout 130 python3 tools/bench_attention.py --out $OUT/bench_attention_sweep.json --batches 32 --prefixes 32768 --qlens 32 --no-baselines --sweep --budget-s 20 2>&1 | grep -v -i warn | tail -12
timeout 200 python3 tools/kernel_table.py --batch 32 --context 32768 --modes compiled+graphs --out $OUT/kernels_32k_b32_graphs.json 2>&1 | grep -v -i warn | tail -30
