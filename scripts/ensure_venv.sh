#!/usr/bin/env bash
# Source me: make sure .venv (next to this repo's top) has the package installed; set PYTHON to its python.
# Usage: source scripts/ensure_venv.sh [extra]     e.g. "dev" for the test tools.
# LBT_SKIP_SETUP=1 fails instead of installing; an explicit PYTHON is used as it is.
_lbt_top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_lbt_extra="${1:-}"
if [[ -z "${PYTHON:-}" ]]; then
  _lbt_probe="import low_bits_training, torchtitan, tomli_w"
  [[ "$_lbt_extra" == "dev" ]] && _lbt_probe="$_lbt_probe, pytest, hypothesis, ml_dtypes"
  if [[ ! -x "$_lbt_top/.venv/bin/python" ]] || ! "$_lbt_top/.venv/bin/python" -c "$_lbt_probe" 2>/dev/null; then
    if [[ "${LBT_SKIP_SETUP:-0}" == "1" ]]; then
      echo "low-bits-training: .venv is not set up and LBT_SKIP_SETUP=1; run: python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'" >&2
      return 1 2>/dev/null || exit 1
    fi
    echo "low-bits-training: setting up .venv (pip install -e .${_lbt_extra:+[$_lbt_extra]}; torch is a large wheel)" >&2
    [[ -x "$_lbt_top/.venv/bin/python" ]] || python3 -m venv "$_lbt_top/.venv"
    "$_lbt_top/.venv/bin/pip" install --quiet --upgrade pip
    "$_lbt_top/.venv/bin/pip" install --quiet -e "$_lbt_top${_lbt_extra:+[$_lbt_extra]}"
  fi
  PYTHON="$_lbt_top/.venv/bin/python"
fi
export PYTHON
