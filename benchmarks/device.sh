#!/bin/bash
# The GPU machine's harness: run the named stages in order, each writing its files to $OUT.
#
#   bash benchmarks/device.sh STAGE [STAGE ...]
#
# Stages:
#   gpu-tests      pytest -m gpu (TESTS="tests/test_x.py ..." to select)  -> gpu_tests.txt
#   table          synthesise + pack the e2e/lookup table into bench-work/t (NVFP4,
#                  48,000,768 rows, 4.9 GB, 512-B blocks); later stages build it when missing
#   demo           plestore demo on the GPU                                 -> demo.txt
#   e2e            bench e2e, warm caches                           -> e2e-warm.json (and .png)
#   e2e-cold       bench e2e, cold caches, the disk's bound beside it      -> e2e-cold.json
#   lookup         bench lookup, every method (the other engines' beside plestore's tiers;
#                  METHODS=... to choose), decode b1 / b8 / b64 and prefill-4096, warm and cold
#                  (decode-b1, decode-b64, prefill-4096), uniform ids, the machine's limits and
#                  floors beside them (TIMEOUT default 540 here)   -> lookup.json, lookup.png
#   lookup-native  plestore's tiers at those sizes, each host tier beside its numpy reference
#                  host core (:native=off), with the tier's read alone (`read ms`: the host's bound)
#                                                                           -> lookup-native.json
#   shared         bench shared: 2 processes on the GPU, private pinned copies vs the node's
#                  one copy (host memory by PSS, lookup time), batch 64 and 1024 -> shared-bN.json
#   profile        the table's hot rows from half of textstreams/en's documents (carry
#                  textstreams/, built by benchmarks/make_textstreams.sh), for its GPU row
#                  cache; e2e's --text-split 0.5 serves the other half      -> profile.json
#   table-full     the full-size table (synth + pack into pack_full_work, ~57 GB of disk while
#                  packing; 26.8 GiB kept); TABLE=full points every table stage at it
#   cascade-full   the full-size table on the cascade: 8G device / 8G pinned / direct, then the
#                  budgets from free memory; exact rows and hit rates    -> cascade-full.txt
#   transformers   bench transformers for each of MODELS (default "gemma3n-e2b qwen4exp"; Qwen4Exp
#                  on a table of QWEN_BASE, default 1,000,000: 16,001,920 rows) with TF_ARGS
#                                                   -> transformers-MODEL-VERSION.json
#   two-gpus       nvidia-h200-x2: benchmarks/two_gpus.py — TP2 e2e (mapped / direct beside their
#                  rows-sharded variants), an Engram table head-sharded (bit-identical to one
#                  GPU), DP2 replicas sharing one pinned copy  -> tp2-e2e.json, engram-heads.json,
#                  dp2-shared.json
#   vllm           bench vllm: a decode step's PLE lookup as vLLM runs it through the plugin, per
#                  tier, one graph or eager breaks, beside the device tier, b1 to b256; plain,
#                  busy main thread, after idle woken / unwoken (VLLM_ARGS: extra arguments,
#                  e.g. --batches 128,256)                                  -> vllm-step.json
#   engram         bench vllm on DeepSeek-V4.1's two Engram layers (a table of ENGRAM_BASE,
#                  default 400,000: ~9.6 M rows a layer, synthesised + packed into
#                  bench-work/engram-step), b1 / b8 / b64, warm and cold (ENGRAM_ARGS: extra
#                  arguments)                                             -> vllm-engram.json
#   hoststep       bench hoststep: the host step alone per host tier at 16 / 128 / 1,024 / 4,096
#                  rows, beside the DRAM bound measured in the same run      -> hoststep.json
#   sglang         bench sglang: the pinned and file backends of SGLang beside the plestore tiers,
#                  decode b1 / b8 / b64 and prefill-4096 warm and cold, host memory after a long
#                  decode (SGLANG_ARGS: extra arguments, e.g. --budget 1G)   -> sglang.json
#   probe-NAME     benchmarks/probes/NAME.py (TABLE first where it takes one; PROBE_ARGS after)
#                  -> probe-NAME.txt; see benchmarks/probes/README.md
# Logs (stderr) go beside them as NAME.log; `bench` stages append their rows to bench.csv.
#
# Environment: SRC_TREE (another checkout's root, e.g. an older commit's `git archive` carried in
# an ignored folder: every stage then runs that code, its native core built there — for a
# before/after comparison in one lease), LOOKUP_COLD (the lookup stage's cold workloads, '' for
# none), E2E_ARGS (extra `bench e2e` arguments; its defaults on a GPU: hidden 6144 x 4
# layers, 512-token prompts in 128-token chunks, 32 decode steps, 5 interleaved reps; a tier
# with table options beside the default, e.g. --tiers pinned,pinned:gather=cpu), METHODS
# (`bench lookup --methods`), TIMEOUT (seconds per stage, default 300),
# PLESTORE_COMMIT (the commit to record, for a copy whose git metadata is stale), TF_WHEEL (a
# transformers wheel carried along: every stage then runs under it, e.g. the tests of both
# versions).
# The native host core (src/plestore/native) is compiled in place first, for this machine's
# Python (native-build.log); if that fails the stages run on the numpy reference host core, as announced.
# E2E_ARGS="--tiers device,pinned,mapped,direct,mapped:native=off,direct:native=off" puts the
# numpy reference host core beside the compiled one in e2e; E2E_ARGS="--gpu-caches 1G --text
# textstreams/en --text-split 0.5" each host tier behind a GPU row cache, on the documents the
# profile stage did not see.
# The device returns a limited number of files: run few stages per call.
set -u
cd "$(dirname "$0")/.."
src_tree=${SRC_TREE:-$PWD}
export PYTHONPATH=$src_tree/src PYTHONUNBUFFERED=1
t=bench-work/t
full=pack_full_work/tables  # the full-size table (320,001,536 rows, NVFP4, 26.8 GiB)
[[ ${TABLE:-} == full ]] && t=$full
tmo=${TIMEOUT:-300}
probes_with_table="first_divergence h2d_staging sync_paths"

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

