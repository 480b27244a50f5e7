#!/usr/bin/env bash
# One device call: GPU engine tests, the quickstart on CUDA, then the decode benchmark. Writes under $OUT.
# Usage (device machine, repo root; pydantic wheels carried in .whl): bash tools/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
for g in false true; do
  timeout 60 python3 -c "from compiledllm.cli import main; main()" run recipes/quickstart.yaml --set model.device=cuda \
    --set model.dtype=bfloat16 --set cuda_graphs=$g --set output=$OUT/quickstart_cuda_graphs_$g.jsonl 2>&1 | tail -6
done
timeout ${BENCH_TIMEOUT:-210} python3 tools/bench_decode.py --out "$OUT/bench_decode_h200.json" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_decode.log" | tail -30
