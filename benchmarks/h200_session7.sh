#!/bin/bash
# The seventh session's H200 runs (2026-12-01). Usage on the device:
#   bash benchmarks/h200_session7.sh table,probe-disk   # the table (session 4's), then
#     benchmarks/probe_disk_latency.py (run 1 ran probe_poll.py here, at 69c3951: cold block
#     reads waited for asleep vs polling; polling was not kept)
#   bash benchmarks/h200_session7.sh probe-get   # benchmarks/probe_cache_get.py
#   TESTS=... bash benchmarks/h200_session7.sh tests     # GPU tests (session 5's stage)
#   CACHES=cold bash benchmarks/h200_session7.sh e2e   # session 6's stage (run 1: VARIANTS=
#     "base no-poll", at 69c3951)
#   bash benchmarks/h200_session7.sh demo                # session 6's stage
set -u
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
stages=",$1,"
t=bench-work/t
if [[ $stages == *,table,* ]]; then bash benchmarks/h200_session5.sh table; fi
if [[ $stages == *,probe-disk,* ]]; then
  timeout 120 python3 benchmarks/probe_disk_latency.py $t > "$OUT/probe-disk.json" 2>&1
  cat "$OUT/probe-disk.json"
fi
if [[ $stages == *,probe-get,* ]]; then
  timeout 120 python3 benchmarks/probe_cache_get.py > "$OUT/probe-get.json" 2>&1
  cat "$OUT/probe-get.json"
fi
rest=$(tr , '\n' <<< "$1" | grep -xE 'tests|e2e|demo' | paste -sd,)
if [[ -n $rest ]]; then bash benchmarks/h200_session6.sh "$rest"; fi
