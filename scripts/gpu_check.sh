#!/usr/bin/env bash
# The GPU check in one command: what of this package runs on this GPU, level by level (docs/speed_model.md).
#   scripts/gpu_check.sh --dry-run          # list what it would run; no GPU needed
#   scripts/gpu_check.sh                    # run every level this machine can (0 GPU tests, 1 torch,
#                                           #   2 torchao, 3 torchtitan); table + JSON in outputs/gpu_check
# Python: $PYTHON, else .venv/bin/python, else python3 (a plain torch install is enough for levels 0-1).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then PYTHON="$here/.venv/bin/python"; else PYTHON="python3"; fi
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d -t gpu-check-inductor-XXXXXX)}"
exec "$PYTHON" "$here/scripts/gpu_check.py" "$@"
