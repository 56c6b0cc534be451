#!/usr/bin/env bash
# The checks of batches on a GPU, in one command, on a machine with Python 3.12, a CUDA PyTorch, numpy, h5py, fsspec
# and a C compiler, and no network:
#
#     tools/gpu_check.sh            # from the repository root or anywhere; `python` is the Python to check
#
# 1. installs what that Python lacks from wheels/ (git-ignored, made by tools/gpu_wheels.sh, copied with the checkout)
#    with pip --no-index;
# 2. builds the C kernels in place (python setup.py build_ext --inplace; without a compiler or zlib's headers the
#    pure-Python kernels run, and the results say so);
# 3. runs tests/test_cuda.py (bit-exact device batches, pinned buffers flat over 1,000 batches);
# 4. runs tools/bench.py --device cuda --quick (its figures also as JSON).
#
# Everything goes to "$OUT/gpu_check.txt" (and "$OUT/bench_device.json") when OUT is set, else to gpu_results/ in the
# repository; each step has a time limit, all of them within 8 minutes. Exit status: 0 when every step passed (the
# CUDA tests skip, and the bench says it needs a GPU, where torch sees none).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
RESULTS=${OUT:-$ROOT/gpu_results}
mkdir -p "$RESULTS"
LOG=$RESULTS/gpu_check.txt
export PY=${PYTHON:-python} ROOT
BUDGET=470 # seconds for all steps (8 minutes, less a margin for writing the results)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# pip: no network, none of the machine's pip settings (indexes, links, constraints), a system Python's site too
for v in $(compgen -e PIP_); do unset "$v"; done
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
failed=()

# seconds left of the budget, at most $1
left() {
  local rest=$((BUDGET - SECONDS))
  ((rest < $1)) && echo $((rest > 1 ? rest : 1)) || echo "$1"
}

# run a step: its name, its time limit in seconds, the command
step() {
  local name=$1 limit
  limit=$(left "$2")
  shift 2
  echo
  echo "=== $name (limit ${limit} s, ${SECONDS} s elapsed) ==="
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" # a command, or a function of this script
  local rc=$?
  echo "=== $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ", ran past ${limit} s") ==="
  ((rc == 0)) || failed+=("$name")
  return $rc
}

# pip: the Python's own, or the one in wheels/ (a wheel runs as a zip on sys.path)
pip_() {
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip "$@"
  else
    local wheel
    wheel=$(ls "$ROOT"/wheels/pip-*.whl 2>/dev/null | head -n 1)
    [[ -n $wheel ]] || { echo "no pip, and no pip wheel in wheels/"; return 1; }
    "$PY" "$wheel/pip" "$@"
  fi
}

# what the project needs beyond torch, numpy, h5py and fsspec: through pip's resolver (which also replaces versions
# too old for these), or, where it finds no solution with what the machine has (an older torch than
# stable-baselines3 asks for, say), each wheel whose distribution is missing, without dependencies
install_wheels() {
  [[ -d $ROOT/wheels ]] || { echo "wheels/ is missing: run tools/gpu_wheels.sh where there is network"; return 1; }
  local want=(zarr numcodecs gymnasium stable-baselines3 pytest rich hypothesis setuptools)
  if ! pip_ install --quiet --no-index --find-links "$ROOT/wheels" "${want[@]}"; then
    echo "--- pip's resolver found no solution: installing the missing distributions without dependencies"
    local wheel dist missing=()
    for wheel in "$ROOT"/wheels/*.whl; do
      dist=$(basename "$wheel" | cut -d- -f1)
      [[ $dist == pip ]] && continue
      "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null || missing+=("$wheel")
    done
    ((${#missing[@]} == 0)) || pip_ install --quiet --no-index --no-deps "${missing[@]}" || return 1
  fi
  "$PY" -c "import importlib.metadata as m, sys; print(', '.join(f'{d} {m.version(d)}' for d in sys.argv[1:]))" \
    "${want[@]}"
}

export -f pip_ install_wheels

main() {
  echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git')"
  echo "results: $LOG"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" - <<'EOF' || { echo "torch, numpy, h5py and fsspec must be there already"; exit 2; }
import sys, torch, numpy, h5py, fsspec
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"numpy {numpy.__version__}, h5py {h5py.__version__}, fsspec {fsspec.__version__}")
print("CUDA device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (torch sees no GPU)")
EOF

  step install 150 install_wheels
  step build 120 "$PY" setup.py --quiet build_ext --inplace
  "$PY" -c "import her_store._kernels as k; print('compiled kernels:', k.COMPILED)"
  step tests 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py
  COLUMNS=160 step bench 300 "$PY" tools/bench.py --device cuda --quick --json "$RESULTS/bench_device.json"

  echo
  echo "gpu_check: ${SECONDS} s; $( ((${#failed[@]} == 0)) && echo "every step passed" || echo "failed: ${failed[*]}")"
  ((${#failed[@]} == 0))
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
