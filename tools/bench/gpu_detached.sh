#!/usr/bin/env bash
# gpu_session.sh detached from the device call (setsid), so that its stages can outlast one 10-minute call: the first
# call starts it, each call waits up to WAIT seconds and packs what is done so far into $OUT/results.tgz (a call
# brings back at most 8 files). STAGES run one at a time in the order given (gpu_session.sh alone runs its own order).
#   first call:  START=1 STAGES="herald blockroute" bash tools/bench/gpu_detached.sh
#   later calls: bash tools/bench/gpu_detached.sh      (the machine goes back 30 s after a call: call again at once)
# A stage is stopped after STAGE_TIMEOUT seconds (default 1200), whatever its own timeouts. A stage "a+b" runs a and b at once (e.g. trainll+gpulist: a training run beside tests, nothing timed);
# "gpulist" alone runs every test folder's GPU tests at once (logs gpu_list_<folder>.log); "gpulist@tests/engine,tests/kv"
# is the GPU list of those folders as one pytest (log gpu_list_<n>.<m>.log: stage n, part m). A stage's
# $OUT/pkg (checkpoint shards, each under the 16 MiB a returned file may have) comes back as files of their own.
# The working tree and the carried .whl (6.8 MiB: pydantic, fastapi, openai, httpx for the server tests, ... for
# Python 3.12) reach the device's 64 MiB limit: move docs/ (6 MiB) and compiledllm/assets/tiny-llada2.1-block8
# (20 MiB; only its own tests read it) out of the tree for the calls and back after them, and since the twenty-seventh
# session compiledllm/assets/tasks/retrieval_{4k,8k}.jsonl too (1.7 MB; CPU tests only): 62.3 MiB with the wheels;
# compiledllm/assets/tiny-llada2 (14 MiB) can go too where no stage loads it.
set -uo pipefail
RES=/tmp/gpu_results
OUT=${OUT:-/tmp/out}
mkdir -p "$RES" "$OUT"
if [ "${START:-0}" = 1 ]; then
  rm -f "$RES/DONE"
  # the stages run in a copy of the tree: each later call copies the working tree onto the machine again, under the
  # running stages (the twenty-seventh session lost a test so: a kernel source it opened was missing mid-copy)
  rm -rf /tmp/gpu_tree && cp -a . /tmp/gpu_tree && cd /tmp/gpu_tree || exit 1
  # once, before stages that may run at once; every package the server tests import (the device has pydantic only)
  if ! python3 -c "import pydantic, fastapi, uvicorn, httpx, openai" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  setsid bash -c "n=0; for s in \$STAGES; do n=\$((n+1)); echo \"== stage \$s \$(date +%T)\"; m=0; for part in \${s//+/ }; do m=\$((m+1)); \
    paths=\${part#gpulist@}; [ \"\$paths\" != \"\$part\" ] && part=gpulist || paths=\${GPULIST_PATHS:-}; \
    OUT=$RES STAGES=\$part GPULIST_PATHS=\"\${paths//,/ }\" GPULIST_TAG=\$n.\$m timeout -k 20 \${STAGE_TIMEOUT:-1200} \
    bash tools/bench/gpu_session.sh & done; wait; \
    done > $RES/session.log 2>&1; date +%T > $RES/DONE" < /dev/null &
fi
# what is done so far is packed every PACK_EVERY seconds too: a call stopped at the device's time limit (rc 124, when
# WAIT is more than the device time left) still brings back $OUT as it was (the eighteenth session lost a call so)
pack() { tar -czf "$OUT/results.tgz.part" --exclude=./pkg -C "$RES" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
t0=$(date +%s); last=$t0
while [ ! -f "$RES/DONE" ] && [ $(($(date +%s) - t0)) -lt "${WAIT:-540}" ]; do
  sleep 5
  [ $(($(date +%s) - last)) -ge "${PACK_EVERY:-60}" ] && { pack; last=$(date +%s); }
done
pack
[ -d "$RES/pkg" ] && cp "$RES"/pkg/* "$OUT"/
[ -f "$RES/DONE" ] && echo "all stages done at $(cat "$RES/DONE")" || echo "still running"
grep -v -i warn "$RES/session.log" | tail -n ${TAIL:-60}
