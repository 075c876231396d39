#!/usr/bin/env bash
# All benchmarks in one command: bash tools/bench/run_all.sh
#
# 1. makes three virtual environments with the project's own tooling:
#      $BENCH_VENVS/pristine  the pinned torch as released
#      $BENCH_VENVS/patched   the same, then `python -m torch_patches apply --python .../bin/python`
#      $BENCH_VENVS/rev2      the same with revision 2 of the series (taken from the project's
#                             history, commit $BENCH_REV2_COMMIT) applied: the "before" of
#                             benchmark 1c (torch only; skipped when the commit is not in the clone)
#    each with torchtitan==0.3.0 (+ tyro, spmd_types==0.2.3), matplotlib, wheel and
#    (for the composition tests' numbers) pytest, expecttest, numpy;
#    existing venvs are reused (pristine is reverted if something patched it, and the
#    torchtitan consumer series is reverted in both: method b is torchtitan as released;
#    the last benchmark, torchtitan_chunked.py, applies it to the patched venv again);
# 2. runs every script in tools/bench, each writing its JSON result file (commit,
#    torch and tool versions, machine load) into $BENCH_OUT;
# 3. renders every table of the README's Benchmarks section from those files
#    (python tools/bench/render.py: the marked block is rewritten; same files,
#    same bytes) and the plots next to the files.
#
# Environment:
#   BENCH_VENVS  where the venvs live (default ~/.cache/torch_patches/bench)
#   BENCH_OUT    results directory (default tools/bench/results; with BENCH_QUICK,
#                ${TMPDIR:-/tmp}/torch_patches-bench-quick, rendered to
#                $BENCH_OUT/benchmarks.md instead of the README)
#   PYTHON       interpreter that creates the venvs (default python3)
#   BENCH_CLONE_FROM=VENV  optimisation fallback only: create a missing venv
#                with `cp -al VENV` (hard links; a venv that has the pinned torch)
#                instead of `python -m venv` + `pip install torch==<pinned>`.
#                Safe because `torch_patches apply/revert` replace files by
#                rename and never write through a link.
#   BENCH_REV2_COMMIT  the commit whose torch_patches/patches/<base> is revision 2
#                (default afe6a0b, the last one before revision 3)
#   BENCH_QUICK=1  tiny sizes (what the smoke test uses), for a dry run
# pip runs with PIP_CONFIG_FILE=/dev/null (a machine-wide cap on torch does
# not apply); PIP_FIND_LINKS and PIP_INDEX_URL are passed through.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
BENCH_VENVS="${BENCH_VENVS:-$HOME/.cache/torch_patches/bench}"
if [[ -n "${BENCH_QUICK:-}" ]]; then
  BENCH_OUT="${BENCH_OUT:-${TMPDIR:-/tmp}/torch_patches-bench-quick}"
else
  BENCH_OUT="${BENCH_OUT:-$REPO/tools/bench/results}"
fi
PYTHON="${PYTHON:-python3}"
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_CONSTRAINT || true
# The pinned release, from the shipped series' manifest.ini (the CLI is stdlib-only)
BASE_VERSION="$(PYTHONPATH="$REPO" "$PYTHON" -m torch_patches manifest --get base_version)"
BENCH_REQS=(torchtitan==0.3.0 tyro spmd_types==0.2.3 matplotlib wheel pytest expecttest numpy)

step() { printf '\n==> %s\n' "$*"; }

