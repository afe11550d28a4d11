#!/usr/bin/env bash
# The engine against PyTorch on one NVIDIA GPU (bench/gpu_table.py): a decoder of 12 layers, 768 wide, context 1024,
# batch 8, 150 steps, in float32, mixed_bfloat16 and mixed_float16 against PyTorch in float32, bfloat16 autocast and
# float16 autocast with GradScaler (each side's time a step, validation loss and whole process), and an 8192-cubed
# matmul alone in each; appended to bench/RESULTS.md within 8 minutes (--budget, 460 s, for its processes).
#
#   bash bench/gpu.sh                                      # appends the table to bench/RESULTS.md
#   PYTHONPATH=/path/to/tensorflow bash bench/gpu.sh       # a GPU machine without a network, TensorFlow copied in
#   bash bench/gpu.sh --precisions=float32 --budget=200    # any bench/gpu_table.py flag passes through
#
# TensorFlow: python3 as it is when it finds TensorFlow (no virtual environment, no pip: a machine without a
# network where a wrapper put TensorFlow on PYTHONPATH); otherwise a virtual environment of its own (BENCH_VENV)
# installed from the network. PyTorch: BENCH_TORCH_PYTHON, else python3 if its PyTorch sees a GPU, else .venv-torch
# (bench/pytorch.py makes it); its processes run without LD_LIBRARY_PATH and PYTHONPATH, behind $TORCH_ENV if set.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

# Found, not imported: importing it here would cost seconds of the 8 minutes.
if python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("tensorflow") is None)' 2>/dev/null; then
  PYTHON=python3
else
  # A virtual environment of its own, outside the repository (its CUDA wheels are large).
  VENV="${BENCH_VENV:-$HOME/.cache/engine-bench-gpu-venv}"
  if [ ! -x "$VENV/bin/python" ]; then
    if ! python3 -m venv "$VENV" 2>/dev/null; then
      # Debian and Ubuntu ship venv separately; a bare image may lack it.
      if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq "python3.$(python3 -c 'import sys; print(sys.version_info[1])')-venv"
        rm -rf "$VENV" && python3 -m venv "$VENV"
      else
        echo "error: python3 -m venv failed; install python3-venv" >&2
        exit 2
      fi
    fi
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt "tensorflow[and-cuda]==2.21.0"
  echo "installed in $((SECONDS - started)) s" >&2
  PYTHON=$VENV/bin/python
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
fi
# One GPU: the first visible one.
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES%%,*}"
status=0
"$PYTHON" -m bench.gpu_table --record "$@" || status=$?
echo "bench/gpu.sh: $((SECONDS - started)) s in all" >&2
exit $status
