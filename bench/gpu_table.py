"""The engine against PyTorch on one GPU: a decoder of 12 layers, 768 wide, 12 heads, context 1024, batch 8, AdamW,
150 steps of the Shakespeare recipe, in each precision, and a matmul alone in each framework. bench/gpu.sh runs it
and appends the table to bench/RESULTS.md.

    bash bench/gpu.sh                               # the table, within 8 minutes on one GPU
    python -m bench.gpu_table --record              # the same from a python that imports TensorFlow
    python -m bench.gpu_table --device=cpu --layers=1 --dim=16 --heads=2 --sequence_length=16 --batch=4 \\
        --steps=3 --warmup_steps=1 --matmul_size=128 --results=/tmp/RESULTS.md --record   # a tiny table on a CPU

A row is one precision: `launch.py` with the recipe's flags (as a user runs it) against bench/torch_gpt.py (float32;
bfloat16 autocast; float16 autocast with GradScaler), each one whole process timed from outside, from the same
initial weights, batches and evaluation windows (bench/pytorch.py's prepare writes them). The engine's time a step
is its summary's, which leaves out the first round (tracing and XLA's compile); PyTorch's the median step after
its first 20 (a shorter run's first half), timed on the GPU. The matmuls run one after another, each size-cubed,
float32 in TF32 (TensorFlow's default on such a GPU, and set so for PyTorch).

Every process gets a part of one budget (--budget seconds from the start): what is left, shared equally among the
processes still to start, PyTorch's runs before the engine's (they are short: what they leave goes to the engine's).
A process still running at the end of its part is killed and its row says "did not finish in N s": the table is
written whatever happens to one run.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from bench import common, pytorch  # the standard library only: --matmul=torch runs this file in PyTorch's python

MATMUL_DTYPES = ("float32", "float16", "bfloat16")
MATMUL_REPEATS = 50  # matmuls in a timed run; the best of three runs counts
MIN_PROCESS_S = 10  # a process whose part of the budget is shorter is not started
# bench/torch_gpt.py's --precision, as the table names it.
TORCH_LABELS = {"float32": "float32", "bfloat16": "bfloat16 autocast", "float16": "float16 autocast, GradScaler"}


def recipe(args):
    """launch.py's flags for the decoder: the Shakespeare recipe resized; it evaluates once, after its last step. Its
    rounds are at most half the steps: the first traces and compiles the step, the summary times the others."""
    return [
        "--flagfile=experiments/shakespeare_char.flags",
        f"--gpt_layers={args.layers}",
        f"--gpt_dim={args.dim}",
        f"--gpt_heads={args.heads}",
        f"--sequence_length={args.sequence_length}",
        f"--global_batch_size={args.batch}",
        f"--train_steps={args.steps}",
        f"--steps_per_loop={max(1, min(100, args.steps // 2))}",
        *([f"--warmup_steps={args.warmup_steps}"] if args.warmup_steps is not None else []),
    ]


def matmul_tflops(framework, size, device):
    """TFLOP/s of `size`-cubed matmuls alone in `framework` (tensorflow or torch) on `device` (gpu or cpu) for each
    dtype, with the framework's version and the GPUs it sees."""
    if framework == "tensorflow":
        import tensorflow as tf

        def make(dtype):
            return tf.cast(tf.random.normal([size, size]), dtype)

        matmul, wait = tf.matmul, lambda x: x[0, 0].numpy()
        details = [tf.config.experimental.get_device_details(g) for g in tf.config.list_physical_devices("GPU")]
        info = {"version": tf.__version__, "gpus": [d.get("device_name", "?") for d in details]}
    else:
        import torch

        where = "cuda" if device == "gpu" else "cpu"
        if where == "cuda":
            torch.backends.cuda.matmul.fp32_precision = "tf32"

        def make(dtype):
            return torch.randn(size, size, device=where).to(getattr(torch, dtype))

        matmul, wait = torch.matmul, lambda x: x[0, 0].item()
        gpus = [torch.cuda.get_device_name()] if where == "cuda" else []
        info = {"version": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus}
    tflops = {}
    for dtype in MATMUL_DTYPES:
        a, b = make(dtype), make(dtype)
        wait(matmul(a, b))  # the first call chooses the kernel
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(MATMUL_REPEATS):
                c = matmul(a, b)  # queued on the device: the host waits once, for the last
            wait(c)
            runs.append(time.perf_counter() - start)
        tflops[dtype] = 2 * size**3 * MATMUL_REPEATS / min(runs) / 1e12
    return {**info, "tflops": tflops}


class Budget:
    """Seconds to the deadline, shared equally among the processes still to start."""

    def __init__(self, seconds, processes):
        self.deadline, self.processes = time.monotonic() + seconds, processes

    def share(self):
        part = (self.deadline - time.monotonic()) / self.processes
        self.processes -= 1
        return part


