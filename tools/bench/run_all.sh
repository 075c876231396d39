#!/usr/bin/env bash
# All benchmarks in one command: bash tools/bench/run_all.sh
#
# 1. makes two virtual environments with the project's own tooling:
#      $BENCH_VENVS/pristine  torch==2.15.0 as released
#      $BENCH_VENVS/patched   the same, then `python -m torch_patches apply --python .../bin/python`
#    each with torchtitan==0.3.0 (+ tyro, spmd_types==0.2.3), matplotlib and wheel;
#    existing venvs are reused (pristine is reverted if something patched it);
# 2. runs tools/bench/{collectives,step_time,memory,wheel_build}.py and prints
#    their tables; the memory plot goes to $BENCH_OUT/memory.png.
#
# Environment:
#   BENCH_VENVS  where the venvs live (default ~/.cache/torch_patches/bench)
#   BENCH_OUT    results directory (default tools/bench/results)
#   PYTHON       interpreter that creates the venvs (default python3)
#   BENCH_CLONE_FROM=VENV  optimisation fallback only: create a missing venv
#                with `cp -al VENV` (hard links; a venv that has torch==2.15.0)
#                instead of `python -m venv` + `pip install torch==2.15.0`.
#                Safe because `torch_patches apply/revert` replace files by
#                rename and never write through a link.
#   BENCH_QUICK=1  tiny sizes (what the smoke test uses), for a dry run
# pip runs with PIP_CONFIG_FILE=/dev/null (a machine-wide cap on torch does
# not apply); PIP_FIND_LINKS defaults to /root/wheelcache when it exists.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
BENCH_VENVS="${BENCH_VENVS:-$HOME/.cache/torch_patches/bench}"
BENCH_OUT="${BENCH_OUT:-$REPO/tools/bench/results}"
PYTHON="${PYTHON:-python3}"
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_CONSTRAINT || true
if [[ -z "${PIP_FIND_LINKS:-}" && -d /root/wheelcache ]]; then export PIP_FIND_LINKS=/root/wheelcache; fi
# expecttest: torch.testing._internal, which the shared CollectiveCounter
# (test/distributed/fsdp_lifecycle_testing.py) imports
BENCH_REQS=(torchtitan==0.3.0 tyro spmd_types==0.2.3 matplotlib wheel expecttest)

step() { printf '\n==> %s\n' "$*"; }

torch_version() {
  "$1" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

make_venv() {  # make_venv DIR
  local v="$1"
  if [[ "$(torch_version "$v/bin/python")" != 2.15.0 ]]; then
    rm -rf "$v"
    if [[ -n "${BENCH_CLONE_FROM:-}" ]]; then
      step "creating $v by cp -al $BENCH_CLONE_FROM (optimisation fallback)"
      cp -al "$BENCH_CLONE_FROM" "$v"
    else
      step "creating $v: python -m venv + pip install torch==2.15.0"
      "$PYTHON" -m venv "$v"
      "$v/bin/python" -m pip install -q "torch==2.15.0"
    fi
  fi
  if ! "$v/bin/python" -c 'import torchtitan.components.loss, matplotlib, wheel, expecttest' 2>/dev/null; then
    step "installing ${BENCH_REQS[*]} into $v"
    "$v/bin/python" -m pip install -q "${BENCH_REQS[@]}"
  fi
}

series_applied() {  # prints "applied" / "not applied" / ... for a venv's python
  (cd / && "$REPO_PY" -m torch_patches status --python "$1" 2>/dev/null | sed -n 's/^state: *//p')
}

mkdir -p "$BENCH_VENVS" "$BENCH_OUT"
PRISTINE="$BENCH_VENVS/pristine/bin/python"
PATCHED="$BENCH_VENVS/patched/bin/python"
make_venv "$BENCH_VENVS/pristine"
make_venv "$BENCH_VENVS/patched"
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

if [[ -n "${BENCH_QUICK:-}" ]]; then
  COLL=(--vocab 64 --dim 16 --seq 16 --configs FSDP)
  STEP=(--vocab 256 --dim 16 --layers 1 --seq 32 --warmup 1 --steps 2)
  MEM=(--vocab-sweep 1024x64,2048x64 --seq-sweep 1024x32,1024x64)
  WHEEL=(--repeat 1 --methods cp,torch-patches)
else
  COLL=() STEP=() MEM=() WHEEL=()
fi
export PYTHONWARNINGS=ignore
filter() { grep -v -E '^(USDT|ERROR):|DeviceProperties.cpp|CPUAllocator.cpp' || true; }
B="$BENCH_OUT"
T0=$SECONDS
step "uptime: $(uptime)"
step "1. collectives per optimizer step (unpatched 2.15.0: methods b, c, d)"
"$PRISTINE" tools/bench/collectives.py "${COLL[@]}" --json "$B/collectives-pristine.json" \
  --dump "$B/dump-pristine" 2>&1 | filter
step "1. collectives per optimizer step (patched: methods a, b, d; merged with the unpatched run)"
"$PATCHED" tools/bench/collectives.py "${COLL[@]}" --methods a,b,d --json "$B/collectives-patched.json" \
  --dump "$B/dump-patched" --compare "$B/collectives-pristine.json" \
  --compare-dump "$B/dump-pristine" 2>&1 | filter
step "1b. PP2 x FSDP2 reduce-scatters per step, chunked loss on the last stage (unpatched 2.15.0)"
"$PRISTINE" tools/bench/pp_collectives.py 2>&1 | filter
step "1b. PP2 x FSDP2, torchtitan's ChunkedLossWrapper as the loss (unpatched 2.15.0)"
"$PRISTINE" tools/bench/pp_collectives.py --loss torchtitan 2>&1 | filter
step "1b. PP2 x FSDP2 reduce-scatters per step (patched: partial_backward)"
"$PATCHED" tools/bench/pp_collectives.py 2>&1 | filter
step "2. step time (patched torch, same run)  [uptime: $(uptime | sed 's/.*load/load/')]"
"$PATCHED" tools/bench/step_time.py "${STEP[@]}" 2>&1 | filter
step "3. peak memory, chunked vs full logits"
"$PATCHED" tools/bench/memory.py "${MEM[@]}" --plot "$B/memory.png" --json "$B/memory.json" 2>&1 | filter
step "4. patched-wheel build time  [uptime: $(uptime | sed 's/.*load/load/')]"
"$PATCHED" tools/bench/wheel_build.py "${WHEEL[@]}" --wheel-python "$PATCHED" 2>&1 | filter
rm -rf "$B/dump-pristine" "$B/dump-patched"
step "done in $((SECONDS - T0)) s (benchmarks only); uptime: $(uptime)"