table() {
  [[ $t == "$full" ]] && { full_table; return; }
  [[ -f $t/.built ]] && return
  mkdir -p bench-work
  python3 -m plestore synth bench-work/ck --preset qwen3.8-flash-next --format nvfp4 \
    --ngram-vocab-size-base 3000000 --no-progress --json > /dev/null || return 1
  python3 -m plestore pack bench-work/ck $t --block-bytes 512 --no-progress --json > /dev/null \
    || return 1
  rm -rf bench-work/ck && touch $t/.built
}

engram_table() {  # DeepSeek-V4.1's two Engram layers, scaled by ENGRAM_BASE
  local dir=bench-work/engram-step
  [[ -f $dir/.built ]] && return
  python3 -m plestore synth bench-work/engram-ck --preset deepseek-v4.1-flash --force \
    --ngram-vocab-size-base "${ENGRAM_BASE:-400000}" --no-progress --json > /dev/null \
    && python3 -m plestore pack bench-work/engram-ck $dir --no-progress --json > /dev/null \
    && rm -rf bench-work/engram-ck && touch $dir/.built
}

full_table() {  # synth + one pack: ~2 min, ~57 GB of disk while packing, 26.8 GiB kept
  [[ -f $full/.built ]] && return
  local ck=pack_full_work/checkpoint
  timeout "$tmo" python3 -m plestore synth $ck --preset qwen3.8-flash-next --format nvfp4 \
    --ngram-vocab-size-base 20000000 --force --no-progress --json > "$OUT/synth-full.json" \
    && timeout "$tmo" python3 -m plestore pack $ck $full --block-bytes 512 --no-progress --json \
      > "$OUT/pack-full.json" && rm -rf $ck && touch $full/.built
}

native_build() {  # the copy's extension (if any) is this machine's? build it for this Python
  [[ -n ${native_checked:-} ]] && return
  native_checked=1
  local check="import plestore.native as n, sys; sys.exit(not n.available())"
  python3 -c "$check" 2> /dev/null && return
  (cd "$src_tree" && python3 setup.py build_ext --inplace) > "$OUT/native-build.log" 2>&1
  python3 -c "$check" 2> /dev/null \
    || echo "native host core not built (native-build.log): the numpy reference host core runs" >&2
}

tf_wheel() {  # TF_WHEEL: install it beside the copy (no registry here) and put it first
  [[ -z ${TF_WHEEL:-} ]] && return
  local dir=bench-work/tf-$(basename "$TF_WHEEL" .whl)
  [[ -d $dir ]] || python3 -m pip install -q --no-deps --target "$dir" "$TF_WHEEL" || return 1
  export PYTHONPATH=$PWD/$dir:$PYTHONPATH
}

