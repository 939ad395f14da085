#!/usr/bin/env bash
# One call on a lent H200 machine (see ../shared/gpu/README.md): install the GPU kit's wheels
# (.whl/, carried), then rerun the given GPU test files through linattn-rerun, one run per home
# suite, the suites side by side (gpu-1 on the first GPU; gpu-2 and gpu-4 lease theirs through the
# plugin). On a machine with fewer GPUs than a suite needs, its ranks share them
# (`linattn-rerun --ranks-per-gpu auto`: the staged transport, not NCCL; gpu-2 and gpu-4 on one
# GPU then take turns, each pool leasing the GPU whole).
#   usage: .ci/gpu.sh suites/gpu-1/test_x.py suites/gpu-2/test_y.py ...
#   env:   LINATTN_GPU_LIMIT   seconds the whole call may take (default 600, the device's limit
#          per command), counted from LINATTN_GPU_START (epoch seconds, default now: export it to
#          chain two runs of this script under one deadline). The tests get what is left after
#          the set-up less LINATTN_GPU_RESERVE (default 90 s: the logs and the cache save), then
#          they are interrupted (SIGTERM: linattn-rerun summarises what finished) and the cache is
#          saved. LINATTN_GPU_BUDGET (seconds) caps the tests' share further.
#          LINATTN_GPU_WITH    a command run beside the tests in the same environment (e.g.
#          ".ci/gpu-bench.sh warm"), waited for before the cache is saved.
#          With no files, only that command runs (".ci/gpu-bench.sh run": the benchmarks).
# Writes to $OUT: summary.md (every suite's), logs.tgz (pytest output, JUnit XML, the machine),
# and, where a search ran (LINATTN_GPU_WITH: benchmarks, .ci/gpu-autotune.sh dump) or
# LINATTN_SAVE_CACHE=1 asks, triton-cache.txz.* (the next call's cache: copy them into
# .triton-cache/ and carry that folder; LINATTN_SAVE_CACHE=0 skips it; LINATTN_RESTORE_CACHE=0
# ignores a carried one).
# The tests need no carried cache: they search no configs (--linattn-autotune shipped, the
# plugin's default: the configs in pytest_linattn/fla_configs/, else each kernel's first config),
# so a fresh machine only compiles one config per kernel (gpu-1: 76-77 s of tests on a fresh
# machine, in four processes grouped by the kernels they compile; docs/results.md). The benchmarks still search (they time the fastest
# config), and there the cache still saves minutes.
set -uo pipefail
START=${LINATTN_GPU_START:-$(date +%s)}
OUT=${OUT:-reports/gpu}
LOGS=/tmp/linattn-logs
rm -rf "$LOGS"  # a warm machine keeps the last call's: its summaries would print as this one's
mkdir -p "$OUT" "$LOGS"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
# The project runs from the checkout; PYTEST_PLUGINS loads the plugin without an install.
export PYTHONPATH=/tmp/site:$PWD PYTEST_PLUGINS=pytest_linattn PYTHONUNBUFFERED=1
# Compiled kernels and autotune results live in one cache dir, seeded from the previous call's
# parts (if carried). Tests only compile; a search (benchmarks) compiles and times every config.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ "${LINATTN_RESTORE_CACHE:-1}" = 1 ] && [ -z "$(ls -A "$TRITON_CACHE_DIR")" ] \
    && compgen -G ".triton-cache/triton-cache.txz*" >/dev/null; then
  cat .triton-cache/triton-cache.txz* \
    | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    | tar -xf - -C "$TRITON_CACHE_DIR" \
    && echo "triton cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) restored"
fi
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$LOGS/machine.txt"
BUDGET=$(( START + ${LINATTN_GPU_LIMIT:-600} - $(date +%s) - ${LINATTN_GPU_RESERVE:-90} ))
[ -n "${LINATTN_GPU_BUDGET:-}" ] && [ "$LINATTN_GPU_BUDGET" -lt "$BUDGET" ] && BUDGET=$LINATTN_GPU_BUDGET
echo "budget: $BUDGET s for the tests and the command beside them"

