#!/usr/bin/env bash
# Run the whole test suite on CPU (sets up .venv with the [dev] extra on first use).
#   ./run_tests.sh                 # everything
#   ./run_tests.sh tests/formats   # a part; any pytest arguments pass through
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/ensure_venv.sh dev
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "$PYTHON" -m pytest "$@"
