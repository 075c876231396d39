#!/usr/bin/env bash
# Default parity: bash tools/parity/run.sh [runner args: -k PATTERN, --list, ...]
# Generated programs: bash tools/parity/run.sh gen [generate.py args: --set ci, --oracle a|b, --seed, ...]
#
# The PATCHED torch is $VENV's (default: .venv of this checkout, as
# tools/run_tests.sh creates it: torch 2.15.0 with the series applied). The
# PRISTINE torch is ${VENV}-pristine, made (or refreshed) here as a hard-linked
# copy of $VENV (cp -al) with the series reverted by
# `python -m torch_patches revert`; revert and apply replace files by rename,
# so the copy never changes $VENV's files.
#
# Environment: VENV; PARITY_PRISTINE_PYTHON / PARITY_PATCHED_PYTHON use
# existing interpreters instead (no copy is made then).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
VENV="${VENV:-$REPO/.venv}"
PATCHED="${PARITY_PATCHED_PYTHON:-$VENV/bin/python}"

for arg in "$@"; do
  if [[ "$arg" == "--list" ]]; then
    exec "$PATCHED" tools/parity/runner.py --pristine-python "$PATCHED" --patched-python "$PATCHED" "$@"
  fi
done

if [[ -n "${PARITY_PRISTINE_PYTHON:-}" ]]; then
  PRISTINE="$PARITY_PRISTINE_PYTHON"
else
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "parity: no $VENV/bin/python; run tools/run_tests.sh first or set VENV" >&2
    exit 2
  fi
  COPY="${VENV%/}-pristine"
  echo "==> refreshing the pristine copy $COPY (cp -al $VENV, then revert the series)" >&2
  rm -rf "$COPY"
  cp -al "$VENV" "$COPY"
  PRISTINE="$COPY/bin/python"
  PYTHONPATH="$REPO" "$PRISTINE" -m torch_patches revert --python "$PRISTINE" >&2
fi

for py in "$PRISTINE" "$PATCHED"; do
  n="$(PYTHONPATH="$REPO" "$py" -m torch_patches status --python "$py" | grep -c '^  applied' || true)"
  echo "==> $py: $n patches of the series applied" >&2
done
export PARITY_COMMAND="bash tools/parity/run.sh${*:+ $*}"
if [[ "${1:-}" == "gen" ]]; then
  shift
  exec "$PATCHED" tools/parity/generate.py --pristine-python "$PRISTINE" --patched-python "$PATCHED" "$@"
fi
exec "$PATCHED" tools/parity/runner.py --pristine-python "$PRISTINE" --patched-python "$PATCHED" "$@"
