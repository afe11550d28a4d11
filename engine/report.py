"""What a run tells: console lines, metrics.jsonl, eval.jsonl, TensorBoard events, summary.json.

Only the chief writes files; every task may print.
"""

import json
import math
import os
import sys
import time

import tensorflow as tf

from engine.config import ConfigError


def _number(value):
    """JSON has no inf or NaN: write them as null."""
    value = float(value)
    return value if math.isfinite(value) else None


def _step_of(line):
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a crash: dropped


def write_json(path, obj):
    """Writes atomically: a reader never sees half a file, a crash never leaves one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def make_workdir(path):
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write_probe")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--workdir={path}: cannot write there ({e.strerror})") from None


class Report:
    def __init__(self, workdir, chief, total_steps, resume_step=0, stream=None):
        self.workdir, self.chief, self.total_steps = workdir, chief, total_steps
        self.stream = stream or sys.stdout
        self.live = chief and self.stream.isatty()
        self._progress_shown = False
        self._start, self._start_step = time.perf_counter(), resume_step
        if chief:
            make_workdir(workdir)
            self.rewind(resume_step)
            self._writers = {
                name: tf.summary.create_file_writer(os.path.join(workdir, name)) for name in ("train", "eval")
            }

    def rewind(self, step):
        """Drops records after `step` (logged before a crash or a rollback): no step is logged twice."""
        if not self.chief:
            return
        for name in ("metrics.jsonl", "eval.jsonl"):
            path = os.path.join(self.workdir, name)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                lines = f.readlines()
            kept = [line for line in lines if line.strip() and _step_of(line) <= step]
            if len(kept) != len(lines):
                with open(f"{path}.tmp", "w") as f:
                    f.writelines(kept)
                os.replace(f"{path}.tmp", path)

    def line(self, text):
        """A plain console line, clearing the live progress line first."""
        if self._progress_shown:
            self.stream.write("\r\033[K")
            self._progress_shown = False
        print(text, file=self.stream, flush=True)

    def train(self, step, metrics):
        """metrics: loss, learning_rate, grad_norm, loss_scale (None unless float16), examples_per_sec."""
        record = {"step": step, **{k: None if v is None else _number(v) for k, v in metrics.items()}}
        scale = "-" if metrics["loss_scale"] is None else f"{metrics['loss_scale']:g}"
        self.line(
            f"train step={step} loss={metrics['loss']:.5g} learning_rate={metrics['learning_rate']:.4g} "
            f"grad_norm={metrics['grad_norm']:.4g} loss_scale={scale} "
            f"examples_per_sec={metrics['examples_per_sec']:.1f}"
        )
        if not self.chief:
            return
        self._append("metrics.jsonl", record)
        self._scalars("train", step, metrics)
        if self.live:
            elapsed = time.perf_counter() - self._start
            eta = elapsed / max(1, step - self._start_step) * (self.total_steps - step)
            self.stream.write(
                f"\r\033[K[{100 * step // self.total_steps:3d}%] step {step}/{self.total_steps} "
                f"loss {metrics['loss']:.4f} {metrics['examples_per_sec']:,.0f} ex/s "
                f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}"
            )
            self.stream.flush()
            self._progress_shown = True

    def eval(self, step, results):
        """results: accuracy, loss, examples."""
        self.line(
            f"eval step={step} accuracy={results['accuracy']:.4f} loss={results['loss']:.5g} "
            f"examples={results['examples']}"
        )
        if self.chief:
            self._append("eval.jsonl", {"step": step, **results})
            self._scalars("eval", step, {k: v for k, v in results.items() if k != "examples"})

    def summary(self, summary):
        if self.chief:
            clean = {k: _number(v) if isinstance(v, float) else v for k, v in summary.items()}
            write_json(os.path.join(self.workdir, "summary.json"), clean)
            for writer in self._writers.values():
                writer.flush()

    def _append(self, name, record):
        with open(os.path.join(self.workdir, name), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _scalars(self, writer, step, values):
        with self._writers[writer].as_default(step=step):
            for name, value in values.items():
                if value is not None:
                    tf.summary.scalar(name, value)
