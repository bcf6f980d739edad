#!/bin/bash
# The sixth session's H200 runs (2026-12-01). Usage on the device:
#   TESTS="tests/test_tiers.py ..." bash benchmarks/h200_session6.sh tests   # GPU tests
#   bash benchmarks/h200_session6.sh table,probe-host   # the 4.9 GB table; probe_prefill_host.py
#   VARIANTS="base caller-stream numpy-get.chunked" bash benchmarks/h200_session6.sh e2e
#     e2e once per variant (benchmarks/variants.py; "." joins several), one process each, so
#     each variant's ratios are to its own resident runs
#   bash benchmarks/h200_session6.sh demo   # plestore demo on the GPU (its table printed)
# REPS (default 5), CACHES (default warm,cold), BATCHES (default 1,8,64), TIERS go to every e2e.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
stages=",$1,"
t=bench-work/t
if [[ $stages == *,tests,* ]]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-} 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
  cat "$OUT/gpu_tests.txt"
fi
if [[ $stages == *,table,* ]]; then
  bash benchmarks/h200_session4.sh table  # the same 4.9 GB NVFP4 table, into $t
fi
if [[ $stages == *,probe-host,* ]]; then
  timeout 120 python3 benchmarks/probe_prefill_host.py $t > "$OUT/probe-host.jsonl" 2>&1
  cat "$OUT/probe-host.jsonl"
fi
if [[ $stages == *,e2e,* ]]; then
  for v in ${VARIANTS:-base}; do
    # (the device returns at most 8 files: one JSON per variant, one log for all)
    echo "== $v" >> "$OUT/e2e.log"
    timeout ${E2E_TIMEOUT:-300} python3 benchmarks/variants.py $v bench e2e $t --json \
      --e2e-reps ${REPS:-5} --caches ${CACHES:-warm,cold} \
      --batches ${BATCHES:-1,8,64} --tiers ${TIERS:-device,pinned,mapped,direct} \
      > "$OUT/e2e-$v.json" 2>> "$OUT/e2e.log"
    echo "== $v"
    python3 -c "import json,sys
for r in json.load(open(sys.argv[1]))['e2e']:
    print(r['tier'], r['batch'], r['cache'], 'prefill %.3f decode %.3f' % (r['prefill_ratio'], r['decode_ratio']),
          'pre ms %.2f exp %.2f win %.2f host %.2f' % (r['prefill_step_ms'], r['exposed_prefill_ms'], r['window_prefill_ms'], r['host_prefill_ms']))" "$OUT/e2e-$v.json"
  done
fi
if [[ $stages == *,demo,* ]]; then
  timeout ${DEMO_TIMEOUT:-150} python3 -m plestore demo --dir bench-work/demo 2>&1 | tail -12 > "$OUT/demo.txt"
  cat "$OUT/demo.txt"
fi
