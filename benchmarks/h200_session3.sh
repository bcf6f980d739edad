#!/bin/bash
# The third session's H200 run (2026-11-29): GPU tests at HEAD, then e2e and decode lookups on
# a 4.9 GB NVFP4 table with 512-B blocks. Usage on the device: bash benchmarks/h200_session3.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -3 > "$OUT/gpu_tests.txt"
cat "$OUT/gpu_tests.txt"
mkdir -p bench-work
python3 -m plestore synth bench-work/ck --preset qwen3.8-flash-next --format nvfp4 \
  --ngram-vocab-size-base 3000000 --no-progress --json > /dev/null
python3 -m plestore pack bench-work/ck bench-work/t --block-bytes 512 --no-progress --json > /dev/null
rm -rf bench-work/ck
timeout 200 python3 -m plestore bench e2e bench-work/t --json --csv "$OUT/bench.csv" \
  --e2e-reps 3 --decode-steps 24 > "$OUT/e2e.json" 2> "$OUT/e2e.log"
tail -22 "$OUT/e2e.log"
timeout 140 python3 -m plestore bench lookup bench-work/t --json --csv "$OUT/bench.csv" --plot '' \
  --methods plestore-device,plestore-pinned,plestore-mapped,plestore-direct \
  --workloads decode-b1,decode-b8,decode-b64,prefill-4096 --dists uniform --cold decode-b1,decode-b64 \
  --reps 30 > "$OUT/lookup.json" 2> "$OUT/lookup.log"
tail -25 "$OUT/lookup.log"
