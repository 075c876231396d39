#!/usr/bin/env bash
# The test command: bash tools/run_tests.sh [pytest args...]
#
# 1. creates (or reuses) a virtual environment, $VENV (default: .venv here),
#    with the pinned torch (`python -m torch_patches manifest --get base_version`),
#    expecttest, pytest, numpy (tools/requirements-test.txt);
# 2. installs this project into it (pip install .);
# 3. applies the series to the venv's torch with the user-facing command
#    `python -m torch_patches apply --python $VENV/bin/python`
#    (a torch patched with an older series is switched to this one);
# 4. runs pytest over test/ with any extra arguments (pytest args that name
#    test paths, e.g. test/tools, replace the default test/).
#
# Environment: VENV (venv path), PYTHON (interpreter that creates the venv,
# default python3), PIP_FIND_LINKS etc. are passed to pip as usual. pip runs
# with PIP_CONFIG_FILE=/dev/null so a machine-wide constraint that caps torch
# below the pinned release does not apply.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
export PIP_CONFIG_FILE=/dev/null
unset PIP_CONSTRAINT || true
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { printf '\n==> %s\n' "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  step "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

installed_torch() {
  "$PY" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    pass
PY
}

# The pinned base, read from the shipped series' manifest.ini (the CLI is stdlib-only).
BASE_VERSION="$(PYTHONPATH="$REPO" "$PY" -m torch_patches manifest --get base_version)"
have="$(installed_torch)"
if [[ "$have" == "$BASE_VERSION" ]]; then
  step "reusing $VENV (torch $have)"
elif [[ -n "$have" ]]; then
  step "torch $have in $VENV is not the base $BASE_VERSION; reinstalling"
  "$PY" -m pip install --force-reinstall --no-deps "torch==$BASE_VERSION"
else
  step "installing torch==$BASE_VERSION into $VENV"
  "$PY" -m pip install "torch==$BASE_VERSION"
fi
step "installing test requirements (tools/requirements-test.txt)"
"$PY" -m pip install -r tools/requirements-test.txt

step "installing torch_patches into $VENV"
"$PY" -m pip install --no-deps --force-reinstall --no-build-isolation . \
  || "$PY" -m pip install --no-deps --force-reinstall .

step "applying the series: python -m torch_patches apply --python $PY"
(cd / && "$PY" -m torch_patches apply --python "$PY")
(cd / && "$PY" -m torch_patches status --python "$PY")

# --- torchtitan consumer (test/consumers/torchtitan/) ---------------------------------
# The pinned torchtitan release, without its dependencies (they would pull datasets,
# wandb, ... and must never replace torch), then the consumer series applied to it.
TT_SERIES="$REPO/consumers/torchtitan/0.3.0"
step "installing torchtitan==0.3.0 and spmd_types==0.2.3 (--no-deps); applying $TT_SERIES"
"$PY" -m pip install --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
(cd / && PYTHONPATH="$REPO" "$PY" -m torch_patches torchtitan apply --series "$TT_SERIES" --python "$PY")
# --- end torchtitan consumer ---------------------------------------------------------

# Default to test/; if the arguments name test paths themselves, run just those.
targets=(test/)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then targets=(); break; fi
done
step "pytest ${targets[*]:-} $*"
# Run from the repo so the tests import the checkout's torch_patches.
exec "$PY" -m pytest "${targets[@]}" "$@"