transformers_bench() {
  local v m args
  v=$(python3 -c "import transformers; print(transformers.__version__)") || return 1
  for m in ${MODELS:-gemma3n-e2b qwen4exp}; do
    args=(--model "$m")
    [[ $m == qwen4exp ]] && args+=(--ngram-vocab-size-base "${QWEN_BASE:-1000000}")
    # shellcheck disable=SC2086  # TF_ARGS is a list of arguments
    timeout "$tmo" python3 -m plestore bench transformers "${args[@]}" ${TF_ARGS:-} --json \
      --out "$OUT/transformers-$m-$v.json" > /dev/null 2> "$OUT/transformers-$m-$v.log"
    grep -v "^\[transformers\]" "$OUT/transformers-$m-$v.log" | tail -16
  done
}

e2e() {  # caches
  table || return 1
  # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments
  timeout "$tmo" python3 -m plestore bench e2e $t --json --csv "$OUT/bench.csv" --caches "$1" \
    --e2e-plot "$OUT/e2e-$1.png" ${E2E_ARGS:-} > "$OUT/e2e-$1.json" 2> "$OUT/e2e-$1.log"
  tail -22 "$OUT/e2e-$1.log"
}

run_stage() {
  [[ $1 == probe-* ]] || native_build
  case $1 in
    gpu-tests)
      # shellcheck disable=SC2086  # TESTS is a list of paths
      timeout "$tmo" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-} 2>&1 \
        | tail -25 > "$OUT/gpu_tests.txt"
      cat "$OUT/gpu_tests.txt" ;;
    table) table ;;
    table-full) full_table ;;
    transformers) transformers_bench ;;
    two-gpus)
      table || return 1
      [[ -f bench-work/engram/.built ]] || {
        python3 -m plestore synth bench-work/eck --preset deepseek-v4.1-flash --no-progress \
          --json > /dev/null && python3 -m plestore pack bench-work/eck bench-work/engram \
          --no-progress --json > /dev/null && rm -rf bench-work/eck \
          && touch bench-work/engram/.built
      } || return 1
      NCCL_NVLS_ENABLE=0 timeout "$tmo" python3 benchmarks/two_gpus.py $t \
        bench-work/engram/engram.layers.1.json "$OUT" 2> "$OUT/two-gpus.log" \
        | tee "$OUT/two-gpus.txt" | tail -40 ;;
    demo)
      timeout "$tmo" python3 -m plestore demo --dir bench-work/demo 2> "$OUT/demo.log" \
        | tail -12 > "$OUT/demo.txt"
      cat "$OUT/demo.txt" ;;
    e2e) e2e warm ;;
    e2e-cold) e2e cold ;;
    lookup)
      table || return 1
      timeout "${TIMEOUT:-540}" python3 -m plestore bench lookup $t --json --reps 30 \
        ${METHODS:+--methods "$METHODS"} --workloads decode-b1,decode-b8,decode-b64,prefill-4096 \
        --dists uniform --cold "${LOOKUP_COLD-decode-b1,decode-b64,prefill-4096}" \
        --csv "$OUT/bench.csv" \
        --plot "$OUT/lookup.png" > "$OUT/lookup.json" 2> "$OUT/lookup.log"
      tail -46 "$OUT/lookup.log" ;;
    lookup-native)
      table || return 1
      local m=plestore-device,plestore-pinned,plestore-mapped,plestore-direct
      m=$m,plestore-pinned:native=off,plestore-mapped:native=off,plestore-direct:native=off
      timeout "$tmo" python3 -m plestore bench lookup $t --json --csv "$OUT/bench.csv" --plot '' \
        --methods $m --workloads decode-b1,decode-b8,decode-b64,prefill-4096 --dists uniform \
        --cold decode-b1,prefill-4096 --reps 30 > "$OUT/lookup-native.json" \
        2> "$OUT/lookup-native.log"
      tail -32 "$OUT/lookup-native.log" ;;
    profile)
      table || return 1
      python3 -m plestore profile $t --text textstreams/en --split 0.5 --json \
        > "$OUT/profile.json"
      cat "$OUT/profile.json" ;;
    cascade-full)
      full_table || return 1
      timeout "$tmo" python3 benchmarks/cascade_full.py $full --device-budget 8G \
        --pinned-budget 8G --gpu-cache 1G --text textstreams/en --lookups 32 \
        > "$OUT/cascade-full.txt" 2> "$OUT/cascade-full.log"
      timeout "$tmo" python3 benchmarks/cascade_full.py $full \
        --text textstreams/en --lookups 8 >> "$OUT/cascade-full.txt" 2>> "$OUT/cascade-full.log"
      cat "$OUT/cascade-full.txt" ;;
    shared)
      table || return 1
      local b
      for b in 64 1024; do
        PLESTORE_SHM_DIR=/dev/shm/plestore-bench timeout "$tmo" python3 -m plestore bench shared \
          $t --procs 2 --device cuda --batch $b --reps 300 --rounds 2 --json \
          > "$OUT/shared-b$b.json" 2>> "$OUT/shared.log"
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('batch', sys.argv[2], \
          {k: r[k] for k in ('rows_exact', 'lookup_ratio')}, {m: (round(r[m]['copies'], 3), \
          r[m]['lookup_p50_s']) for m in ('private', 'shared')})" "$OUT/shared-b$b.json" $b
      done ;;
    vllm)
      table || return 1
      # shellcheck disable=SC2086  # VLLM_ARGS is a list of arguments
      timeout "$tmo" python3 -m plestore bench vllm $t/ple.layers.1.json --json ${VLLM_ARGS:-} \
        --csv "$OUT/bench.csv" > "$OUT/vllm-step.json" 2> "$OUT/vllm-step.log"
      cat "$OUT/vllm-step.log" ;;
    engram)
      engram_table || return 1
      # shellcheck disable=SC2086  # ENGRAM_ARGS is a list of arguments
      timeout "$tmo" python3 -m plestore bench vllm bench-work/engram-step --json \
        --batches 1,8,64 ${ENGRAM_ARGS:-} --csv "$OUT/bench.csv" > "$OUT/vllm-engram.json" \
        2> "$OUT/vllm-engram.log"
      cat "$OUT/vllm-engram.log" ;;
    hoststep)
      table || return 1
      # shellcheck disable=SC2086  # HOSTSTEP_ARGS is a list of arguments
      timeout "$tmo" python3 -m plestore bench hoststep $t/ple.layers.1.json --json \
        ${HOSTSTEP_ARGS:-} > "$OUT/hoststep.json" 2> "$OUT/hoststep.log"
      cat "$OUT/hoststep.log" ;;
    sglang)
      table || return 1
      # shellcheck disable=SC2086  # SGLANG_ARGS is a list of arguments
      timeout "${TIMEOUT:-540}" python3 -m plestore bench sglang $t --json ${SGLANG_ARGS:-} \
        > "$OUT/sglang.json" 2> "$OUT/sglang.log"
      tail -30 "$OUT/sglang.log" ;;
    probe-*)
      local name=${1#probe-} args=()
      [[ -f benchmarks/probes/$name.py ]] || { echo "no benchmarks/probes/$name.py" >&2; return 2; }
      native_build
      if [[ " $probes_with_table " == *" $name "* ]]; then table || return 1; args=("$t"); fi
      # shellcheck disable=SC2086  # PROBE_ARGS is a list of arguments
      timeout "$tmo" python3 "benchmarks/probes/$name.py" "${args[@]}" ${PROBE_ARGS:-} \
        > "$OUT/probe-$name.txt" 2> "$OUT/probe-$name.log"
      cat "$OUT/probe-$name.txt" ;;
    *) echo "unknown stage $1 (bash benchmarks/device.sh --help)" >&2; return 2 ;;
  esac
}

if [[ $# -eq 0 || $1 == -h || $1 == --help ]]; then usage; exit 0; fi
: "${OUT:?set OUT to the folder the results go to}"
for stage in "$@"; do  # check every name before running any
  case $stage in
    gpu-tests | table | table-full | demo | e2e | e2e-cold | lookup | lookup-native | shared | profile) ;;
    cascade-full | transformers | two-gpus | vllm | engram | hoststep | sglang | probe-*) ;;
    *) echo "unknown stage $stage (bash benchmarks/device.sh --help)" >&2; exit 2 ;;
  esac
done
tf_wheel || { echo "TF_WHEEL $TF_WHEEL not installed" >&2; exit 1; }
rc=0
for stage in "$@"; do
  echo "=== $stage"
  run_stage "$stage" || { echo "=== $stage failed" >&2; rc=1; }
done
exit $rc