with_pid=""
if [ -n "${LINATTN_GPU_WITH:-}" ]; then
  timeout -k 20 "$BUDGET" bash -c "$LINATTN_GPU_WITH" > "$LOGS/with.log" 2>&1 & with_pid=$!
fi
# On a machine with fewer GPUs than gpu-4's ranks, every suite's ranks share GPUs already (the
# staged transport); each suite then leases them through its own lock folder, so gpu-2's and
# gpu-4's pools run side by side instead of taking turns (their compiles are most of their time).
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# Suites side by side share the cores: each pytest divides its own share among its processes
# (pytest_linattn.ranks.pool.thread_share honours OMP_NUM_THREADS), so give each suite about
# nproc / (suites * 4) threads a process. Three suites at torch's default (every process all 16
# cores) ran gpu-2's CP ops test in 208.6 s and gpu-1's fla GDN reference case in 204 s; alone,
# 48.4 s and 35.5 s; with 1 thread a process every GPU file took 179 s in one call, gpu-2's CP ops
# 23.3 s (2026-12-06, H100, docs/results.md). OMP_NUM_THREADS given by the caller wins.
declare -A files_of=()  # empty when only LINATTN_GPU_WITH runs (set -u counts an unset array as unbound)
for f in "$@"; do suite=$(basename "$(dirname "$f")"); files_of[$suite]+="$f "; done
suites_here=${#files_of[@]}
if [ -z "${OMP_NUM_THREADS:-}" ] && [ "$suites_here" -gt 1 ]; then
  cores=$(nproc)  # before OMP_NUM_THREADS is set: nproc honours it
  per=$(( cores / (suites_here * 4) )); [ "$per" -lt 1 ] && per=1
  export OMP_NUM_THREADS=$per
  echo "threads: $OMP_NUM_THREADS a process ($suites_here suites side by side on $cores cores)"
fi
pids=()
for suite in "${!files_of[@]}"; do
  visible=""; [ "$suite" = gpu-1 ] && visible=0
  # shellcheck disable=SC2086  # the file list splits on purpose
  ( [ -n "$visible" ] && export CUDA_VISIBLE_DEVICES=$visible
    [ "$GPUS" -lt 4 ] && export PYTEST_LINATTN_LOCK_DIR=/tmp/linattn-gpu-locks-$suite
    export LINATTN_COMPILE_LOG=$LOGS/$suite/compile  # the summary's per-file compile seconds
    timeout -s TERM -k 30 "$BUDGET" python3 -m pytest_linattn.rerun --ranks-per-gpu auto --out "$LOGS/$suite" ${files_of[$suite]} \
      > "$LOGS/$suite.log" 2>&1 ) &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
[ -n "$with_pid" ] && { wait "$with_pid" || rc=1; }
cat "$LOGS"/*/summary.md > "$OUT/summary.md" 2>/dev/null
tail -n 25 "$LOGS"/gpu-*.log 2>/dev/null; [ -n "$with_pid" ] && tail -n 80 "$LOGS/with.log"
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
# Only what a cache hit reads (metadata JSON, the autotune results, the best configs' cubins): the
# IR files and the autotune losers are most of the bytes. xz then shrinks it about 4x (gzip 2x),
# so the cache fits the carry limit; 32 MiB blocks let xz use every core.
SAVE_DEFAULT=0; [ -n "${LINATTN_GPU_WITH:-}" ] && SAVE_DEFAULT=1  # only a search fills it with what pays
if [ "${LINATTN_SAVE_CACHE:-$SAVE_DEFAULT}" = 1 ]; then
  find "$TRITON_CACHE_DIR" -type f \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
    -o -name '*.source' \) -delete
  python3 .ci/prune-triton-cache.py "$TRITON_CACHE_DIR" "$LOGS"/*/compile  # keeps what the tests loaded
  tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -9 --block-size=32MiB | split -b 15M - "$OUT/triton-cache.txz."
  du -ch "$OUT"/triton-cache.txz.* | tail -1
fi
cat "$OUT/summary.md" 2>/dev/null
exit "$rc"
