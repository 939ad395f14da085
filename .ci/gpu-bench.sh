#!/usr/bin/env bash
# The benchmarks on a lent H200 machine (the GPU kit installed and the Triton cache restored by
# .ci/gpu.sh's environment below). Two modes:
#   warm  fill the autotune cache for the production shapes: one bench_kernels.py process per shape
#         (TP 1 and 2 head shards, 16k tokens), side by side over the GPUs. Run beside the tests
#         (LINATTN_GPU_WITH=".ci/gpu-bench.sh warm" .ci/gpu.sh ...), so the timed call compiles little.
#   run   the kernel table, the layer table (TP/CP 1 and 2) and the breakdown; JSON, PNG plots and
#         logs in $OUT/bench.tgz; each stage within its own time limit (LINATTN_BENCH_LIMITS).
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
  R=/tmp/linattn-bench; mkdir -p "$R"
  read -r k l b <<< "${LINATTN_BENCH_LIMITS:-150 260 110}"
  timeout -k 20 "$k" python3 $B/bench_kernels.py --tp 1,2 --tokens 4k,16k,64k --json "$R/kernels.json" --plot "$R" 2>&1 | tee "$R/kernels.log"
  timeout -k 20 "$l" python3 $B/bench_layers.py --tokens 4k,16k,64k --tp 1,2 --cp 1,2 --json "$R/layers.json" --plot "$R" 2>&1 | tee "$R/layers.log"
  timeout -k 20 "$b" python3 $B/bench_breakdown.py --json "$R/breakdown.json" 2>&1 | tee "$R/breakdown.log"
  tar -czf "$OUT/bench.tgz" -C "$R" . ;;
*) echo "usage: .ci/gpu-bench.sh warm|run" >&2; exit 2 ;;
esac
