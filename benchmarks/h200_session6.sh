#!/bin/bash
# The sixth session's H200 runs (2026-12-01). Usage on the device:
#   TESTS="tests/test_tiers.py ..." bash benchmarks/h200_session6.sh tests,table   # as session 5
#   bash benchmarks/h200_session6.sh probe-direct   # benchmarks/probe_direct_parts.py (session 5)
#     (runs 1 and 3 ran its warm parts as probe_prefill_host.py, since merged into it)
#   VARIANTS="base caller-stream numpy-get.chunked" bash benchmarks/h200_session6.sh e2e
#     e2e once per variant (benchmarks/variants.py; "." joins several), one process each, so
#     each variant's ratios are to its own resident runs
#   bash benchmarks/h200_session6.sh demo   # plestore demo on the GPU (its table printed)
# REPS (default 5), CACHES (default warm,cold), BATCHES (default 1,8,64), TIERS go to every e2e;
# TAG prefixes its JSON files.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
stages=",$1,"
t=bench-work/t
shared=$(tr , '\n' <<< "$1" | grep -xE 'tests|table|probe-direct|probe-cold' | paste -sd,)
if [[ -n $shared ]]; then bash benchmarks/h200_session5.sh "$shared"; fi  # session 5's stages
if [[ $stages == *,e2e,* ]]; then
  for v in ${VARIANTS:-base}; do
    # (the device returns at most 8 files: one JSON per variant, one log for all)
    echo "== $v" >> "$OUT/e2e.log"
    timeout ${E2E_TIMEOUT:-300} python3 benchmarks/variants.py $v bench e2e $t --json \
      --e2e-reps ${REPS:-5} --caches ${CACHES:-warm,cold} \
      --batches ${BATCHES:-1,8,64} --tiers ${TIERS:-device,pinned,mapped,direct} \
      > "$OUT/e2e-${TAG:-}$v.json" 2>> "$OUT/e2e.log"
    echo "== $v"
    python3 -c "import json,sys
for r in json.load(open(sys.argv[1]))['e2e']:
    print(r['tier'], r['batch'], r['cache'], 'prefill %.3f decode %.3f' % (r['prefill_ratio'], r['decode_ratio']),
          'pre ms %.2f exp %.2f win %.2f host %.2f' % (r['prefill_step_ms'], r['exposed_prefill_ms'], r['window_prefill_ms'], r['host_prefill_ms']))" "$OUT/e2e-${TAG:-}$v.json"
  done
fi
if [[ $stages == *,demo,* ]]; then
  timeout ${DEMO_TIMEOUT:-150} python3 -m plestore demo --dir bench-work/demo 2>&1 | tail -12 > "$OUT/demo.txt"
  cat "$OUT/demo.txt"
fi
