#!/usr/bin/env bash
# One device call: GPU tests, the quickstart on CUDA, then the benchmarks. Writes under $OUT.
# Usage (device machine, repo root; pydantic wheels carried in .whl): bash tools/bench/gpu_session.sh
# Every `timeout` has -k 20 (the CLI takes SIGTERM as a stop after its current unit, signals.py, which can outlast a
# stage: flashyard had not ended 13 minutes after its 400 s eval began, 2026-12-06) and grep is line-buffered.
# STAGES picks what runs (default: tests quickstart moe decode selection); also: compiled (compiled + captured
# steps at batch >= 32, ~100-130 s of compile per point), kernels (tools/bench/kernel_table.py, eager vs compiled;
# KERNELS_ARGS, KERNELS_OUT) and attention (packed-attention GPU tests of both kernels, then
# tools/bench/bench_attention.py, CuPy vs Triton), grid (the whole benchmark grid in all three modes, one process per
# GPU, resumable across calls: GRID_RESUME) and head
# (tools/bench/bench_head.py: the row-selective head against cuBLAS), profile (compiledllm profile of a batch-8 4K run),
# sampling (tools/bench/bench_sampling.py), prefill / moeprefill / attnbase / e2e (issue 19's prefill, MoE-at-prefill,
# attention-baseline and end-to-end benchmarks), versus (bench_decode of the commit copied into .base/ and of this tree, in the same call, alternating: BASE_ROUNDS),
# session (issue 26's GPU tests: sessions, policy-owned KV, hooks, route groups, block routing, captured), e2evs
# (compiledllm bench end to end of .base/ and of this tree, same call, alternating: E2E_ROUNDS), serve (issue 30:
# compiledllm bench of recipes/serve_llada2_mini.yaml, then `compiledllm serve` of it under tools/bench/load_test.py),
# blockroute (LLaDA2.2 block routing: GPU tests of test_block_routing.py + test_triton_kernels.py, bench_block_routing.py
# (one MoE layer, standard vs capacity 48), then compiledllm bench at 4K of recipes/bench_block48{_standard,}.yaml
# under each BLOCKROUTE_FORMS: sorted (the experts' pairs sorted) or a setting of bench_block_routing.AB, default
# "sorted default"),
# startup (issue 31 item 3: `compile: auto` start-up with an empty Inductor cache, again warm, then compile=false),
# targets (issue 31's targets as a user meets them: `compile: auto`, the default, beside compile=false, with the
# ceilings of the same call: LLaDA2.0-mini batch 1 at 4K, 8 steps a block, separate and fused commit; the SDAR-4B
# workload of recipes/bench_sdar4b.yaml at 1 token a forward (fused commit), 0.8 (separate) and 1.6; e2e_ideal.py),
# commit (issue 31 item 1: threshold's commit fused against separate, compiledllm bench of LLaDA2.0-mini at 4K),
# herald (issue 27: mage / herald GPU tests, then compiledllm bench of LLaDA2.0-mini at 16K / 32K: threshold, mage and
# herald's forms at budget 5 %, same call; prompts of 16,000 / 32,000 so that 256 new tokens fit the preset's 32K
# context; HERALD_BATCHES=8,32,max probes each policy's largest batch; HERALD_BATCHES_<policy>: one policy's own, as host pools hold more rows;
# HERALD_TESTS=0 / HERALD_CEILINGS=0: skip the GPU tests / the ceilings), heraldq (selection recall and exact match on
# the yardstick's 4K / 2K retrieval), flash (issue 28's GPU tests, then tools/bench/bench_qkv_cache.py: the fused cache
# kernel against the separate path), flashspeed (issue 28: compiledllm bench of recipes/bench_llada8b.yaml for each of
# Fast-dLLM's no-cache / prefix / dual, Elastic-Cache and flash_dllm, + verify, separate cache path, logit tracker score;
# FLASH_POLICIES, FLASH_OUTPUTS, FLASH_BATCHES), gpulist (issue 31 item 6: `pytest -m gpu` of every test folder at
# once, the whole list; GPULIST_OWN: files run as pytests of their own beside their folder), aoti
# (tools/bench/aoti_probe.py: the CUDA export load crash on one nn.Linear, ways round it),
# exportbench (a CUDA export of the quickstart model timed against the live engine, same call),
# syncs (issue 27: tools/bench/sync_points.py, the decode loop's synchronising calls by line, Dense and HERALD's host form),
# heraldprof (issue 27: compiledllm profile of Dense and HERALD's host form at 32K), flashyard (issue 28:
# recipes/eval_flash.yaml on CUDA; FLASHYARD_SETS: more --set overrides, e.g. "--set compile=false"),
# trainll (issue 28 item 0: tiny-llada fine-tuned further; its weights in $OUT/pkg), trainblock (issue 29 item 5: the
# block-routed tiny-llada2.1 yardstick, 640 steps with 8 of 16 experts a block; its weights in $OUT/pkg), flowblock
# (issue 31 item 7: tools/bench/bench_flowblock.py on tiny-llada2.1's 256-token code continuations; FLOWBLOCK_BATCHES,
# FLOWBLOCK_WINDOW, FLOWBLOCK_PROMPTS)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-tests quickstart moe decode selection}
# the engine stages' compile setting: false, as every figure of record before `compile: auto` became the
# default (and their timeouts assume no compile); COMPILE=auto runs what a user gets by default
COMPILE=${COMPILE:-false}
mkdir -p "$OUT"
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
SITE_PATH=${PYTHONPATH:-}  # the carried wheels only (the versus stage puts another tree after them)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
has() { [[ " $STAGES " == *" $1 "* ]]; }
ceilings() {  # $1: JSON of this card's copy and bf16 matmul rates, measured now (gpu_timing.ceilings)
  python3 -c "import json, sys; sys.path.insert(0, 'tools/bench'); from gpu_timing import ceilings; json.dump(ceilings(), open('$1', 'w'))"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if has tests; then
  timeout -k 20 ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/models/test_triton_kernels.py tests/models/test_head.py tests/engine/test_gpu_engine.py tests/cli/test_export.py tests/cli/test_profile.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if has attention; then
  timeout -k 20 ${ATTN_TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/attention/test_packed_attention.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/attention_tests.log" | tail -6
  timeout -k 20 ${ATTN_TIMEOUT:-200} python3 tools/bench/bench_attention.py --out "$OUT/bench_attention_h200.json" \
    ${ATTN_ARGS:---batches 8,32,64 --prefixes 4096,32768 --qlens 32 --no-baselines --sweep --budget-s 120} 2>&1 \
    | grep --line-buffered -v -i warn | tee "$OUT/bench_attention.log" | tail -25
fi
if has quickstart; then
  for g in false true; do
    timeout -k 20 60 python3 -c "from compiledllm.cli import main; main()" run recipes/quickstart.yaml --set model.device=cuda \
      --set model.dtype=bfloat16 --set cuda_graphs=$g --set output=$OUT/quickstart_cuda_graphs_$g.jsonl 2>&1 | tail -6
  done
fi
if has sampling; then  # what temperature / top-k / top-p cost: captured steps and end to end, greedy in the same run
  timeout -k 20 ${SAMPLING_TIMEOUT:-300} python3 tools/bench/bench_sampling.py --out "$OUT/bench_sampling_h200.json" ${SAMPLING_ARGS:-} \
    2>&1 | grep --line-buffered -v -i warn | tee "$OUT/bench_sampling.log" | tail -12
fi
if has moe; then
  timeout -k 20 ${MOE_TIMEOUT:-150} python3 tools/bench/bench_moe.py --out "$OUT/bench_moe_h200.json" ${MOE_ARGS:-} 2>&1 \
    | tee "$OUT/bench_moe.log" | tail -8
fi
if has head; then
  timeout -k 20 ${HEAD_TIMEOUT:-120} python3 tools/bench/bench_head.py --out "$OUT/bench_head_h200.json" ${HEAD_ARGS:-} 2>&1 \
    | tee "$OUT/bench_head.log" | tail -8
fi
if has decode; then
  timeout -k 20 ${BENCH_TIMEOUT:-210} python3 tools/bench/bench_decode.py --out "$OUT/bench_decode_h200.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_decode.log" | tail -30
fi
if has grid; then  # the issue's whole grid, eager vs CUDA graphs vs compiled + graphs, with the step's split: one
  # process per GPU (--shard), merged at the end; a cut-off grid goes on in the next call from GRID_RESUME (JSONs
  # copied into the tree, space-separated)
  gpus=$(nvidia-smi -L | wc -l)
  for ((i = 0; i < gpus; i++)); do
    CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$((${CPUS:-$(nproc)} / gpus)) timeout -k 20 ${GRID_TIMEOUT:-540} \
      python3 tools/bench/bench_decode.py --modes eager,graphs,compiled+graphs --split --shard $i/$gpus \
      ${GRID_RESUME:+--resume $GRID_RESUME} --out "$OUT/bench_decode_grid_shard$i.json" 2>&1 | grep --line-buffered -v -i warn \
      > "$OUT/bench_decode_grid_shard$i.log" &
  done
  wait
  tail -n 3 "$OUT"/bench_decode_grid_shard*.log
  python3 tools/bench/bench_decode.py --merge --resume ${GRID_RESUME:-} $(ls "$OUT"/bench_decode_grid_shard*.json) \
    --out "$OUT/bench_decode_grid_h200.json" 2>&1 | tee "$OUT/bench_decode_grid.log" | tail -30
fi
if has versus; then  # this tree against an earlier commit's tree in .base/ (git archive REV compiledllm tools), same
  # device call, alternating base / new so that drift shows as the spread between the rounds
  for round in $(seq 1 ${VERSUS_ROUNDS:-2}); do
    modes=${VERSUS_MODES:-graphs,compiled+graphs}
    [ "$round" = 2 ] && modes=${VERSUS_MODES2:-graphs}
    for side in base new; do
      dir=$PWD; [ "$side" = base ] && dir=$PWD/.base
      bench=tools/bench/bench_decode.py; [ -f "$dir/$bench" ] || bench=tools/bench_decode.py  # a base from before tools/bench/
      (cd "$dir" && PYTHONPATH=${SITE_PATH:+$SITE_PATH:}$dir timeout -k 20 ${VERSUS_TIMEOUT:-280} python3 $bench \
        --plan "${VERSUS_PLAN:-llada2.0-mini:4096,32768}" --batches "${VERSUS_BATCHES:-32}" --modes "$modes" \
        --out "$OUT/versus_${side}_r$round.json" 2>&1 | grep --line-buffered -v -i warn | tail -4)
    done
  done
fi
if has e2evs; then  # issue 26: compiledllm bench end to end, .base/ (the commit before) and this tree, alternating
  for round in $(seq 1 ${E2E_ROUNDS:-1}); do
    for side in base new; do
      dir=$PWD; [ "$side" = base ] && dir=$PWD/.base
      (cd "$dir" && PYTHONPATH=${SITE_PATH:+$SITE_PATH:}$dir timeout -k 20 ${E2EVS_TIMEOUT:-200} python3 -m compiledllm bench --set compile=$COMPILE \
        recipes/profile_llada2_mini.yaml --prompt-len ${E2EVS_PROMPTS:-4096,32000} --output-len 512 --batch 32 \
        --out "$OUT/e2evs_${side}_r$round.json" 2>&1 | grep --line-buffered -v -i warn | tail -5)
    done
  done
fi
if has prefill; then  # issue 19: prefill through the engine (batched chunks) vs the one-row path
  timeout -k 20 ${PREFILL_TIMEOUT:-300} python3 tools/bench/bench_prefill.py --out "$OUT/bench_prefill_h200.json" ${PREFILL_ARGS:-} \
    2>&1 | grep --line-buffered -v -i warn | tee "$OUT/bench_prefill.log" | tail -12
fi
if has attnpre; then  # issue 31 item 5: attention of prefill chunks (4,096 queries a row, block 32, 4 rows) against
  # static Flex and SDPA's cuDNN / memory-efficient backends under the same block-causal mask
  timeout -k 20 ${ATTNPRE_TIMEOUT:-300} python3 tools/bench/bench_attention.py --heads ${ATTNPRE_HEADS:-16/4,32/8} --batches 4 \
    --prefixes ${ATTNPRE_PREFIXES:-0,12288,28672} --qlens 4096 --slot 32 --baselines flex_static,sdpa_cudnn,sdpa_efficient \
    --budget-s ${ATTNPRE_BUDGET:-240} --out "$OUT/bench_attention_prefill.json" 2>&1 | grep --line-buffered -v -i warn \
    | tee "$OUT/bench_attention_prefill.log" | tail -16
fi
if has prefirst; then  # issue 31 items 2, 5: the SDAR-4B workload under the defaults (prefill compiled), then with
  # prefill.compile=false in the same call (its decode graphs then warm in Inductor's cache), then (form "first")
  # prefill.priority=first_block with a first forward of 65 of the 128 prompts (PREFIRST_FORMS picks and orders them);
  # first72: first with a 72-row batch bucket, so that those 65 rows' first block steps run at 72 rows, not 128;
  # a form ending in "ns" (firstns, first72ns, autons): the same with `prefill.first_step: false` (the first decode
  # step a forward of its own, as before the twenty-fifth session); a form ending in "cs" (first72cs, autocs): the same
  # with `prefill.compile_small: true` (the small forwards compiled too); the card's copy and matmul rates first, in the
  # same call (the first forward's floor is its FLOPs at that rate, a step's its bytes at the copy rate)
  ceilings "$OUT/prefirst_ceilings.json"
  for form in ${PREFIRST_FORMS:-auto false first}; do
    base=${form%cs}; small=$([ "$base" != "$form" ] && echo "--set prefill.compile_small=true"); base=${base%ns}
    sets="--set prefill.compile=$base"
    [[ $base = first* ]] && sets="--set prefill.priority=first_block --set prefill.tokens=8320"
    [ $base = first72 ] && sets="$sets --set buckets=[1,2,4,8,16,32,64,72,128]"
    [[ ${form%cs} = *ns ]] && sets="$sets --set prefill.first_step=false"
    sets="$sets $small"
    timeout -k 20 ${PREFIRST_TIMEOUT:-240} python3 -m compiledllm bench recipes/bench_sdar4b.yaml $sets \
      --prompt-len 128 --output-len ${PREFIRST_OUTPUT:-1024} --batch 128 --out "$OUT/prefirst_sdar4b_$form.json" 2>&1 \
      | grep --line-buffered -v -i warn | tail -4
  done
fi
if has moeprefill; then  # issue 19: routed experts at prefill sizes against the dense GEMM rate, tile sweep
  timeout -k 20 ${MOEP_TIMEOUT:-200} python3 tools/bench/bench_moe.py --batches "" --prefill-tokens ${MOEP_TOKENS:-2048,8192,16384,32768} \
    --prefill-sweep --out "$OUT/bench_moe_prefill_h200.json" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/bench_moe_prefill.log" | tail -24
fi
if has e2e; then  # issue 19: compiledllm bench end to end (4K-32K, outputs 512, the probed largest batch), SDAR-8B,
  # and prefill interleaved under a request rate; ideal / share: tools/bench/e2e_ideal.py on the JSON afterwards
  ceilings "$OUT/ceilings.json"
  R=recipes/profile_llada2_mini.yaml
  timeout -k 20 ${E2E_TIMEOUT:-170} python3 -m compiledllm bench $R --set compile=$COMPILE --prompt-len 4096,16000,32000 --output-len 512 \
    --batch 1,8,32 --out "$OUT/e2e_llada.json" 2>&1 | grep --line-buffered -v -i warn | tail -8
  timeout -k 20 ${E2E_TIMEOUT:-170} python3 -m compiledllm bench $R --set compile=$COMPILE --set model.config=sdar-8b --prompt-len 16000,32000 \
    --output-len 256 --batch 1,8,max --out "$OUT/e2e_sdar.json" 2>&1 | grep --line-buffered -v -i warn | tail -8
  timeout -k 20 ${INTERLEAVE_TIMEOUT:-150} python3 tools/bench/bench_interleave.py --out "$OUT/interleave.json" 2>&1 | tail -6
fi
if has attnbase; then  # issue 19: the CuPy / Triton kernels against static Flex (and FlashInfer where carried in .fi/)
  if [ -f .fi/fi_site.tar.xz ]; then
    tar -xJf .fi/fi_site.tar.xz -C /tmp/site && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
  fi
  timeout -k 20 ${ATTNB_TIMEOUT:-300} python3 tools/bench/bench_attention.py --heads ${ATTNB_HEADS:-16/4,32/8} --batches 8,32 \
    --prefixes 4096,32768 --qlens 32 --flashinfer-backends ${ATTNB_FI:-fa2} --budget-s ${ATTNB_BUDGET:-240} \
    --out "$OUT/bench_attention_baselines_h200.json" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/bench_attention_baselines.log" | tail -30
fi
if has compiled; then
  timeout -k 20 ${COMPILED_TIMEOUT:-450} python3 tools/bench/bench_decode.py --plan "${COMPILED_PLAN:-llada2.0-mini:4096,32768}" \
    --batches "${COMPILED_BATCHES:-32,max}" --modes "${COMPILED_MODES:-graphs,compiled+graphs}" \
    --out "$OUT/bench_decode_compiled_h200.json" \
    2>&1 | grep --line-buffered -v -i warn | tee "$OUT/bench_decode_compiled.log" | tail -8
fi
if has kernels; then  # KERNELS_RUNS="name:args;name:args" runs several workloads, each its own process (kernels_<name>.json)
  if [ -n "${KERNELS_RUNS:-}" ]; then
    IFS=';' read -ra runs <<< "$KERNELS_RUNS"
    for r in "${runs[@]}"; do
      echo "-- kernels ${r%%:*}: ${r#*:}"
      timeout -k 20 ${KERNELS_TIMEOUT:-200} python3 tools/bench/kernel_table.py ${r#*:} --out "$OUT/kernels_${r%%:*}.json" \
        2>&1 | grep --line-buffered -v -i warn | tail -${KERNELS_TAIL:-40}
    done
  else
    timeout -k 20 ${KERNELS_TIMEOUT:-200} python3 tools/bench/kernel_table.py --batch 32 --context 4096 ${KERNELS_ARGS:-} \
      --out "$OUT/${KERNELS_OUT:-kernels_llada2_b32_4k_h200.json}" 2>&1 | grep --line-buffered -v -i warn | tail -60
  fi
fi
if has profile; then  # compiledllm profile on CUDA: 8 prompts of 4096 random ids (eager, phases attributed per kernel)
  python3 -c "import json, random; r = random.Random(0)
print('\n'.join(json.dumps({'ids': [r.randrange(2, 150000) for _ in range(4096)]}) for _ in range(8)))" > /tmp/p4k.jsonl
  timeout -k 20 ${PROFILE_TIMEOUT:-150} python3 -c "from compiledllm.cli import main; main()" profile \
    recipes/profile_llada2_mini.yaml --set prompts_file=/tmp/p4k.jsonl --set "prompts=[]" --out "$OUT/profile" 2>&1 \
    | grep --line-buffered -v -i warn | tail -16
fi
if has selection; then  # build, the CPU selection tests (AMX ones fail, not skip, on AMX hardware that misbehaves), bench
  if python3 setup.py build_ext --inplace -q >"$OUT/selection_build.log" 2>&1; then
    timeout -k 20 ${SEL_TEST_TIMEOUT:-180} python3 -m pytest -q -rs tests/kv/test_cpu_select.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/cpu_select_tests.log" | tail -12
    timeout -k 20 ${SEL_TIMEOUT:-200} python3 tools/bench/bench_selection.py --out "$OUT/bench_selection_h200.json" ${SEL_ARGS:-} \
      2>&1 | tee "$OUT/bench_selection.log" | tail -30
  else
    echo "selection: build_ext failed, see selection_build.log"; tail -20 "$OUT/selection_build.log"
  fi
fi
if has session; then  # issue 26: captured sessions, the demonstrations' captured steps, the engine's GPU tests
  timeout -k 20 ${SESSION_TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu ${SESSION_TESTS:-tests/engine/test_session.py \
    tests/policies/test_sparse_pool.py tests/policies/test_prefix_cache.py tests/models/test_block_routing.py \
    tests/models/test_route_groups.py tests/engine/test_gpu_engine.py} -p no:cacheprovider 2>&1 \
    | tee "$OUT/session_gpu_tests.log" | tail -8
fi
if has serve; then  # issue 30: the engine in-process (compiledllm bench) and behind HTTP (serve + load_test), same shape
  R=${SERVE_RECIPE:-recipes/serve_llada2_mini.yaml}
  timeout -k 20 ${SERVE_BENCH_TIMEOUT:-180} python3 -m compiledllm bench $R --set compile=$COMPILE --prompt-len ${SERVE_PROMPT:-512} --output-len 128 \
    --batch 32 --requests ${SERVE_REQUESTS:-512} --out "$OUT/serve_bench_baseline.json" 2>&1 | grep --line-buffered -v -i warn | tail -6
  python3 -m compiledllm serve $R --set compile=$COMPILE --port 0 >/tmp/serve.out 2>/tmp/serve.err &
  SPID=$!
  for i in $(seq 1 600); do grep -q "serving" /tmp/serve.out && break; kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
  URL=$(grep -o "http://[0-9.:]*" /tmp/serve.out | head -1)
  echo "server $SPID at $URL"; tail -3 /tmp/serve.err
  L="python3 tools/bench/load_test.py --url $URL --pid $SPID --ids --no-progress"
  timeout -k 20 ${LOAD_TIMEOUT:-200} $L --clients 64 --requests ${SERVE_REQUESTS:-512} --max-tokens 128 \
    --prompt-tokens ${SERVE_PROMPT:-512} --out "$OUT/load_gpu_64.json" 2>&1 | tail -14
  timeout -k 20 ${LOAD_TIMEOUT:-200} $L --clients 32 --requests ${SERVE_REQUESTS:-512} --max-tokens 128 \
    --prompt-tokens ${SERVE_PROMPT:-512} --out "$OUT/load_gpu.json" 2>&1 | tail -14
  timeout -k 20 ${LOAD_TIMEOUT:-200} $L --clients 32 --requests ${SERVE_REQUESTS:-512} --max-tokens 128 \
    --prompt-tokens ${SERVE_PROMPT:-512} --stream --out "$OUT/load_gpu_stream.json" 2>&1 | tail -14
  timeout -k 20 ${SOAK_TIMEOUT:-330} $L --soak --time-limit ${SOAK_LIMIT:-280} --clients 64 --requests ${SOAK_REQUESTS:-10000} --max-tokens 8 \
    --prompt-tokens 32 --out "$OUT/load_gpu_soak.json" 2>&1 | tail -14
  kill -TERM $SPID; wait $SPID; echo "server exit code $?"; tail -3 /tmp/serve.out
fi
if has blockroute; then  # LLaDA2.2 block routing: GPU tests, the MoE layer alone, then end to end (standard vs block 48)
  timeout -k 20 ${BLOCKROUTE_TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/models/test_block_routing.py \
    tests/models/test_triton_kernels.py -p no:cacheprovider \
    2>&1 | tee "$OUT/block_routing_tests.log" | tail -8
  timeout -k 20 ${BLOCKROUTE_TIMEOUT:-170} python3 tools/bench/bench_block_routing.py --out "$OUT/bench_block_routing_h200.json" \
    ${BLOCKROUTE_ARGS:---sweep 1,8 --kernels} 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/bench_block_routing.log" | tail -22
  # end to end under each BLOCKROUTE_FORMS: pairs sorted by expert, or an A/B setting of the bench (default: none)
  for form in ${BLOCKROUTE_FORMS:-sorted default}; do
    for r in ${BLOCKROUTE_RECIPES-bench_block48_standard bench_block48}; do
      timeout -k 20 ${BLOCKROUTE_E2E_TIMEOUT:-140} python3 -c "import sys; sys.path.insert(0, 'tools/bench')
from bench_block_routing import AB
from compiledllm.models import moe_triton
for k, v in ({'EXPERT_SCAN_TOKENS': 0} if '$form' == 'sorted' else AB['$form']).items(): setattr(moe_triton, k, v)
from compiledllm.cli import main; main()" bench recipes/$r.yaml --set compile=$COMPILE --prompt-len ${BLOCKROUTE_PROMPTS:-4096} \
        --output-len 512 --batch ${BLOCKROUTE_BATCHES:-1,8,32} --out "$OUT/e2e_${r}_$form.json" 2>&1 \
        | grep --line-buffered -v -i warn | tee "$OUT/e2e_${r}_$form.log" | tail -8
    done
  done
fi
if has startup; then  # `compile: auto` cold, warm, and off: LLaDA2.0-mini shape, batch 8 (buckets 1, 2, 4, 8)
  export COMPILEDLLM_CACHE_DIR=$(mktemp -d /tmp/cllm_cache.XXXX)  # empty: the first run compiles cold
  for run in cold warm off; do
    extra=""; [ "$run" = off ] && extra="--set compile=false"
    t0=$(date +%s%N)
    (unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR; timeout -k 20 ${STARTUP_TIMEOUT:-170} python3 -m compiledllm bench \
      recipes/serve_llada2_mini.yaml --prompt-len 512 --output-len 128 --batch 8 $extra --out "$OUT/startup_$run.json" \
      > "$OUT/startup_$run.log" 2>&1)
    echo "startup $run: rc $?, whole process $(( ($(date +%s%N) - t0) / 1000000 )) ms"  # (no bc on the device)
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); p=r['points'][0]; print({k: p.get(k) for k in \
('startup_s','output_tokens_per_s','decode_tokens_per_s','compile_cache','error')}, r.get('compile'))" \
      "$OUT/startup_$run.json" 2>&1 | tail -1
  done
fi
if has commit; then  # threshold's fused commit against the separate one, same call: decode at batch 1, 8, 32
  for c in separate fused; do
    timeout -k 20 ${COMMIT_TIMEOUT:-170} python3 -m compiledllm bench recipes/bench_block48_standard.yaml \
      --set compile=$COMPILE --set policy.commit=$c --set policy.steps=8 --prompt-len 4096 --output-len 256 --batch ${COMMIT_BATCHES:-1,8,32} \
      --out "$OUT/commit_$c.json" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/commit_$c.log" | tail -8
  done
fi
if has targets; then  # issue 31's targets, the default (compile: auto) beside compile=false, ceilings of this call
  ceilings "$OUT/ceilings.json"
  for run in auto:separate auto:fused false:separate false:fused; do
    timeout -k 20 ${TARGETS_TIMEOUT:-150} python3 -m compiledllm bench recipes/bench_block48_standard.yaml \
      --set compile=${run%:*} --set policy.commit=${run#*:} --set policy.steps=8 --prompt-len 4096 --output-len 256 \
      --batch 1 --out "$OUT/target_mini_b1_${run/:/_}.json" 2>&1 | grep --line-buffered -v -i warn | tail -3
  done
  for run in auto:4:fused auto:4:separate auto:2:separate false:4:separate; do  # compile:steps:commit
    IFS=: read -r c n m <<< "$run"
    timeout -k 20 ${TARGETS_TIMEOUT:-150} python3 -m compiledllm bench recipes/bench_sdar4b.yaml --set compile=$c \
      --set policy.steps=$n --set policy.commit=$m --prompt-len 128 --output-len 1024 --batch 128 \
      --out "$OUT/target_sdar4b_${c}_steps${n}_$m.json" 2>&1 | grep --line-buffered -v -i warn | tail -3
  done
  python3 tools/bench/e2e_ideal.py --ceilings "$OUT/ceilings.json" --out "$OUT/target_ideal.json" "$OUT"/target_*_*.json
fi
herald_sets() {  # the --set overrides (in $sets) and environment (in $envs) of the herald stage's policy name $1
  local p=$1
  sets="--set policy.name=${p%%_*}"
  [[ $p != threshold* ]] && sets="$sets --set policy.budget=0.05"
  [ $p = threshold_c ] && sets="$sets --set prefill.compile=true"  # Dense with its prefill compiled, as herald_host8wc
  [ $p = herald_scan ] && sets="$sets --set policy.retrieval=scan"
  [ $p = herald_hostmage ] && sets="$sets --set policy.pool=host --set policy.lookahead=none --set policy.query=block"
  [ $p = herald_hostrep ] && sets="$sets --set policy.pool=host --set policy.lookahead=none"
  [ $p = herald_hostfwd ] && sets="$sets --set policy.pool=host"
  [ $p = herald_host ] && sets="$sets --set policy.retrieval=scan --set policy.pool=host"
  [ $p = herald_keys ] && sets="$sets --set policy.retrieval=scan --set policy.pool=host --set policy.keys=device"
  [[ $p = herald_host8* ]] && sets="$sets --set policy.retrieval=scan --set policy.pool=host --set policy.scratch=8"
  [[ $p =~ ^herald_host8t([0-9]+)$ ]] && sets="$sets --set policy.host_threads=${BASH_REMATCH[1]}"
  [ $p = herald_host8w ] && sets="$sets --set prefill.tokens=32768"  # every scratch cache's chunk in one forward
  [[ $p = herald_host8wc* ]] && sets="$sets --set prefill.tokens=32768 --set prefill.compile=true"  # its prefill compiled
  [ $p = herald_host8wc2 ] && sets="$sets --set policy.draft_fold=false"  # a drafting step's two forwards (before s24)
  [ $p = herald_host8wcw ] && sets="$sets --set policy.draft_wait=${DRAFT_WAIT:-4}"  # groups out of step draft together
  envs=""; [ $p = herald_host8p ] && envs="OMP_WAIT_POLICY=PASSIVE"
  [ $p = herald_fetch ] && sets="$sets --set policy.pool=host --set policy.lookahead=none --set policy.retrieval=fetch"
  [ $p = herald_keysw ] && sets="$sets --set policy.retrieval=scan --set policy.pool=host --set policy.keys=device \
    --set policy.draft_wait=${DRAFT_WAIT:-4}"
}
if has herald; then  # mage / herald (device pool, host pool): exactness on the GPU, the sparse step's speed, then quality
  python3 -c "import compiledllm._cpu_select" 2>/dev/null || python3 setup.py build_ext --inplace -q >"$OUT/ext_build.log" 2>&1 \
    || echo "herald: build_ext failed (the host pool scans in torch), see ext_build.log"
  [ "${HERALD_TESTS:-1}" = 1 ] && timeout -k 20 ${HERALD_TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/policies/test_mage.py \
    tests/policies/test_herald.py tests/engine/test_hooks.py -p no:cacheprovider 2>&1 | tee "$OUT/herald_tests.log" | tail -6
  for ctx in $(echo ${HERALD_CONTEXTS:-16000,32000} | tr , ' '); do  # the same call's ceilings: HBM, PCIe, DRAM, ext/
    [ "${HERALD_CEILINGS:-1}" = 1 ] && timeout -k 20 120 python3 tools/bench/herald_ceilings.py --prefix $ctx \
      --out "$OUT/herald_ceilings_$ctx.json" 2>&1 | tail -7
  done
  # the host pool's ablation: herald_hostmage (the B [MASK] queries' CPU attention at the boundary: MAGE-Offload's
  # selection on the CPU), herald_hostrep (+ one representative query), herald_hostfwd (+ the draft's lookahead:
  # HERALD as published), herald_host (the K-only scan from the draft step instead of the retrieval forward),
  # herald_keys (variant 5c: every key on the device, scanned there; only the values in the host pool), herald_keysw
  # (herald_keys with draft_wait DRAFT_WAIT: rows out of step draft in one forward), herald_fetch (MAGE-Offload's second
  # form: each block's prefix fetched from the host pool for MAGE's selection), herald_host8 (herald_host with 8 scratch
  # caches for admission instead of 4; herald_host8t<N>: on N host threads; herald_host8p: OMP_WAIT_POLICY=PASSIVE;
  # herald_host8w: prefill forwards of 32,768 tokens, so the decode steps between admissions are half as many;
  # herald_host8wc: herald_host8w with its prefill compiled through the scratch caches, `prefill.compile: true`;
  # herald_host8wc2: herald_host8wc with a drafting step's two forwards, `draft_fold: false`; herald_host8wcw:
  # herald_host8wc with `draft_wait: DRAFT_WAIT` (default 4), fewer folded draft forwards);
  # phase_times (HERALD_PHASE_TIMES, default true): each decode phase's device time, in the report and a table
  for p in ${HERALD_POLICIES:-threshold mage herald herald_scan herald_hostmage herald_hostrep herald_hostfwd herald_host herald_keys}; do
    herald_sets $p
    var=HERALD_BATCHES_$p; batches=${!var:-${HERALD_BATCHES:-8,32}}  # e.g. HERALD_BATCHES_herald_keys: its own
    env $envs timeout -k 20 ${HERALD_BENCH_TIMEOUT:-200} python3 -m compiledllm bench recipes/bench_block48_standard.yaml \
      --set compile=$COMPILE $sets --set phase_times=${HERALD_PHASE_TIMES:-true} --prompt-len ${HERALD_CONTEXTS:-16000,32000} \
      --output-len 256 --batch $batches --out "$OUT/herald_bench_$p.json" 2>&1 | grep --line-buffered -v -i warn | tail -14
  done
  for ctx in $(echo ${HERALD_CONTEXTS:-16000,32000} | tr , ' '); do
    python3 tools/bench/plot_bench.py "$OUT"/herald_bench_*.json --prompt-len $ctx --out "$OUT/herald_bench_$ctx.png" 2>&1 | tail -1
  done
fi
if has heraldprof; then  # issue 27: where a decode step's time goes, Dense against HERALD's host form (eager, each
  # phase's kernels timed by CUDA events; host hooks, pool copies and waits land in "other"): HERALDPROF_BATCH prompts
  # of HERALDPROF_LEN random ids, HERALDPROF_OUT new tokens
  python3 -c "import compiledllm._cpu_select" 2>/dev/null || python3 setup.py build_ext --inplace -q >"$OUT/ext_build.log" 2>&1
  python3 -c "import json, random; r = random.Random(0)
print('\n'.join(json.dumps({'ids': [r.randrange(2, 150000) for _ in range(${HERALDPROF_LEN:-32000})]})
                for _ in range(${HERALDPROF_BATCH:-16})))" > /tmp/pherald.jsonl
  for p in ${HERALDPROF_POLICIES:-threshold herald_host8w}; do
    herald_sets $p
    env $envs timeout -k 20 ${HERALDPROF_TIMEOUT:-240} python3 -c "from compiledllm.cli import main; main()" profile \
      recipes/profile_llada2_mini.yaml $sets --set prompts_file=/tmp/pherald.jsonl --set "prompts=[]" \
      --set batch_size=${HERALDPROF_BATCH:-16} --set generation.max_new_tokens=${HERALDPROF_OUT:-128} \
      --out "$OUT/heraldprof_$p" 2>&1 | grep --line-buffered -v -i warn > "$OUT/heraldprof_$p.log"
    [ -f "$OUT/heraldprof_$p/profile.json" ] || { echo "$p: $(tail -n 1 "$OUT/heraldprof_$p.log")"; continue; }
    python3 -c "import json; d = json.load(open('$OUT/heraldprof_$p/profile.json'))
print('$p', d['steps'], 'steps, wall', round(d['wall_ms']), 'ms;', '; '.join(
    f\"{r['phase'].split(' (')[0]} {r['total_ms']:.0f}\" + (f\" ({r['per_step_ms']:.2f}/step)\" if r['per_step_ms'] else '')
    for r in d['phases']))"
  done
fi
if has syncs; then  # issue 27: where the host waits for the GPU in a decode loop (torch's sync debug mode, by source
  # line, per decode step; tools/bench/sync_points.py), Dense against HERALD's host form, SYNCS_LEN-token prompts
  for p in ${SYNCS_POLICIES:-threshold herald_host8w}; do
    herald_sets $p
    env $envs timeout -k 20 ${SYNCS_TIMEOUT:-240} python3 tools/bench/sync_points.py recipes/bench_block48_standard.yaml \
      --set compile=false $sets --prompt-len ${SYNCS_LEN:-8000} --batch ${SYNCS_BATCH:-8} --output-len 64 \
      --out "$OUT/sync_points_$p.json" 2>&1 | grep --line-buffered -v -i warn | tail -16
  done
fi
if has trainll; then  # issue 28 item 0: tiny-llada fine-tuned from the shipped weights, a fresh schedule of a fixed
  # step count (a plan from the first steps' time would stop at peak lr if another stage slows the GPU later)
  timeout -k 20 ${TRAIN_TIMEOUT:-590} python3 tools/train/train_tiny.py --kind tiny-llada --init-from compiledllm/assets/tiny-llada \
    ${TRAIN_ARGS:---lr 2e-3 --warmup 50 --steps 6000 --decay-frac 0.5 --deadline 560 --eval quick} --out /tmp/runs/ll \
    --package "$OUT/pkg" > "$OUT/train_tiny_llada.log" 2>&1
  tail -n 4 "$OUT/train_tiny_llada.log"
fi
if has aoti; then  # issue 31 item 6: the CUDA AOTInductor load crash, one nn.Linear, each package form x loading variant
  timeout -k 20 ${AOTI_TIMEOUT:-300} python3 tools/bench/aoti_probe.py ${AOTI_ARGS:-} --out "$OUT/aoti_probe.json" 2>&1 | grep --line-buffered -v -i warn \
    | tee "$OUT/aoti_probe.log" | tail -5
fi
if has exportbench; then  # a CUDA export timed: the quickstart model exported for CUDA, then compiledllm bench of
  # the live engine (compile: auto) and of the exported one, same call, same points (EXPORTBENCH_BATCHES)
  exp=/tmp/exported_quickstart; rm -rf $exp
  t0=$(date +%s)
  timeout -k 20 ${EXPORTBENCH_TIMEOUT:-400} python3 -m compiledllm export recipes/quickstart.yaml --set model.device=cuda \
    --set model.dtype=bfloat16 --max-seq-len 320 --out $exp 2>&1 | grep -v -i warn | tail -3
  echo "export: $(( $(date +%s) - t0 )) s"
  for form in live exported; do
    sets=""; [ $form = exported ] && sets="--set model.path=$exp --set model.trust_exported=true"
    timeout -k 20 200 python3 -m compiledllm bench recipes/quickstart.yaml --set model.device=cuda --set model.dtype=bfloat16 \
      $sets --prompt-len 128 --output-len 128 --batch ${EXPORTBENCH_BATCHES:-1,4} --out "$OUT/exportbench_$form.json" 2>&1 \
      | grep --line-buffered -v -i warn | tail -5
  done
fi
if has gpulist; then  # issue 31 item 6: every GPU test of the suite, the slowest named. One after the other the folders
  # take ~1,050 s on an H100 (more than a call), so by default each test folder runs as its own pytest at once (nothing
  # here is timed; the max-batch bench test bounds its own memory), then the tests marked bigmem alone (run at once,
  # they ran the card out of memory); GPULIST_PATHS runs those paths as one pytest. -v: a list cut by its timeout
  # still names every test that ran. Each folder's pytest stops after GPULIST_TIMEOUT (default 900 s: beside the
  # `syncs` stage the twenty-fifth session's engine folder was cut at 560 s, at its 20th of 28 tests)
  python3 -c "import compiledllm._cpu_select" 2>/dev/null || python3 setup.py build_ext --inplace -q >"$OUT/ext_build.log" 2>&1
  gpulist() {  # $1: log tag, $2: marker expression, then the paths
    local tag=$1 marks=$2; shift 2
    timeout -k 20 ${GPULIST_TIMEOUT:-900} python3 -m pytest -v -m "$marks" "$@" --durations=12 -p no:cacheprovider \
      > "$OUT/gpu_list_$tag.log" 2>&1
  }
  t0=$(date +%s)
  if [ -n "${GPULIST_PATHS:-}" ]; then
    gpulist "${GPULIST_TAG:-all}" gpu $GPULIST_PATHS; tail -n 22 "$OUT/gpu_list_${GPULIST_TAG:-all}.log"
  else
    # the files of GPULIST_OWN (default: the engine folder's compiled-step and prefill tests, 22 of its 29) run as
    # pytests of their own beside their folder's, which skips them: alone the engine folder outlasted a call, and as
    # one file (twenty-seventh session) these 22 took 626 s beside the other folders
    own=${GPULIST_OWN-tests/engine/test_gpu_engine.py tests/engine/test_gpu_prefill.py}; tags=""
    for f in $own; do t=$(basename "$f" .py); tags="$tags $t"; gpulist "$t" "gpu and not bigmem" "$f" & done
    for d in tests/*/; do d=${d%/}; tags="$tags ${d#tests/}"
      gpulist "${d#tests/}" "gpu and not bigmem" "$d" $(for f in $own; do [ "${f#$d/}" != "$f" ] && echo "--ignore=$f"; done) &
    done; wait
    gpulist bigmem "gpu and bigmem" tests
    for t in $tags bigmem; do printf '%-16s %s\n' "$t" "$(tail -n 1 "$OUT/gpu_list_$t.log")"; done
    for t in $tags bigmem; do grep -h '^FAILED\|^ERROR' "$OUT/gpu_list_$t.log"; done
  fi
  echo "gpu list: $(( $(date +%s) - t0 )) s wall"
fi
if has flowblock; then  # issue 31 item 7: FlowBlock (HWP) against lock-step and t2t end to end on the yardstick's
  # 256-token code continuations, and the W-block window's forward against t2t's on the LLaDA2.1-mini shape (random
  # weights)
  timeout -k 20 ${FLOWBLOCK_TIMEOUT:-360} python3 tools/bench/bench_flowblock.py --model tiny-llada2.1 \
    --tasks code_continue_256 --new-tokens 256 --ignore-eos --prompts ${FLOWBLOCK_PROMPTS:-16} \
    --batches ${FLOWBLOCK_BATCHES:-1,16} --window ${FLOWBLOCK_WINDOW:-2} --out "$OUT/bench_flowblock.json" 2>&1 \
    | grep --line-buffered -v -i warn | tee "$OUT/bench_flowblock.log" | tail -14
fi
if has flash; then  # issue 28: flash_dllm (+ verify), threshold verify, Fast-dLLM's caches: captured == eager on the GPU
  timeout -k 20 ${FLASH_TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/policies/test_flash_dllm.py tests/policies/test_elastic_cache.py \
    tests/policies/test_block_verify.py tests/policies/test_prefix_cache.py "tests/attention/test_packed_attention.py::test_triton_logit_score_in_the_attention_pass" -p no:cacheprovider 2>&1 \
    | tee "$OUT/flash_tests.log" | tail -6
  timeout -k 20 ${QKV_TIMEOUT:-150} python3 tools/bench/bench_qkv_cache.py --out "$OUT/bench_qkv_cache_h200.json" 2>&1 \
    | grep --line-buffered -v -i warn | tail -8
fi
if has flashspeed; then  # issue 28 item 6: the LLaDA-8B shape (random weights), Fast-dLLM's fixed-step mode, every
  # policy in its own process one after the other: no cache (Fast-dLLM's generate), its prefix and dual caches,
  # Elastic-Cache (elastic; elastic5: gamma 0.5, fewer recomputes),
  # flash_dllm (fused cache kernel), + Flash-Verify, with the separate cache path (flashs), with the tracker's logit
  # score made in the attention's pass (flashl), + Flash-Verify at gamma 0.5 (flashv5); FLASH_POLICIES picks
  for p in ${FLASH_POLICIES:-nocache prefix dual elastic flash flashv flashs flashl}; do
    case $p in
      elastic) sets="--set policy.name=elastic_cache" ;;
      elastic5) sets="--set policy.name=elastic_cache --set policy.gamma=0.5" ;;
      nocache) sets="--set policy.name=threshold --set policy.rule=fast_dllm" ;;
      prefix) sets="--set policy.name=fast_dllm_cache" ;;
      dual) sets="--set policy.name=fast_dllm_cache --set policy.dual=true" ;;
      flash) sets="" ;;
      flashv) sets="--set policy.verify=true" ;;
      flashv5) sets="--set policy.verify=true --set policy.gamma=0.5" ;;
      flashs) sets="--set policy.fused_cache=false" ;;
      flashl) sets="--set policy.track_score=logits" ;;
    esac
    timeout -k 20 ${FLASH_BENCH_TIMEOUT:-300} python3 -m compiledllm bench recipes/bench_llada8b.yaml --set compile=$COMPILE $sets \
      --prompt-len ${FLASH_PROMPT:-512} --output-len ${FLASH_OUTPUTS:-256,512} --batch ${FLASH_BATCHES:-1,8,32} \
      --out "$OUT/flash_bench_$p.json" 2>&1 | grep --line-buffered -v -i warn | tail -4
  done
  for n in $(echo ${FLASH_OUTPUTS:-256,512} | tr , ' '); do
    python3 tools/bench/plot_bench.py "$OUT"/flash_bench_*.json --output-len $n --out "$OUT/flash_bench_$n.png" 2>&1 | tail -1
  done
fi
if has trainblock; then  # issue 29 item 5: the block-routed yardstick, tiny-llada2.1 fine-tuned with 8 of its 16 experts
  # admitted per 32-token block (the 2026-12-03 H200 run's settings, a fixed step count), its weights in $OUT/pkg to ship
  timeout -k 20 ${TRAINBLOCK_TIMEOUT:-590} python3 tools/train/train_tiny.py --kind tiny-llada2.1 \
    --init-from compiledllm/assets/tiny-llada2.1 --expert-capacity 8 \
    ${TRAINBLOCK_ARGS:---lr 5e-4 --warmup 50 --steps 640 --decay-frac 0.2 --deadline 560 --eval quick} --out /tmp/runs/b8 \
    --package "$OUT/pkg" > "$OUT/train_block8.log" 2>&1
  tail -n 4 "$OUT/train_block8.log"
fi
if has flashyard; then  # issue 28 item 6's "yardstick model end to end": recipes/eval_flash.yaml on CUDA, every policy
  # (quality, tokens per forward and tokens/s on the real tasks, the trained tiny-llada; a 9M model is launch-bound)
  # (--log-level info: each start-up's compile / capture and its seconds in the log, as they happen; the thirteenth
  # session's attempt printed nothing in 13 minutes)
  timeout -k 20 ${FLASHYARD_TIMEOUT:-400} python3 -m compiledllm --log-level info eval recipes/eval_flash.yaml \
    --set model.device=cuda ${FLASHYARD_SETS:-} \
    --set limit=${FLASHYARD_LIMIT:-32} -o "$OUT/eval_flash_cuda.json" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/eval_flash_cuda.log" \
    | tail -14
  python3 tools/plots/plot_quality_speed.py "$OUT/eval_flash_cuda.json" --out "$OUT/quality_speed_flash_cuda.png" 2>&1 \
    | tail -1
fi
if has heraldq; then  # the selections' quality on the yardstick's long retrieval tasks, on the GPU (bf16)
  for ctx in ${HERALD_QUALITY:-4k 2k}; do  # (the 8K tasks' prompts exceed the yardstick's 8,192-token context)
    timeout -k 20 ${RECALL_TIMEOUT:-200} python3 tools/bench/selection_recall.py --device cuda --limit 32 --new 128 --batch 16 \
      --task compiledllm/assets/tasks/retrieval_$ctx.jsonl --out "$OUT/selection_recall_$ctx.json" 2>&1 | tail -8
    timeout -k 20 ${HERALD_EVAL_TIMEOUT:-300} python3 -m compiledllm eval recipes/eval_herald.yaml --set model.device=cuda --set model.dtype=bfloat16 \
      --set "tasks=[../compiledllm/assets/tasks/retrieval_$ctx.jsonl]" --set output=$OUT/eval_herald_$ctx.json 2>&1 | tail -16
  done
fi
