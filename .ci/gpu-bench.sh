#!/usr/bin/env bash
# The benchmarks on a lent H200 machine (the GPU kit installed and the Triton cache restored by
# .ci/gpu.sh's environment below). Two modes:
#   warm  fill the autotune cache for the production shapes: one bench_kernels.py process per shape
#         (TP 1 and 2 head shards, 16k tokens), side by side over the GPUs. Run beside the tests
#         (LINATTN_GPU_WITH=".ci/gpu-bench.sh warm" .ci/gpu.sh ...), so the timed call compiles little.
#   run   the layer table (TP/CP 1 and 2), the breakdown and the kernel table; JSON and logs in
#         $OUT/bench.tgz (plots, anywhere: python suites/bench/_common.py plot JSON... --out DIR).
set -uo pipefail
OUT=${OUT:-reports/gpu}
B=suites/bench
case "${1:-}" in
warm)
  LOGS=/tmp/linattn-logs/warm; mkdir -p "$LOGS"; i=0
  gpus=$(nvidia-smi -L | wc -l)
  for shape in kimi-k3 glm-5.3-flash qwen3-next; do
    CUDA_VISIBLE_DEVICES=$((i++ % gpus)) python3 $B/bench_kernels.py --shapes "$shape" --tp 1,2 --tokens 16k \
      --iters 1 --warmup 1 > "$LOGS/$shape.log" 2>&1 &
  done
  wait
  tail -n 3 "$LOGS"/*.log ;;
run)
  # One stage per table, most wanted first, each within its limit (seconds) so a slow stage
  # (a shape whose kernels are not in the cache autotunes in its warm-up) cannot starve the rest.
  R=/tmp/linattn-bench; mkdir -p "$R"
  stage() {  # name limit script args...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit} s): $*"
    timeout -k 15 "$limit" python3 "$B/$@" --json "$R/$name.json" > "$R/$name.log" 2>&1; echo "rc=$?" >> "$R/$name.log"
    cat "$R/$name.log"
  }
  stage layers_tp1 110 bench_layers.py --tp 1 --cp 1 --tokens 4k,16k,64k
  stage breakdown 75 bench_breakdown.py --tokens 16k,64k
  stage kernels 80 bench_kernels.py --tp 1 --tokens 4k,16k,64k
  stage layers_cp2 70 bench_layers.py --tp 1 --cp 2 --tokens 16k
  stage layers_tp2 70 bench_layers.py --tp 2 --cp 1 --tokens 16k --shapes qwen3-next
  tar -czf "$OUT/bench.tgz" -C "$R" . ;;
*) echo "usage: .ci/gpu-bench.sh warm|run" >&2; exit 2 ;;
esac
