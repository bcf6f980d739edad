#!/bin/bash
# The fourth session's H200 runs (2026-11-30). Usage on the device:
#   bash benchmarks/h200_session4.sh tests,table,probe   # GPU tests, build the table, size the decoder
#   bash benchmarks/h200_session4.sh table,e2e HxL        # e2e with hidden H, L layers
#   (E2E_EXTRA=--staged-lookup: decode rows staged and decoded inside the captured step)
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
stages=",$1,"
t=bench-work/t
if [[ $stages == *,tests,* ]]; then
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -x ${TESTS:-} 2>&1 | tail -15 > "$OUT/gpu_tests.txt"
  cat "$OUT/gpu_tests.txt"
fi
if [[ $stages == *,table,* ]]; then
  mkdir -p bench-work
  python3 -m plestore synth bench-work/ck --preset qwen3.8-flash-next --format nvfp4 \
    --ngram-vocab-size-base 3000000 --no-progress --json > /dev/null
  python3 -m plestore pack bench-work/ck $t --block-bytes 512 --no-progress --json > /dev/null
  rm -rf bench-work/ck
fi
if [[ $stages == *,probe,* ]]; then
  timeout 200 python3 benchmarks/probe_decode_graphs.py $t > "$OUT/probe-graphs.jsonl" 2> "$OUT/probe-graphs.log"
  cat "$OUT/probe-graphs.jsonl"; tail -5 "$OUT/probe-graphs.log"
fi
if [[ $stages == *,e2e,* ]]; then
  h=${2%x*}; l=${2#*x}
  timeout ${E2E_TIMEOUT:-420} python3 -m plestore bench e2e $t --json --csv "$OUT/bench.csv" \
    --hidden-size $h --layers $l --e2e-reps ${REPS:-5} ${E2E_EXTRA:-} > "$OUT/e2e.json" 2> "$OUT/e2e.log"
  tail -24 "$OUT/e2e.log"
fi
if [[ $stages == *,diverge,* ]]; then
  for v in "--sdpa default" "--sdpa math" "--sdpa efficient" "--sdpa cudnn" "--sdpa default --eager-decode"; do
    timeout 60 python3 benchmarks/probe_first_divergence.py $t $v 2>&1 | tail -1
  done | tee "$OUT/diverge.jsonl"
fi
