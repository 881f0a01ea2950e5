#!/usr/bin/env bash
# Runs the GPU tier (pytest -m gpu) on a CUDA machine: in the workspace's environment (`uv run`,
# after `uv sync`) by default. Logs go to $OUT (or ./gpu-tier-out).
#
# Usage: tools/gpu-tier.sh [--site DIR] [extra pytest arguments]
#   --site DIR  run with the python3 on PATH instead, the workspace's packages from source
#               (PYTHONPATH) and the other packages (torch, tilelang, pytest) from the site
#               directory DIR, as on a machine where the workspace cannot be installed.
set -uo pipefail
cd "$(dirname "$0")/.."
python=(uv run --frozen python)
if [ "${1:-}" = "--site" ]; then
    [ -d "${2:-}" ] || { echo "tools/gpu-tier.sh: --site needs a directory, got '${2:-}'" >&2; exit 2; }
    export PYTHONPATH=$(cd "$2" && pwd):$(ls -d "$PWD"/packages/*/src | paste -sd:)
    python=(python3)
    shift 2
fi
out=${OUT:-gpu-tier-out}
mkdir -p "$out"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
workers=()
"${python[@]}" -c "import xdist" 2>/dev/null && workers=(-n "$(nproc)")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# Tests that allocate GiBs run after the others, one at a time: beside a worker per core
# sharing the GPU they could run out of memory.
"${python[@]}" -m pytest -m "gpu and not large_memory" "${workers[@]}" -p no:cacheprovider -q -rfE "$@" 2>&1 | tee "$out/gpu-tier.log" | tail -40
parallel=${PIPESTATUS[0]}
"${python[@]}" -m pytest -m "gpu and large_memory" -p no:cacheprovider -q -rfE "$@" 2>&1 | tee -a "$out/gpu-tier.log" | tail -20
serial=${PIPESTATUS[0]}
# pytest's 5 (nothing selected) is not a failure when the arguments select only one group.
[ "$parallel" = 5 ] && [ "$serial" != 5 ] && parallel=0
[ "$serial" = 5 ] && [ "$parallel" != 5 ] && serial=0
exit $(( parallel > serial ? parallel : serial ))