def attempt(what, measure, timeout):
    """measure(timeout)'s result, or {"error": why} for a process that did not finish in `timeout` seconds, failed,
    or was not started for want of time; said on stderr either way."""
    if timeout < MIN_PROCESS_S:
        result = {"error": f"not run: {max(timeout, 0):.0f} s of the budget left"}
    else:
        try:
            result = measure(timeout)
        except subprocess.TimeoutExpired:
            result = {"error": f"did not finish in {timeout:.0f} s"}
        except Exception as e:  # a failed run costs its row, not the table; its output's last line says why
            print(f"{what}: {e}", file=sys.stderr, flush=True)
            result = {"error": "failed: " + (str(e).strip().splitlines() or ["?"])[-1][:200]}
    numbers = {**result, **result.get("tflops", {})}
    shown = result.get("error") or ", ".join(f"{k} {v:.4g}" for k, v in numbers.items() if isinstance(v, float))
    print(f"progress: {what}: {shown}", file=sys.stderr, flush=True)
    return result


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


HEADER = (
    "| engine | PyTorch | engine ms/step | PyTorch ms/step | step ratio | engine val. loss | PyTorch val. loss | "
    "engine process s | PyTorch process s | process ratio | skipped steps (engine, PyTorch) | engine jit_compile | "
    "notes |\n" + "|---" * 13 + "|"
)
COLUMNS = (
    "ms/step: the engine's from its summary (its first round, with tracing and XLA's compile, left out), PyTorch's "
    "the median step after its first 20, or a shorter run's first half (CUDA events on a GPU); val. loss: after the "
    "last step, on the same windows; process s: start to exit, timed from outside (imports, start-up, training, "
    "evaluation, and the engine's checkpoint)."
)


def row(precision, engine, theirs):
    """One precision's row: a side that did not finish has no numbers, and the notes say why."""

    def number(side, key, spec):
        return format(side[key], spec) if key in side else "-"

    def ratio(key):
        return f"{engine[key] / theirs[key]:.2f}x" if key in engine and key in theirs else "-"

    sides = (("engine", engine), ("PyTorch", theirs))
    notes = [f"{name} {side[key]}" for key in ("error", "note") for name, side in sides if key in side]
    cells = [
        precision,
        TORCH_LABELS[pytorch.PRECISIONS[precision]],
        number(engine, "step_ms", ".1f"),
        number(theirs, "step_ms", ".1f"),
        ratio("step_ms"),
        number(engine, "loss", ".4f"),
        number(theirs, "loss", ".4f"),
        number(engine, "wall", ".1f"),
        number(theirs, "wall", ".1f"),
        ratio("wall"),
        f"{engine.get('skipped', '-')}, {theirs.get('skipped', '-')}",
        engine.get("jit", "-"),
        "; ".join(notes),
    ]
    return "| " + " | ".join(cells) + " |"


def matmul_rows(size, sides):
    """The matmul table: {a framework's label: matmul_tflops's result, or {"error": why}}."""
    lines = [f"| {size}-cubed matmul alone, TFLOP/s | " + " | ".join(MATMUL_DTYPES) + " | notes |", "|---" * 5 + "|"]
    for label, result in sides.items():
        if "error" in result:
            lines.append(f"| {label} | " + " | ".join("-" for _ in MATMUL_DTYPES) + f" | {result['error']} |")
        else:
            lines.append(f"| {label} | " + " | ".join(f"{result['tflops'][d]:.3g}" for d in MATMUL_DTYPES) + " | |")
    return "\n".join(lines)


