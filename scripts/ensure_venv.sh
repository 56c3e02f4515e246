#!/usr/bin/env bash
# Source me: make sure .venv (next to this repo's top) has the package installed; set PYTHON to its python.
# Usage: source scripts/ensure_venv.sh EXTRA     EXTRA: "dev" for the test tools, "" for none (always give it:
#   sourced without arguments, the script would see its caller's).
# LBT_SKIP_SETUP=1 fails instead of installing; an explicit PYTHON is used as it is.
# LBT_TORCH=keep: set .venv up around the torch the node already has (a build for its driver's CUDA) instead of
#   the registry's torch==2.14.1 (a CUDA 13 build: driver >= 580): the venv sees the node's site-packages, the
#   package goes in without its dependencies, then every other dependency of pyproject.toml under a pip
#   constraint that pins torch to the node's version (kept in .venv/torch-constraint.txt for later installs);
#   refused in one line (exit 2) for a torch older than the pin (scripts/keep_torch.py). It acts when .venv is
#   set up: remove a .venv made without it first.
# LBT_SETUP_DRY_RUN=1 bash scripts/ensure_venv.sh [extra]: print the set-up commands, run and write nothing
#   (run_llama_train.sh, run_tests.sh and submit.sh then exit 0)
#   (with LBT_TORCH=keep, the node's python3 is judged as the venv would see it).
_lbt_top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_lbt_extra="${1:-}"
# A script that sources this file without arguments hands it its own ($1 = "--training.steps"): callers pass
# the extra explicitly ("" for none), and anything but a pip extra's name is refused here, not by pip.
if [[ -n "$_lbt_extra" && ! "$_lbt_extra" =~ ^[a-z][a-z0-9_-]*$ ]]; then
  echo "low-bits-training: config error: ensure_venv.sh extra = '$_lbt_extra': expected a pip extra of pyproject.toml (e.g. dev) or \"\" (source it as: source scripts/ensure_venv.sh \"\")" >&2
  return 2 2>/dev/null || exit 2
fi
_lbt_dry="${LBT_SETUP_DRY_RUN:-0}"

# A set-up command, or (dry run) its line.
_lbt_run() {
  if [[ "$_lbt_dry" == "1" ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# LBT_TORCH=keep: the node's torch stays; pip may not replace it (see the top).
_lbt_keep_torch() {
  local venv="$_lbt_top/.venv" py="$_lbt_top/.venv/bin/python" judge="$_lbt_top/.venv/bin/python" plan
  _lbt_run python3 -m venv --system-site-packages "$venv" || return 1
  [[ "$_lbt_dry" == "1" ]] && judge=python3  # no venv yet: the interpreter it would be made from
  plan="$("$judge" "$_lbt_top/scripts/keep_torch.py" "$_lbt_top/pyproject.toml" ${_lbt_extra:+"$_lbt_extra"})" \
    || return 2
  local pin="${plan%%$'\n'*}"
  local -a reqs
  mapfile -t reqs < <(tail -n +2 <<<"$plan")
  if [[ "$_lbt_dry" == "1" ]]; then
    echo "# $venv/torch-constraint.txt: $pin"
  else
    echo "$pin" >"$venv/torch-constraint.txt"
  fi
  _lbt_run "$py" -m pip install --quiet --upgrade pip || return 1
  _lbt_run "$py" -m pip install --quiet --no-deps -e "$_lbt_top" || return 1
  _lbt_run "$py" -m pip install --quiet -c "$venv/torch-constraint.txt" "${reqs[@]}" || return 1
}

# The default: the pinned stack from the registry, torch included.
_lbt_pinned_torch() {
  [[ -x "$_lbt_top/.venv/bin/python" ]] || _lbt_run python3 -m venv "$_lbt_top/.venv"
  _lbt_run "$_lbt_top/.venv/bin/pip" install --quiet --upgrade pip
  _lbt_run "$_lbt_top/.venv/bin/pip" install --quiet -e "$_lbt_top${_lbt_extra:+[$_lbt_extra]}"
}

if [[ -n "${LBT_TORCH:-}" && "${LBT_TORCH}" != "keep" ]]; then
  echo "low-bits-training: config error: LBT_TORCH = '$LBT_TORCH': expected 'keep' (the node's torch) or unset (torch==2.14.1 from the registry)" >&2
  return 2 2>/dev/null || exit 2
fi
if [[ -z "${PYTHON:-}" || "$_lbt_dry" == "1" ]]; then
  _lbt_probe="import low_bits_training, torchtitan, tomli_w"
  [[ "$_lbt_extra" == "dev" ]] && _lbt_probe="$_lbt_probe, pytest, hypothesis, ml_dtypes"
  if [[ "$_lbt_dry" == "1" ]] || [[ ! -x "$_lbt_top/.venv/bin/python" ]] \
      || ! "$_lbt_top/.venv/bin/python" -c "$_lbt_probe" 2>/dev/null; then
    if [[ "${LBT_SKIP_SETUP:-0}" == "1" ]]; then
      echo "low-bits-training: .venv is not set up and LBT_SKIP_SETUP=1; run: python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'" >&2
      return 1 2>/dev/null || exit 1
    fi
    echo "low-bits-training: setting up .venv (pip install -e .${_lbt_extra:+[$_lbt_extra]}${LBT_TORCH:+, LBT_TORCH=$LBT_TORCH}; torch is a large wheel)" >&2
    if [[ "${LBT_TORCH:-}" == "keep" ]]; then
      _lbt_keep_torch || { _lbt_rc=$?; return "$_lbt_rc" 2>/dev/null || exit "$_lbt_rc"; }
    else
      _lbt_pinned_torch
    fi
  fi
  [[ "$_lbt_dry" == "1" ]] && { return 0 2>/dev/null || exit 0; }
  PYTHON="$_lbt_top/.venv/bin/python"
fi
export PYTHON
