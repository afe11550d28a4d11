#!/usr/bin/env bash
# The benchmark table on one NVIDIA GPU, mixed_float16 and XLA, from a bare GPU machine (a driver,
# python3 3.10-3.13 and a network). Sized for under 8 minutes in all (install included); not yet run
# on a GPU, so the first run's time belongs in bench/RESULTS.md with its table.
#
#   bash bench/gpu.sh                  # appends the table to bench/RESULTS.md
#   BENCH_VENV=/path bash bench/gpu.sh --models=mlp_1024    # any bench.run flag passes through
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

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

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
"$VENV/bin/python" -c "import tensorflow as tf, sys; sys.exit(0 if tf.config.list_physical_devices('GPU') else 1)" \
  || { echo "error: TensorFlow sees no GPU (driver, CUDA_VISIBLE_DEVICES?)" >&2; exit 2; }

# One GPU: the table compares one device with two logical devices on that same GPU.
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES%%,*}"
"$VENV/bin/python" -m bench.run --gpu --record "$@"
echo "bench/gpu.sh: $((SECONDS - started)) s in all" >&2
