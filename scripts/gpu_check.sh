#!/usr/bin/env bash
# The GPU check in one command: what of this package runs on this GPU, level by level, in at most
# --budget-s seconds (default 480: 8 minutes on one H100 from cold; docs/speed_model.md, "The GPU check").
#   scripts/gpu_check.sh --dry-run [--wheelhouse DIR]  # levels, budgets, what it needs and would install
#   scripts/gpu_check.sh [--wheelhouse DIR]            # run; table + JSON in outputs/gpu_check
# --wheelhouse DIR (scripts/build_wheelhouse.sh made it): the wheels this Python lacks are installed with
# pip --no-index --no-deps into a temporary folder on PYTHONPATH; the node's torch is never touched.
# Compiled kernels are cached per user and stack (${XDG_CACHE_HOME:-~/.cache}/low_bits_training/inductor-*),
# so a second run skips compilation. Python: $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then PYTHON="$here/.venv/bin/python"; else PYTHON="python3"; fi
fi
exec "$PYTHON" "$here/scripts/gpu_check.py" "$@"
