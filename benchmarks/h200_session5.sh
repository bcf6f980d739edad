#!/bin/bash
# The fifth session's H200 runs (2026-12-01). Usage on the device:
#   TESTS="tests/test_staged.py ..." bash benchmarks/h200_session5.sh tests   # GPU tests
#   bash benchmarks/h200_session5.sh table,e2e   # build the table; e2e (run 1 at 5da8902 also
#   ran e2e-staged: --staged-lookup, the flag of that commit)
#   ... e2e-pinned-cpu (run 3), probe-cold (runs 2-5), probe-direct (run 7)
# REPS (default 5) and CACHES (default warm,cold) go to every e2e run.
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
e2e() {  # name, extra args
  timeout ${E2E_TIMEOUT:-300} python3 -m plestore bench e2e $t --json --csv "$OUT/bench-$1.csv" \
    --e2e-reps ${REPS:-5} --caches ${CACHES:-warm,cold} "${@:2}" > "$OUT/e2e-$1.json" 2> "$OUT/e2e-$1.log"
  tail -21 "$OUT/e2e-$1.log"
}
if [[ $stages == *,e2e,* ]]; then e2e main; fi  # (runs 1-4 named it "between")
if [[ $stages == *,e2e-staged,* ]]; then e2e staged --staged-lookup; fi  # (run 1: 5da8902's flag)
if [[ $stages == *,e2e-pinned-cpu,* ]]; then
  PLESTORE_GATHER=cpu CACHES=warm e2e pinned-cpu --tiers device,pinned
fi
if [[ $stages == *,probe-cold,* ]]; then
  timeout 60 python3 benchmarks/probe_inline_parts.py $t --cold > "$OUT/probe-cold.json" 2>&1
fi
if [[ $stages == *,probe-direct,* ]]; then
  timeout 120 python3 benchmarks/probe_direct_parts.py $t > "$OUT/probe-direct.jsonl" 2>&1
  cat "$OUT/probe-direct.jsonl"
fi
