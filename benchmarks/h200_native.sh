#!/bin/bash
# The native host core on the H200 (#21): every measurement side by side with the Python path.
# Usage on the device (stages joined by commas; the table is session 4's 4.9 GB NVFP4 one):
#   bash benchmarks/h200_native.sh build,tests        # compile in place (gcc), GPU tests
#   bash benchmarks/h200_native.sh table,lookup,probe # lookup bench (native vs :native=off, read
#                                                     # ms = the host's bound), parts probe
#   CACHES=warm bash benchmarks/h200_native.sh e2e    # e2e, each tier beside :native=off
# REPS (default 5), CACHES (default warm,cold), BATCHES (default 1,8,64) go to e2e.
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
stages=",$1,"
t=bench-work/t
if [[ $stages == *,build,* ]]; then  # the copy's .so (if any) is this machine's Python's? rebuild
  rm -f src/plestore/native/_core*.so
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  python3 -c "from plestore import native; assert native.available(), 'not built'; print('native ok')" \
    || { tail -20 "$OUT/build.log"; exit 1; }
fi
if [[ $stages == *,tests,* ]]; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider \
    ${TESTS:-tests/test_native.py tests/test_tiers.py tests/test_staged.py} 2>&1 | tail -25 > "$OUT/gpu_tests.txt"
  cat "$OUT/gpu_tests.txt"
fi
if [[ $stages == *,table,* ]]; then bash benchmarks/h200_session4.sh table; fi
if [[ $stages == *,lookup,* ]]; then
  m=plestore-device,plestore-pinned,plestore-mapped,plestore-direct
  m=$m,plestore-pinned:native=off,plestore-mapped:native=off,plestore-direct:native=off
  timeout ${LOOKUP_TIMEOUT:-420} python3 -m plestore bench lookup $t --methods $m --dists uniform \
    --workloads decode-b1,decode-b8,decode-b64,prefill-4096 --cold decode-b1,prefill-4096 \
    --json --csv "$OUT/bench-lookup.csv" --plot '' > "$OUT/lookup.json" 2> "$OUT/lookup.log"
  tail -32 "$OUT/lookup.log"
fi
if [[ $stages == *,probe,* ]]; then
  timeout 300 python3 benchmarks/probe_native_parts.py bench-work --table $t \
    --json "$OUT/native-parts.json" > "$OUT/native-parts.log" 2>&1
  tail -5 "$OUT/native-parts.log"
fi
if [[ $stages == *,e2e,* ]]; then
  timeout ${E2E_TIMEOUT:-540} python3 -m plestore bench e2e $t --json --csv "$OUT/bench-e2e.csv" \
    --tiers ${TIERS:-device,pinned,mapped,direct,pinned:native=off,mapped:native=off,direct:native=off} \
    --batches ${BATCHES:-1,8,64} --e2e-reps ${REPS:-5} --caches ${CACHES:-warm,cold} \
    > "$OUT/e2e.json" 2> "$OUT/e2e.log"
  tail -30 "$OUT/e2e.log"
fi
