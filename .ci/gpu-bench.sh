#!/usr/bin/env bash
# The benchmarks on a lent H200 machine (the GPU kit installed and the Triton cache restored by
# .ci/gpu.sh's environment below). Two modes:
#   warm  fill the Triton cache (compile + autotune) for every kernel the tables call: the layer
#         table's rows, one iteration each, one world of 2 (or 4) ranks per shape side by side,
#         each with its own GPU-lock dir so they neither wait for each other nor for the tests beside them
#         (LINATTN_GPU_WITH=".ci/gpu-bench.sh warm" .ci/gpu.sh ...); the kernel table beside them.
#         The breakdown calls the layer's kernels on the layer's shapes. Configs picked while the
#         GPUs are shared may not be the fastest; the timed call then measures those.
#   run   the breakdown (GPU 0) beside the kernel table (GPU 1), then the layer table (TP/CP 1, 2
#         and, on four GPUs, 4); JSON and logs in $OUT/bench/ (plots, anywhere:
#         python suites/bench/plot.py JSON... --out DIR). LINATTN_BENCH_STAGES="layers
#         kernels" runs those stages one after another instead, nothing beside them; "vs_fla" is the
#         project's layers beside fla's (bench_vs_fla.py), run only when named.
set -uo pipefail
OUT=${OUT:-reports/gpu}
B=suites/bench
TOKENS=4k,16k,64k
# TP and CP sizes up to the machine's GPUs (2 on nvidia-h200-x2; 4 adds the TP/CP = 4 rows)
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -ge 4 ]; then SIZES=1,2,4 WORLD=4; else SIZES=1,2 WORLD=2; fi
case "${1:-}" in
warm)
  LOGS=/tmp/linattn-logs/warm; mkdir -p "$LOGS"
  for shape in qwen3-next glm-5.3-flash kimi-k3; do
    PYTEST_LINATTN_LOCK_DIR=/tmp/warm-locks-$shape python3 $B/bench_layers.py --shapes "$shape" --tp $SIZES --cp $SIZES \
      --world $WORLD --tokens $TOKENS --iters 1 --warmup 0 --no-check > "$LOGS/$shape.log" 2>&1 &
  done
  CUDA_VISIBLE_DEVICES=1 python3 $B/bench_kernels.py --tp 1 --tokens $TOKENS --iters 1 --warmup 0 \
    > "$LOGS/kernels.log" 2>&1 &
  wait
  tail -n 12 "$LOGS"/*.log ;;
run)
  # The breakdown (GPU 0) beside the kernel table (GPU 1), then the layer table on both GPUs;
  # shapes in the order their figures are wanted (LINATTN_LAYER_SHAPES: the layer table's). Each
  # stage has a limit (seconds) and writes its JSON after every row straight into $OUT/bench, so a
  # run cut short keeps what it measured.
  R=$OUT/bench; mkdir -p "$R"
  stage() {  # name limit script args...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit} s): $*" > "$R/$name.log"
    timeout -k 15 "$limit" python3 "$B/$@" --json "$R/$name.json" >> "$R/$name.log" 2>&1; echo "rc=$?" >> "$R/$name.log"
  }
  # LINATTN_BENCH_STAGES picks the stages, in order ("layers kernels": one at a time, nothing beside).
  # LINATTN_BENCH_AUTOTUNE: the scripts' --autotune (default search; first: no search, for a
  # fresh machine without a carried cache).
  AT="--autotune ${LINATTN_BENCH_AUTOTUNE:-search}"
  breakdown() { stage breakdown "${LINATTN_BREAKDOWN_LIMIT:-200}" bench_breakdown.py \
    --shapes qwen3-next,kimi-k3,glm-5.3-flash --tokens 16k,64k $AT; }
  vs_fla() { stage vs_fla "${LINATTN_VS_FLA_LIMIT:-300}" bench_vs_fla.py \
    --shapes glm-5.3-flash,kimi-k3,qwen3-next --tokens $TOKENS $AT; }
  kernels() { stage kernels "${LINATTN_KERNELS_LIMIT:-200}" bench_kernels.py --tp 1 --tokens $TOKENS --iters 100 $AT; }
  layers() { stage layers "${LINATTN_LAYERS_LIMIT:-300}" bench_layers.py --shapes "${LINATTN_LAYER_SHAPES:-qwen3-next,glm-5.3-flash,kimi-k3}" \
    --tp $SIZES --cp $SIZES --world $WORLD --tokens $TOKENS $AT; }
  if [ -n "${LINATTN_BENCH_STAGES:-}" ]; then
    for s in $LINATTN_BENCH_STAGES; do
      case $s in
        layers) layers ;;
        breakdown|kernels|vs_fla) CUDA_VISIBLE_DEVICES=0 "$s" ;;
        *) echo "LINATTN_BENCH_STAGES: unknown stage '$s' (breakdown, kernels, layers, vs_fla)" >&2; exit 2 ;;
      esac
    done
  else
    CUDA_VISIBLE_DEVICES=0 breakdown & CUDA_VISIBLE_DEVICES=1 kernels & wait
    layers
  fi
  tail -n 40 "$R"/*.log ;;
*) echo "usage: .ci/gpu-bench.sh warm|run" >&2; exit 2 ;;
esac