torch_version() {
  "$1" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

make_venv() {  # make_venv DIR [torch-only]
  local v="$1"
  if [[ "$(torch_version "$v/bin/python")" != "$BASE_VERSION" ]]; then
    rm -rf "$v"
    if [[ -n "${BENCH_CLONE_FROM:-}" ]]; then
      step "creating $v by cp -al $BENCH_CLONE_FROM (optimisation fallback)"
      cp -al "$BENCH_CLONE_FROM" "$v"
    else
      step "creating $v: python -m venv + pip install torch==$BASE_VERSION"
      "$PYTHON" -m venv "$v"
      "$v/bin/python" -m pip install -q "torch==$BASE_VERSION"
    fi
  fi
  if [[ -z "${2:-}" ]] && ! "$v/bin/python" -c 'import torchtitan.components.loss, matplotlib, wheel, pytest, expecttest' 2>/dev/null; then
    step "installing ${BENCH_REQS[*]} into $v"
    "$v/bin/python" -m pip install -q "${BENCH_REQS[@]}"
  fi
}

series_applied() {  # series_applied PYTHON [SERIES_DIR]: "applied" / "not applied" / ...
  (cd / && "$REPO_PY" -m torch_patches status --python "$1" ${2:+--series "$2"} 2>/dev/null \
    | sed -n 's/^state: *//p')
}

mkdir -p "$BENCH_VENVS" "$BENCH_OUT"
PRISTINE="$BENCH_VENVS/pristine/bin/python"
PATCHED="$BENCH_VENVS/patched/bin/python"
REV2="$BENCH_VENVS/rev2/bin/python"
REV2_COMMIT="${BENCH_REV2_COMMIT:-afe6a0b}"
DUMP="$(mktemp -d)"
trap 'rm -rf "$DUMP"' EXIT
make_venv "$BENCH_VENVS/pristine"
make_venv "$BENCH_VENVS/patched"
REV2_SERIES=""
if git -C "$REPO" cat-file -e "$REV2_COMMIT^{commit}" 2>/dev/null; then
  git -C "$REPO" archive "$REV2_COMMIT" "torch_patches/patches/$BASE_VERSION" | tar -x -C "$DUMP"
  REV2_SERIES="$DUMP/torch_patches/patches/$BASE_VERSION"
  make_venv "$BENCH_VENVS/rev2" torch-only
else
  step "commit $REV2_COMMIT (series revision 2) is not in this clone: benchmark 1c runs without it"
fi
# The CLI is stdlib-only; run it from the checkout with any of the venvs' pythons
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
REPO_PY="$PRISTINE"
if [[ "$(series_applied "$PRISTINE")" != "not applied" ]]; then
  step "reverting the series in the pristine venv"
  "$REPO_PY" -m torch_patches revert --python "$PRISTINE"
fi
step "applying the series: python -m torch_patches apply --python $PATCHED"
"$REPO_PY" -m torch_patches apply --python "$PATCHED"
"$REPO_PY" -m torch_patches status --python "$PRISTINE" | sed -n '/^state/p;/^torch/p'
"$REPO_PY" -m torch_patches status --python "$PATCHED" | sed -n '/^state/p;/^torch/p'
# Method b is torchtitan's own ChunkedLossWrapper: a venv cloned from one with the torchtitan
# consumer series applied (consumers/torchtitan) gets it reverted
for v in "$PRISTINE" "$PATCHED"; do
  tt_state="$(cd / && "$REPO_PY" -m torch_patches torchtitan status --python "$v" 2>/dev/null \
              | sed -n 's/^state: *//p' || true)"
  if [[ -n "$tt_state" && "$tt_state" != "not applied" ]]; then
    step "reverting the torchtitan consumer series in $v (method b runs torchtitan as released)"
    "$REPO_PY" -m torch_patches torchtitan revert --python "$v"
  fi
done
if [[ -n "$REV2_SERIES" ]]; then
  if [[ "$(series_applied "$REV2" "$REV2_SERIES")" != "applied" ]]; then
    if [[ "$(series_applied "$REV2" "$REV2_SERIES")" != "not applied" ]]; then
      "$REPO_PY" -m torch_patches revert --python "$REV2"
    fi
    step "applying series revision 2 (commit $REV2_COMMIT) to $REV2"
  fi
  "$REPO_PY" -m torch_patches apply --python "$REV2" --series "$REV2_SERIES"
fi

if [[ -n "${BENCH_QUICK:-}" ]]; then
  COLL=(--vocab 64 --dim 16 --seq 16 --configs FSDP)
  ORDER=(--vocab 64 --dim 16 --seq 16)
  PP=(--schedules GPipe)
  STEP=(--vocab 256 --dim 16 --layers 1 --seq 32 --warmup 1 --steps 2)
  MEM=(--vocab-sweep 1024x64,2048x64 --seq-sweep 1024x32,1024x64)
  WHEEL=(--repeat 1 --methods cp,torch-patches)
  COMP=(-k test_reentrant_checkpointing_prefetch_parity)
  TT=(--steps 2)
  RENDER=(--out "$BENCH_OUT/benchmarks.md")
else
  COLL=() ORDER=() PP=() STEP=() MEM=() WHEEL=() COMP=() TT=() RENDER=()
fi
export PYTHONWARNINGS=ignore
filter() { grep -v -E '^(USDT|ERROR):|DeviceProperties.cpp|CPUAllocator.cpp' || true; }
B="$BENCH_OUT"
T0=$SECONDS
step "1. collectives per optimizer step (unpatched: methods b, c, d)"
"$PRISTINE" tools/bench/collectives.py "${COLL[@]}" --json "$B/collectives-pristine.json" --dump "$DUMP" 2>&1 | filter
step "1. collectives per optimizer step (patched: methods a, b, d; method b compared with the unpatched run)"
"$PATCHED" tools/bench/collectives.py "${COLL[@]}" --methods a,b,d --json "$B/collectives-patched.json" \
  --compare-dump "$DUMP" --parity-json "$B/parity.json" 2>&1 | filter
step "1c. reduce-scatter order and exposed bytes (unpatched: methods b, c, d)"
"$PRISTINE" tools/bench/reduce_order.py "${ORDER[@]}" --json "$B/reduce-order-pristine.json" 2>&1 | filter
if [[ -n "$REV2_SERIES" ]]; then
  step "1c. reduce-scatter order (series revision 2: method a, the before)"
  "$REV2" tools/bench/reduce_order.py "${ORDER[@]}" --methods a --json "$B/reduce-order-rev2.json" 2>&1 | filter
fi
step "1c. reduce-scatter order (patched: methods a, b, d)"
"$PATCHED" tools/bench/reduce_order.py "${ORDER[@]}" --methods a,b,d --json "$B/reduce-order-patched.json" 2>&1 | filter
step "1b. PP2 x FSDP2, chunked loss on the last stage (unpatched: plain inner backwards)"
"$PRISTINE" tools/bench/pp_collectives.py "${PP[@]}" --json "$B/pp-pristine.json" 2>&1 | filter
step "1b. PP2 x FSDP2, torchtitan's ChunkedLossWrapper as the loss (unpatched)"
"$PRISTINE" tools/bench/pp_collectives.py "${PP[@]}" --loss torchtitan --json "$B/pp-pristine-torchtitan.json" 2>&1 | filter
step "1b. PP2 x FSDP2 (patched: partial_backward)"
"$PATCHED" tools/bench/pp_collectives.py "${PP[@]}" --json "$B/pp-patched.json" 2>&1 | filter
step "1d. pipeline host cost: Python calls per step and per eval() (unpatched, patched)"
"$PRISTINE" tools/bench/pp_host_calls.py --json "$B/pp-host-calls-pristine.json" 2>&1 | filter
"$PATCHED" tools/bench/pp_host_calls.py --json "$B/pp-host-calls-patched.json" 2>&1 | filter
step "2. step time (patched torch, same run)"
"$PATCHED" tools/bench/step_time.py "${STEP[@]}" --json "$B/step_time.json" 2>&1 | filter
step "3. peak memory, chunked vs full logits"
"$PATCHED" tools/bench/memory.py "${MEM[@]}" --json "$B/memory.json" 2>&1 | filter
step "4. patched-wheel build time"
"$PATCHED" tools/bench/wheel_build.py "${WHEEL[@]}" --wheel-python "$PATCHED" --json "$B/wheel_build.json" 2>&1 | filter
step "6. the composition tests' numbers (patched torch; pytest on the test file)"
"$PATCHED" tools/bench/compositions.py "${COMP[@]}" --python "$PATCHED" --json "$B/compositions.json" 2>&1 | filter
step "7. torchtitan's ChunkedLossWrapper, released vs patched (the consumer series applied to $PATCHED now)"
"$REPO_PY" -m torch_patches torchtitan apply --python "$PATCHED"
"$PATCHED" tools/bench/torchtitan_chunked.py "${TT[@]}" --out "$B/torchtitan-chunked.json" 2>&1 | filter
step "8. tables and plots from $B"
"$PATCHED" tools/bench/render.py --results "$B" "${RENDER[@]}"
step "done in $((SECONDS - T0)) s (benchmarks only)"
