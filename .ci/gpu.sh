#!/usr/bin/env bash
# One call on a lent H200 machine (see ../shared/gpu/README.md): install the GPU kit's wheels
# (.whl/, carried), then rerun the given GPU test files through linattn-rerun, logs under $OUT.
#   usage: .ci/gpu.sh suites/gpu-1/test_x.py suites/gpu-2/test_y.py ...
set -uo pipefail
OUT=${OUT:-reports/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
# The project runs from the checkout; PYTEST_PLUGINS loads the plugin without an install.
export PYTHONPATH=/tmp/site:$PWD PYTEST_PLUGINS=pytest_linattn PYTHONUNBUFFERED=1
# Triton compile + autotune dominates a fresh machine (minutes per test file). Keep compiled
# kernels and autotune results in one cache dir, seeded from a carried .triton-cache.tgz (the
# previous call's $OUT/triton-cache.tgz, copied to the repo root and named in carry).
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tgz ] && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpus.txt"
python3 -m pytest_linattn.rerun --out "$OUT" "$@" 2>&1 | tee "$OUT/rerun.log"
rc=${PIPESTATUS[0]}
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
cat "$OUT/summary.md"
exit "$rc"
