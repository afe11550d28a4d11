"""What the benchmarks share: where the repository and its results are, the models of the table, a worker process
for one measurement, the table's text, and the machine and revision every result is recorded with."""

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


RESULTS = os.path.join(ROOT, "bench", "RESULTS.md")
# PyTorch's virtual environment (bench/pytorch.py makes it on first use): BENCH_TORCH_VENV, else .venv-torch here.
TORCH_VENV = os.path.abspath(os.environ.get("BENCH_TORCH_VENV") or os.path.join(ROOT, ".venv-torch"))


# The models of the table: name -> Config fields (besides dataset=synthetic, AdamW and the defaults).
MODELS = {
    "mlp_1024": dict(model="mlp", hidden_sizes=(1024, 1024), global_batch_size=256, synthetic_shape=(28, 28, 1)),
    "mlp_256": dict(model="mlp", hidden_sizes=(256, 256), global_batch_size=256, synthetic_shape=(28, 28, 1)),
    "resnet": dict(model="resnet", resnet_depth=20, global_batch_size=128, synthetic_shape=(32, 32, 3)),
    "transformer": dict(model="transformer", global_batch_size=128, synthetic_shape=(28, 28, 1)),
}


# --quick: the same rows on models small enough that compiling them is most of the time.
QUICK_MODELS = {
    "mlp_1024": dict(model="mlp", hidden_sizes=(64, 64), global_batch_size=32, synthetic_shape=(8, 8, 1)),
    "mlp_256": dict(model="mlp", hidden_sizes=(16, 16), global_batch_size=32, synthetic_shape=(8, 8, 1)),
    "resnet": dict(model="resnet", resnet_depth=8, resnet_width=4, global_batch_size=16, synthetic_shape=(8, 8, 3)),
    "transformer": dict(
        model="transformer",
        transformer_layers=1,
        transformer_dim=16,
        transformer_heads=2,
        transformer_mlp_dim=32,
        global_batch_size=16,
        synthetic_shape=(8, 8, 1),
    ),
}


for _spec in QUICK_MODELS.values():
    _spec["synthetic_examples"] = 256  # fewer synthetic examples to generate


PRECISIONS = ["float32", "mixed_bfloat16", "mixed_float16"]
# Host overhead: a model whose math costs next to nothing, so a step is all overhead.
TINY = dict(model="mlp", hidden_sizes=(16,), global_batch_size=16, synthetic_shape=(8,), synthetic_examples=256)


def run_worker(task, log_prefix, env=None):
    """Runs bench/worker.py on `task` in a fresh process; returns its result dict (raises on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        task_path, result_path = os.path.join(tmp, "task.json"), os.path.join(tmp, "result.json")
        with open(task_path, "w") as f:
            json.dump(task, f)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker", task_path, result_path],
            cwd=ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("progress: "):
                print(f"[{log_prefix}] {line[len('progress: ') :].rstrip()}", file=sys.stderr, flush=True)
        proc.wait()
        if proc.returncode != 0 or not os.path.exists(result_path):
            raise RuntimeError(f"{log_prefix} failed (exit {proc.returncode}):\n" + "".join(lines[-40:]))
        with open(result_path) as f:
            return json.load(f)


def label(spec):
    if spec["model"] == "mlp":
        flat = math.prod(spec["synthetic_shape"])
        sizes = "-".join(str(s) for s in (flat, *spec["hidden_sizes"], 10))
        return f"MLP {sizes}, batch {spec['global_batch_size']}"
    shape = "x".join(str(s) for s in spec["synthetic_shape"])
    if spec["model"] == "resnet":
        return f"ResNet-{spec.get('resnet_depth', 20)}, batch {spec['global_batch_size']}, {shape}"
    layers, dim = spec.get("transformer_layers", 2), spec.get("transformer_dim", 64)
    return f"Transformer {layers}x{dim}, batch {spec['global_batch_size']}, {shape}"


def row(row_id, what, value, shown, target="", passes=None, detail=""):
    """One row of a benchmark's table: its id, measurement, value (a number), shown (`shown`, the value as printed:
    a string, or a function of the value), target, result and detail. The result is ERROR when `value` is missing or
    not finite, else PASS or FALL SHORT by `passes` (None: info)."""
    base = dict(id=row_id, measurement=what, value=value, shown="n/a", target=target or "", detail=detail)
    if value is None or not math.isfinite(value):
        return {**base, "value": None, "result": "ERROR"}
    verdict = "info" if passes is None else ("PASS" if passes(value) else "FALL SHORT")
    return {**base, "shown": shown(value) if callable(shown) else shown, "result": verdict}


def not_judged(table):
    """`table` with each verdict (PASS, FALL SHORT) replaced by "not judged": a smoke test's numbers, measured on
    models or inputs too small to mean anything against the targets."""
    return [{**r, "result": "not judged"} if r["result"] in ("PASS", "FALL SHORT") else r for r in table]


def format_table(table, markdown=False):
    header = ("measurement", "value", "target", "result", "detail")
    body = [(r["measurement"], r["shown"], r["target"], r["result"], r["detail"]) for r in table]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(str(r[i])) for r in (header, *body)) for i in range(len(header) - 1)]
    lines = []
    for row in (header, *body):
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths)]
        lines.append("  ".join(cells) + "  " + row[-1])
    return "\n".join(lines)


def machine():
    cpu = platform.processor() or platform.machine()
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        have = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
        flags = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in have)
    except (OSError, StopIteration):
        pass
    import psutil

    text = f"{cpu}, {cores()} ({flags}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        if gpu:
            text += f", GPU: {gpu}"
    except (OSError, subprocess.SubprocessError):
        pass
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("tensorflow", "keras"))
    return f"{text}; {versions}; Python {platform.python_version()}"


def cores():
    """The cores this process may run on, as its numbers depend on them, and the machine's where they are fewer
    (taskset, a cgroup's cpuset): TensorFlow sizes its thread pools by the former."""
    usable, total = len(os.sched_getaffinity(0)), os.cpu_count()
    return f"{usable} cores" if usable == total else f"{usable} of the machine's {total} cores"


def revision():
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
