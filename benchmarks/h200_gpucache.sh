#!/bin/bash
# The GPU row cache and cascade runs on the H200 (#22). Carry textstreams/ (built here by
# benchmarks/make_textstreams.sh, ~12 MB, ignored by git). Usage on the device:
#   bash benchmarks/h200_gpucache.sh tests            # GPU tests of the cache, cascade, staged (~2 min)
#   bash benchmarks/h200_gpucache.sh table,profile    # the 4.9 GB NVFP4 table + its hot rows (~3 min)
#   SIZES=1G bash benchmarks/h200_gpucache.sh e2e     # e2e, every host tier +/- a 1 GiB cache (~6 min)
#   SIZES=4G bash benchmarks/h200_gpucache.sh e2e     # the same with 4 GiB
#   SIZES=176M,704M bash benchmarks/h200_gpucache.sh e2e   # 1 / 4 GiB scaled to this table's
#                                                     # share of the full one (4.6 / 26.8 GiB)
#   bash benchmarks/h200_gpucache.sh full,cascade     # full-size table; cascade 8G/8G/direct (~9 min)
# REPS (default 3), BATCHES (default 1,8,64), TIERS (default device,pinned,mapped,direct).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
stages=",$1,"
t=bench-work/t
if [[ $stages == *,tests,* ]]; then
  python3 -m pytest tests/test_gpucache.py tests/test_text.py tests/test_staged.py -q 2>&1 | tail -5
fi
if [[ $stages == *,table,* ]]; then
  bash benchmarks/h200_session4.sh table
fi
if [[ $stages == *,profile,* ]]; then
  python3 -m plestore profile $t --text textstreams/en --json | tee "$OUT/profile.json"
fi
if [[ $stages == *,e2e,* ]]; then
  tag=${SIZES//,/-}
  timeout ${E2E_TIMEOUT:-580} python3 -m plestore bench e2e $t --json --csv '' \
    --tiers ${TIERS:-device,pinned,mapped,direct} --gpu-caches ${SIZES:-1G} \
    --text textstreams/en --e2e-reps ${REPS:-3} --batches ${BATCHES:-1,8,64} \
    > "$OUT/e2e-gc$tag.json" 2> "$OUT/e2e-gc$tag.log"
  tail -40 "$OUT/e2e-gc$tag.log"
fi
if [[ $stages == *,full,* ]]; then
  python3 -m plestore bench pack --format nvfp4 --block-bytes 512 --workdir pack_full_work \
    --keep --no-progress --json > "$OUT/pack-full.json"
  rm -rf pack_full_work/checkpoint  # (64 GiB disk: the table stays, its source goes)
fi
if [[ $stages == *,cascade,* ]]; then
  python3 benchmarks/cascade_full.py pack_full_work/tables --device-budget 8G \
    --pinned-budget 8G --gpu-cache 1G --text textstreams/en --lookups 32 | tee "$OUT/cascade.txt"
  python3 benchmarks/cascade_full.py pack_full_work/tables --text textstreams/en --lookups 8 \
    | tee -a "$OUT/cascade.txt"  # budgets from free memory: the whole table fits the H200
fi
