#!/usr/bin/env bash
# The test command: bash tools/run_tests.sh [pytest args...]
#
# 1. creates (or reuses) a virtual environment, $VENV (default: .venv here);
# 2. installs the pinned torch (`python -m torch_patches manifest --get base_version`)
#    from the base wheel `python -m torch_patches wheel` caches ($TORCH_PATCHES_CACHE,
#    default ~/.cache/torch_patches; `python -m torch_patches fetch` downloads it there
#    if it is missing), then expecttest, pytest, numpy, ruff, mypy (tools/requirements-test.txt);
# 3. installs this project into it (pip install .);
# 4. applies the series to the venv's torch with the user-facing command
#    `python -m torch_patches apply --python $VENV/bin/python`
#    (a torch patched with an older series is switched to this one);
# 5. runs pytest over test/ with any extra arguments (pytest args that name
#    test paths, e.g. test/tools, replace the default test/).
#
# Environment: VENV (venv path), PYTHON (interpreter that creates the venv,
# default python3). pip runs with your pip configuration (pip.conf, PIP_INDEX_URL,
# PIP_FIND_LINKS, ...). When that configuration blocks the pinned torch (a
# constraint file capping torch), the script stops and names the override:
#   PIP_CONSTRAINT=/dev/null bash tools/run_tests.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
SELF="bash tools/run_tests.sh"

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

# pip install ARGS for torch; when it fails because a constraint caps torch, say so and stop.
pip_torch() {
  local log status=0
  log="$(mktemp)"
  "$PY" -m pip install "$@" 2>&1 | tee "$log" || status=$?
  if [[ $status -ne 0 ]]; then
    local cap files
    cap="$(grep -o '(constraint) torch[^ ]*' "$log" | head -n 1 | cut -d' ' -f2 || true)"
    rm -f "$log"
    if [[ -n "$cap" ]]; then
      files="$("$PY" -m pip config list 2>/dev/null | grep -E '^[a-z]+\.constraint=' | cut -d= -f2- \
        | tr -d "'\"" | sort -u | paste -sd, - | sed 's/,/, /g' || true)"
      [[ -n "${PIP_CONSTRAINT:-}" ]] && files="${files:+$files, }$PIP_CONSTRAINT (PIP_CONSTRAINT)"
      printf '\nrun_tests.sh: error: pip'"'"'s configuration blocks torch==%s: the constraint %s%s.\n' \
        "$BASE_VERSION" "$cap" "${files:+ from $files}" >&2
      printf 'Lift it for this command with PIP_CONSTRAINT=/dev/null (pip'"'"'s variable replaces the configured\nconstraint files): `PIP_CONSTRAINT=/dev/null %s`\n' "$SELF" >&2
    fi
    exit 1
  fi
  rm -f "$log"
}

# The base wheel, from the cache `python -m torch_patches wheel` fills (downloaded there if missing).
base_wheel() {
  step "base wheel: python -m torch_patches fetch --python $PY (cache: \$TORCH_PATCHES_CACHE or ~/.cache/torch_patches)" >&2
  PYTHONPATH="$REPO" "$PY" -m torch_patches fetch --python "$PY" --as-command "$SELF" || exit 1
}

# The pinned base, read from the shipped series' manifest.ini (the CLI is stdlib-only).
BASE_VERSION="$(PYTHONPATH="$REPO" "$PY" -m torch_patches manifest --get base_version)"
have="$(installed_torch)"
LABEL="$(PYTHONPATH="$REPO" "$PY" -m torch_patches manifest --get local_label)"
# A build of the base (2.15.0, 2.15.0+cpu), not a patched wheel (2.15.0+cu132.fsdp.N: apply refuses those).
if [[ -n "$have" && "${have%%+*}" == "$BASE_VERSION" && ! "$have" =~ (\+|\.)$LABEL\.[0-9]+$ ]]; then
  step "reusing $VENV (torch $have)"
elif [[ -n "$have" ]]; then
  step "torch $have in $VENV is not the base $BASE_VERSION; reinstalling"
  wheel="$(base_wheel)"
  pip_torch --force-reinstall --no-deps "$wheel"
else
  wheel="$(base_wheel)"
  step "installing torch==$BASE_VERSION into $VENV from $wheel (with its dependencies)"
  pip_torch "$wheel"
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