def gpu_description():
    """The GPU measured (the first visible one): its name, memory and driver, as nvidia-smi gives them."""
    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    query = ["nvidia-smi", f"--id={index}", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        name, memory, driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split(", ")
    except (OSError, subprocess.SubprocessError, ValueError):
        return "none found by nvidia-smi"
    return f"{name}, {memory}, driver {driver.strip()}"


def cpu_description():
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {common.cores()}"


def parser():
    out = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    out.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: no GPU wanted (the test's run)")
    out.add_argument("--precisions", default="float32,mixed_bfloat16,mixed_float16", help="the engine's, in order")
    out.add_argument("--layers", type=int, default=12)
    out.add_argument("--dim", type=int, default=768)
    out.add_argument("--heads", type=int, default=12)
    out.add_argument("--sequence_length", type=int, default=1024)
    out.add_argument("--batch", type=int, default=8, help="global batch size")
    out.add_argument("--steps", type=int, default=150)
    out.add_argument("--warmup_steps", type=int, help="default: the recipe's (fewer than --steps)")
    out.add_argument("--matmul_size", type=int, default=8192)
    out.add_argument("--budget", type=float, default=460, help="seconds for every process this starts")
    out.add_argument(
        "--engine_flags",
        default="",
        help="more launch.py flags for the engine's runs (PyTorch's follow what they change in the run)",
    )
    out.add_argument("--torch_venv", default=common.TORCH_VENV)
    out.add_argument("--results", default=common.RESULTS, help="the file --record appends to")
    out.add_argument("--record", action="store_true", help="append the table to --results")
    out.add_argument("--matmul", choices=("tensorflow", "torch"), help=argparse.SUPPRESS)  # internal: one side
    return out


def main(argv=None):
    options = parser()
    args = options.parse_args(argv)
    if args.matmul:
        print(json.dumps(matmul_tflops(args.matmul, args.matmul_size, args.device)), flush=True)
        return 0
    precisions = args.precisions.split(",")
    if set(precisions) - set(pytorch.PRECISIONS):
        options.error(f"--precisions={args.precisions}: choose from {','.join(pytorch.PRECISIONS)}")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # for every process, both sides
    started = datetime.datetime.now()
    budget = Budget(args.budget, 3 + 2 * len(precisions))  # two matmuls, prepare, two processes a precision
    matmul = ["-m", "bench.gpu_table", f"--matmul_size={args.matmul_size}", f"--device={args.device}"]

    # TensorFlow's matmul first: it says whether TensorFlow sees the GPU before the long runs start.
    tf_matmul = attempt(
        "TensorFlow matmul",
        lambda t: last_json(pytorch.timed([sys.executable, *matmul, "--matmul=tensorflow"], t)[1]),
        budget.share(),
    )
    if args.device == "gpu" and tf_matmul.get("gpus") == []:
        print("error: TensorFlow sees no GPU (CUDA_VISIBLE_DEVICES? its CUDA libraries?)", file=sys.stderr)
        return 2
    python = pytorch.torch_python(args.torch_venv)
    print(f"PyTorch's python: {python}", file=sys.stderr, flush=True)
    command = pytorch.torch_command(python, *matmul, "--matmul=torch")
    torch_matmul = attempt(
        "PyTorch matmul", lambda t: last_json(pytorch.timed(command, t, env=pytorch.torch_env())[1]), budget.share()
    )
    engine, theirs = runs(args, precisions, python, budget)
    text = report(args, started, precisions, {"tensorflow": tf_matmul, "torch": torch_matmul}, engine, theirs)
    print(text)
    if args.record:
        command = "python -m bench.gpu_table " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.results, "a") as f:
            f.write(f"\n## {started:%Y-%m-%d}: `{command.strip()}`\n\n{text}")
    failed = [
        r for r in (tf_matmul, torch_matmul, *engine.values(), *theirs.values()) if "failed" in r.get("error", "")
    ]
    return 1 if failed else 0


def runs(args, precisions, python, budget):
    """({precision: the engine's run}, {precision: PyTorch's run}), from what bench/pytorch.py prepares for both."""
    flags, extra = recipe(args), args.engine_flags.split()
    torch_device = "cuda" if args.device == "gpu" else "cpu"
    engine, theirs = {}, {}
    with tempfile.TemporaryDirectory() as data:
        prepare = [sys.executable, "-m", "bench.pytorch", f"--prepare={data}", *flags, *extra]  # both run them
        prepared = attempt("prepare", lambda t: {"wall": pytorch.timed(prepare, t)[0]}, budget.share())
        if "error" in prepared:  # nothing to start from: every row says why
            unprepared = {"error": f"not run: preparing what both sides share {prepared['error']}"}
            return dict.fromkeys(precisions, unprepared), dict.fromkeys(precisions, unprepared)
        for precision in precisions:
            theirs[precision] = attempt(
                f"PyTorch {pytorch.PRECISIONS[precision]}",
                lambda t: pytorch.torch_run(python, data, pytorch.PRECISIONS[precision], torch_device, t),
                budget.share(),
            )
        for precision in precisions:
            engine[precision] = attempt(
                f"engine {precision}", lambda t: pytorch.engine_run(flags, precision, extra, t), budget.share()
            )
    return engine, theirs


def report(args, started, precisions, matmuls, engine, theirs):
    """The text appended to the results: the header, the table of precisions, its columns' meaning, the matmuls."""
    tf_matmul, torch_matmul = matmuls["tensorflow"], matmuls["torch"]
    tf_version = tf_matmul.get("version") or version("tensorflow")
    torch_version = torch_matmul.get("version") or next(
        (r["details"]["torch"] for r in theirs.values() if "details" in r), "?"
    )
    gpu = gpu_description() if args.device == "gpu" else "none (--device=cpu)"
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    header = (
        f"{started:%Y-%m-%d}, GPU: {gpu}; CPU: {cpu_description()}; TensorFlow {tf_version}, PyTorch "
        f"{torch_version} (CUDA {torch_matmul.get('cuda') or '-'}), Python {platform.python_version()}; engine "
        f"{common.revision() or 'unknown'}; {minutes:.1f} min in all (budget {args.budget:.0f} s). The decoder: "
        f"{args.layers} layers, {args.dim} wide, {args.heads} heads, context {args.sequence_length}, batch "
        f"{args.batch}, AdamW, {args.steps} steps: `launch.py {' '.join(recipe(args) + args.engine_flags.split())}`."
    )
    table = "\n".join([HEADER, *(row(p, engine[p], theirs[p]) for p in precisions)])
    sides = {f"TensorFlow {tf_version}": tf_matmul, f"PyTorch {torch_version}": torch_matmul}
    return f"{header}\n\n{table}\n\n{COLUMNS}\n\n{matmul_rows(args.matmul_size, sides)}\n"


if __name__ == "__main__":
    sys.exit(main())
