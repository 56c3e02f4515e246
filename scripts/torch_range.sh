#!/usr/bin/env bash
# The pure layers (formats, numerics, nn, optim, speed) on another torch: a throwaway venv per version with
# that torch and the test tools only (no torchtitan, no torchao), then those layers' fast-tier unit tests.
#   scripts/torch_range.sh 2.13.0             # one version (any that pip can install here)
#   scripts/torch_range.sh 2.11.0 2.12.1      # several; one summary line each at the end
# Tests that import torchtitan or torchao (which the pinned stack needs) are counted apart as "needs the
# pinned stack", not as failures. Then level 1 of the GPU check (scripts/gpu_check.sh --levels 1) on that torch. Results of a run are recorded in docs/speed_model.md ("torch range").
# Not part of CI: a second torch is GBs and minutes. LBT_RANGE_DIR keeps the venvs (default: a temp dir).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -ge 1 ]] || { echo "usage: scripts/torch_range.sh TORCH_VERSION [...]" >&2; exit 2; }
root="${LBT_RANGE_DIR:-$(mktemp -d -t lbt-torch-range-XXXXXX)}"
layers=(tests/formats tests/numerics tests/nn tests/optim tests/speed)
summary=()
for v in "$@"; do
  venv="$root/torch-$v"
  echo "== torch $v: $venv" >&2
  if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv" || exit 1
    "$venv/bin/pip" install --quiet "torch==$v" numpy ml_dtypes hypothesis pytest tomli-w rich \
      || { summary+=("torch $v: could not be installed here"); continue; }
  fi
  log="$root/torch-$v.log"
  # The fast tier of those layers (tests/conftest.py works without torchtitan / torchao: no CPU adapters).
  (cd "$here" && COLUMNS=1000 PYTHONPATH="$here" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$venv/bin/python" -m pytest \
    -m "not slow" -q -p no:cacheprovider --continue-on-collection-errors "${layers[@]}" >"$log" 2>&1)
  # Failures and collection errors whose report names torchtitan / torchao as missing need the pinned stack
  # (not installed here on purpose); the others are this torch's (listed).
  classified=$("$venv/bin/python" - "$log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
sections = re.split(r"\n_{3,} (.+?) _{3,}\n", text)  # [head, title, body, title, body, ...]
body = {t.replace("ERROR collecting ", ""): b for t, b in zip(sections[1::2], sections[2::2])}
pinned = re.compile(r"No module named '(torchtitan|torchao)'")
needs, others = 0, []
for test, rest in re.findall(r"^(?:FAILED|ERROR) (\S+)(.*)$", text, re.M):
    name = test.split("::")[-1]
    hit = pinned.search(rest) or any(pinned.search(b) for t, b in body.items() if t in (test, name))
    needs += bool(hit)
    others += [] if hit else [f"    {test}{rest[:200]}"]
print(needs, len(others))
print("\n".join(others))
PY
)
  read -r needs other <<<"$(head -n 1 <<<"$classified")"
  others=$(tail -n +2 <<<"$classified")
  # Level 1 of the GPU check on the same torch (its CPU-capable items here; every item on a GPU node)
  check="$root/gpu_check-$v"
  PYTHON="$venv/bin/python" TMPDIR="$root" "$here/scripts/gpu_check.sh" --levels 1 --out "$check" \
    >"$check.log" 2>&1
  level1="exit $?, $(grep -m 1 '^rows:' "$check/gpu_check.md" 2>/dev/null || echo 'no table')"
  summary+=("torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): $(tail -n 1 "$log")"
            "  of which need torchtitan / torchao (the pinned stack): $needs; others: $other (among:)"
            "$others" "  log: $log" "  GPU check level 1: $level1 ($check/gpu_check.md)")
done
printf '%s\n' "${summary[@]}"
