#!/usr/bin/env bash
# Runs the GPU tier (pytest -m gpu) on a CUDA machine where the workspace is not installed:
# the packages are put on PYTHONPATH from source and tilelang comes from /tmp/site (see
# ../shared/tools/device-tilelang.sh for getting it there). Logs go to $OUT (or ./gpu-tier-out).
#
# Usage: tools/gpu-tier.sh [extra pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-tier-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:)
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "$(nproc)")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# Tests that allocate GiBs run after the others, one at a time: beside a worker per core
# sharing the GPU they could run out of memory.
python3 -m pytest -m "gpu and not large_memory" "${workers[@]}" -p no:cacheprovider -q -rfE "$@" 2>&1 | tee "$out/gpu-tier.log" | tail -40
parallel=${PIPESTATUS[0]}
python3 -m pytest -m "gpu and large_memory" -p no:cacheprovider -q -rfE "$@" 2>&1 | tee -a "$out/gpu-tier.log" | tail -20
serial=${PIPESTATUS[0]}
# pytest's 5 (nothing selected) is not a failure when the arguments select only one group.
[ "$parallel" = 5 ] && [ "$serial" != 5 ] && parallel=0
[ "$serial" = 5 ] && [ "$parallel" != 5 ] && serial=0
exit $(( parallel > serial ? parallel : serial ))
