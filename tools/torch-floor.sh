#!/usr/bin/env bash
# Runs the CPU tests that cover eager calls, torch.compile, the docs' examples and the template
# on the oldest torch the distributions declare (`torch>=X.Y` in tileops-core's pyproject), so
# that the floor is a version the tests have passed on, not a guess. CI runs it beside the
# suite on the locked torch.
#
# The environment is a fresh one (removed afterwards): the workspace's distributions installed
# editable, torch X.Y.* from the package index with the libraries it asks for, and every other
# package at the version uv.lock pins, so that torch is the only difference from `uv run pytest`.
#
# Usage: tools/torch-floor.sh [pytest arguments]   (default: the subset below)
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/.*"torch>=\([0-9][0-9.]*\)".*/\1/p' packages/tileops-core/pyproject.toml)
[ -n "$floor" ] || { echo "tools/torch-floor.sh: no torch>=X.Y in packages/tileops-core/pyproject.toml" >&2; exit 2; }
# Eager calls (every op, every workload, against the manifest's reference), torch.compile (with
# the eager-versus-compiled property test), the docs' examples, the template's own tests, and a
# compiled transformers model's attention (torch before 2.14 makes transformers build a mask).
subset=(tests/test_norm_ops.py tests/test_compile.py tests/test_docs.py packages/tileops-acme-template/tests
        tests/test_transformers_integration.py::test_under_torch_compile_the_attention_of_a_call_without_padding_runs_on_the_op_not_sdpa)
[ "$#" -gt 0 ] && subset=("$@")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The lock's pins, less torch and what torch pins or bounds itself (its CUDA libraries, triton,
# setuptools, sympy): the floor's torch brings its own versions of those.
uv export --frozen --quiet --no-hashes --no-emit-workspace --all-groups \
    | grep -Ev '^(torch|triton|nvidia-|cuda-|setuptools|sympy)' > "$work/constraints.txt"
uv venv --quiet --python "$(uv python find)" "$work/venv"
python="$work/venv/bin/python"
uv pip install --quiet --python "$python" --constraint "$work/constraints.txt" "torch==$floor.*" \
    -e packages/tileops-core -e packages/tileops-ops -e packages/tileops-kernels-cuda \
    -e packages/tileops-acme-template -e . pytest hypothesis transformers
"$python" - "$floor" <<'CHECK'
import sys, torch
print(f"torch {torch.__version__} (the declared floor: torch>={sys.argv[1]})")
if not torch.__version__.startswith(sys.argv[1] + "."):
    sys.exit(f"tools/torch-floor.sh: the environment got torch {torch.__version__}, not the floor {sys.argv[1]}")
CHECK
PYTHONSAFEPATH=1 "$python" -m pytest -q -p no:cacheprovider "${subset[@]}"
