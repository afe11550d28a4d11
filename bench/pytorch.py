"""The engine against PyTorch on the same decoder: the same weights, batches, optimizer and evaluation.

    python -m bench.pytorch                      # shakespeare_char, float32 and bfloat16, 3 pairs each (~17 min)
    python -m bench.pytorch --recipes=gpt_6x256 --repeats=5
    python -m bench.pytorch --record             # also appends the table to bench/RESULTS.md
    python -m bench.pytorch --precisions=mixed_bfloat16 --engine_flags="--jit_compile=true"   # the engine's flags

PyTorch is not a requirement of the engine: the first run makes a virtual environment of its own (.venv-torch,
BENCH_TORCH_VENV or --torch_venv) and installs BENCH_TORCH (default `torch==2.13.0`; on a machine without the CPU
wheel at hand, `BENCH_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"` avoids the CUDA
build) and NumPy.
BENCH_TORCH_PYTHON names a python with PyTorch to use instead, and a system python3 whose PyTorch sees a GPU is
used as it is. PyTorch's processes run without LD_LIBRARY_PATH and PYTHONPATH (and behind $TORCH_ENV where set),
which may put another build's CUDA libraries before PyTorch's own.

For each recipe, one engine process first writes what both sides share (bench/torch_gpt.py names it): the
initial weights of the engine's model, built as a run builds it, every training batch in the engine's order,
and the evaluation windows. Then each repeat runs, as whole processes timed from outside, `launch.py` with the
recipe's flags and bench/torch_gpt.py, alternating which goes first. A row gives each side's validation loss,
wall time (start-up, training, evaluation) and time per step (the engine's from its summary, which leaves out the
first round with its tracing and compiling; PyTorch's the median step after its first 20, or a shorter run's
first half; "-" where a side timed no step, and the ratio's cell says why), and the median and range of the paired
ratios engine / PyTorch: a busy neighbour moves the range more than the median.
"""

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import common

ROOT = common.ROOT
TORCH_SCRIPT = os.path.join(ROOT, "bench", "torch_gpt.py")
# The recipes: launch.py flags. gpt_6x256 is the larger decoder of the issue that asked for this comparison.
RECIPES = {
    "shakespeare_char": ["--flagfile=experiments/shakespeare_char.flags"],
    "gpt_6x256": [
        "--flagfile=experiments/shakespeare_char.flags",
        "--gpt_layers=6",
        "--gpt_dim=256",
        "--gpt_heads=8",
        "--sequence_length=128",
        "--train_steps=500",
    ],
}
# The engine's --precision and what PyTorch runs for it (bfloat16, float16: autocast, weights and AdamW in float32;
# float16 with GradScaler). The default compares the first two: mixed_float16 is slower than float32 on a CPU.
PRECISIONS = {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
DEFAULT_PRECISIONS = "float32,mixed_bfloat16"


def torch_python(venv):
    """A python that imports PyTorch: $BENCH_TORCH_PYTHON, else the system python3 if its PyTorch sees a GPU (a
    GPU machine's), else the virtual environment `venv` (made on first use)."""
    if os.environ.get("BENCH_TORCH_PYTHON"):
        return os.environ["BENCH_TORCH_PYTHON"]
    python3 = shutil.which("python3")
    cuda = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    found = python3 and subprocess.run(torch_command(python3, "-c", cuda), env=torch_env(), capture_output=True)
    return python3 if found and found.returncode == 0 else ensure_torch(venv)


def torch_command(python, *args):
    """A PyTorch process's command line: $TORCH_ENV first where it is set (`env -u LD_LIBRARY_PATH -u PYTHONPATH` on
    a machine whose TensorFlow is put on those paths: their stub CUDA libraries are not for PyTorch)."""
    return [*shlex.split(os.environ.get("TORCH_ENV", "")), python, *args]


def torch_env():
    """This environment without what puts another TensorFlow's libraries before PyTorch's own."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}


def ensure_torch(venv):
    """The PyTorch virtual environment's python, made and installed on first use (and again after an install
    that did not finish: the test is that it imports torch)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python) or subprocess.run([python, "-c", "import torch"], capture_output=True).returncode:
        print(f"making {venv} for PyTorch (once)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        spec = os.environ.get("BENCH_TORCH", "torch==2.13.0").split()
        subprocess.run([python, "-m", "pip", "install", "-q", *spec, "numpy"], check=True)
    return python


def prepare(argv, out):
    """Writes what both sides share for the run `argv` (launch.py flags) into `out`: run in an engine process."""
    import numpy as np
    import tensorflow as tf

    import launch
    from engine.cluster import distribute
    from engine.run import build

    launch._parse_flags(["launch.py", *argv])
    config = launch._config_from_flags()
    trainer = build.run(config, distribute.create_strategy(config.cluster), "weights")
    np.savez(os.path.join(out, "weights.npz"), **torch_names(trainer.models["model"]))
    train = iter(trainer.data.train_fn(tf.distribute.InputContext()))
    np.save(os.path.join(out, "batches.npy"), np.stack([next(train)["tokens"] for _ in range(config.train_steps)]))
    evals = list(trainer.data.eval_fn(tf.distribute.InputContext()).take(trainer.data.eval_steps))
    np.save(os.path.join(out, "eval_tokens.npy"), np.concatenate([b["tokens"] for b in evals]))
    np.save(os.path.join(out, "eval_weights.npy"), np.concatenate([b["weight"] for b in evals]).astype(np.float32))
    names = (
        "seed learning_rate beta_1 beta_2 epsilon weight_decay warmup_steps lr_schedule train_steps clip_norm "
        "initial_loss_scale loss_scale_growth_interval"
    )
    recipe = {name: getattr(config, name) for name in names.split()}
    recipe.update(
        vocabulary=len(trainer.task.info["vocabulary"]),
        sequence_length=config.sequence_length,
        layers=config.gpt_layers,
        heads=config.gpt_heads,
        dim=config.gpt_dim,
        eval_batch_size=config.per_eval_batch_size,
        global_batch_size=config.global_batch_size,
    )
    with open(os.path.join(out, "recipe.json"), "w") as f:
        json.dump(recipe, f)


def torch_names(model):
    """{bench/torch_gpt.py's parameter name: the engine model's initial value}, in Keras layout."""
    names = {"embed.weight": model.embed.embeddings, "position": model.position}
    parts = ("norm1", "qkv", "proj", "norm2", "mlp_in", "mlp_out")
    for i, block in enumerate(model.blocks):
        for part in parts:
            names.update(_layer(f"blocks.{i}.{part}", getattr(block, part)))
    names.update(_layer("norm", model.norm))
    names.update(_layer("head", model.head))
    return {name: variable.numpy() for name, variable in names.items()}


def _layer(prefix, layer):
    if hasattr(layer, "gamma"):  # a LayerNormalization
        return {f"{prefix}.weight": layer.gamma, f"{prefix}.bias": layer.beta}
    return {f"{prefix}.weight": layer.kernel, f"{prefix}.bias": layer.bias}


def timed(command, timeout=None, **kwargs):
    """(seconds, the process) of a command run to its end; a failure raises with its output's tail. After `timeout`
    seconds the command and every process it started are killed and subprocess.TimeoutExpired raised."""
    start = time.perf_counter()
    popen = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True, **kwargs
    )
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except BaseException:  # the timeout, or an interrupt: nothing it started (a compiler) may run on
        with contextlib.suppress(ProcessLookupError):  # its session: it and its children, ended or not
            os.killpg(popen.pid, signal.SIGKILL)
        popen.communicate()
        raise
    seconds = time.perf_counter() - start
    proc = subprocess.CompletedProcess(command, popen.returncode, stdout, stderr)
    if proc.returncode:
        raise RuntimeError(
            f"{' '.join(command)} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    return seconds, proc


def engine_run(argv, precision, extra=(), timeout=None):
    with tempfile.TemporaryDirectory() as workdir:
        command = [sys.executable, "launch.py", *argv, f"--precision={precision}", *extra, f"--workdir={workdir}"]
        seconds, proc = timed(command, timeout, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    choice = next((w for w in proc.stdout.split() if w.startswith("jit_compile=")), "jit_compile=?")
    result = dict(
        wall=seconds, loss=summary["eval"]["loss"], jit=choice.split("=", 1)[1], skipped=summary["skipped_steps"]
    )
    if summary["examples_per_sec"] is None:  # its every round traced (one round): no step of its own was timed
        return {**result, "note": "timed no step: its one round traced and compiled the step (more steps)"}
    return {**result, "step_ms": 1000 * summary["global_batch_size"] / summary["examples_per_sec"]}


def torch_run(python, data, precision, device="auto", timeout=None):
    command = torch_command(python, TORCH_SCRIPT, f"--data={data}", f"--precision={precision}", f"--device={device}")
    seconds, proc = timed(command, timeout, env=torch_env())
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = dict(wall=seconds, loss=result["validation_loss"], skipped=result["skipped_steps"], details=result)
    if result["step_ms"] is None:  # one step, its warm-up: none of its own was timed
        return {**out, "note": "timed no step: its one step was its warm-up (more steps)"}
    return {**out, "step_ms": result["step_ms"]}


def step_text(side):
    """A side's time a step for the progress line, or why it has none."""
    return f"{side['step_ms']:.1f} ms/step" if "step_ms" in side else side["note"]


def measure(recipe, precision, python, data, repeats, extra=()):
    """`repeats` pairs of whole processes, alternating which side goes first; `extra`: the engine's own flags."""
    pairs = []
    for r in range(repeats):
        sides = {}
        for side in ("engine", "torch") if r % 2 == 0 else ("torch", "engine"):
            if side == "engine":
                sides[side] = engine_run(RECIPES[recipe], precision, extra)
            else:
                sides[side] = torch_run(python, data, PRECISIONS[precision])
        sides["load"] = os.getloadavg()[0]
        pairs.append(sides)
        e, t = sides["engine"], sides["torch"]
        print(
            f"progress: {recipe} {precision} pair {r + 1}/{repeats}: engine {e['wall']:.1f} s "
            f"({step_text(e)}, loss {e['loss']:.4f}), PyTorch {t['wall']:.1f} s "
            f"({step_text(t)}, loss {t['loss']:.4f}), load {sides['load']:.1f}",
            file=sys.stderr,
            flush=True,
        )
    return pairs


def ratio_text(values):
    """The median of paired ratios and their range."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def row(recipe, precision, pairs, extra=()):
    e = [p["engine"] for p in pairs]
    t = [p["torch"] for p in pairs]

    def median(side, key):
        return statistics.median(s[key] for s in side)

    return (
        f"| {' '.join([recipe, *extra])} | {precision} (PyTorch: {PRECISIONS[precision]}) | {median(e, 'loss'):.4f} | "
        f"{median(t, 'loss'):.4f} | {median(e, 'wall'):.1f} | {median(t, 'wall'):.1f} | "
        f"{ratio_text([a['wall'] / b['wall'] for a, b in zip(e, t)])} | {' | '.join(step_cells(e, t))} | "
        f"{min(p['load'] for p in pairs):.1f}-{max(p['load'] for p in pairs):.1f} | {e[0]['jit']} |"
    )


def step_cells(engine, theirs):
    """The cells engine ms/step, PyTorch ms/step and their ratio over the pairs where both sides timed steps; "-"
    where a side timed none, and the ratio's cell says why."""

    def median(side):
        timed = [s["step_ms"] for s in side if "step_ms" in s]
        return f"{statistics.median(timed):.1f}" if timed else "-"

    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(engine, theirs) if "step_ms" in a and "step_ms" in b]
    notes = sorted(
        {
            f"{name} {s['note']}"
            for name, side in (("engine", engine), ("PyTorch", theirs))
            for s in side
            if "step_ms" not in s
        }
    )
    ratio = ratio_text(ratios) if ratios else "-"
    return median(engine), median(theirs), "; ".join([ratio, *notes]) if notes else ratio


HEADER = (
    "| recipe | precision | engine loss | PyTorch loss | engine wall s | PyTorch wall s | wall ratio (range) | "
    "engine ms/step | PyTorch ms/step | step ratio (range) | load | engine jit_compile |\n" + "|---" * 12 + "|"
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="shakespeare_char", help=f"comma-separated of {','.join(RECIPES)}")
    parser.add_argument("--precisions", default=DEFAULT_PRECISIONS, help=f"comma-separated of {','.join(PRECISIONS)}")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of processes per row")
    parser.add_argument(
        "--engine_flags",
        default="",
        help="more launch.py flags for the engine's runs, e.g. '--jit_compile=true'; what they change in the run "
        "(--train_steps, the batch, the model's sizes) PyTorch's runs follow",
    )
    parser.add_argument("--torch_venv", default=common.TORCH_VENV)
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--prepare", help=argparse.SUPPRESS)  # internal: the engine process that writes the data
    args, rest = parser.parse_known_args(argv)
    if args.prepare:
        return prepare(rest, args.prepare)
    recipes, precisions = args.recipes.split(","), args.precisions.split(",")
    for name, given, known in (("recipes", recipes, RECIPES), ("precisions", precisions, PRECISIONS)):
        if set(given) - set(known):
            parser.error(f"--{name}={','.join(given)}: choose from {','.join(known)}")
    extra = args.engine_flags.split()
    python = torch_python(args.torch_venv)
    started, load_before, lines = datetime.datetime.now(), os.getloadavg()[0], []
    for recipe in recipes:
        with tempfile.TemporaryDirectory() as data:
            # The engine's flags too: what they change (steps, batch, sizes, seed) both sides run.
            timed([sys.executable, "-m", "bench.pytorch", f"--prepare={data}", *RECIPES[recipe], *extra])
            for precision in precisions:
                pairs = measure(recipe, precision, python, data, args.repeats, extra)
                lines.append(row(recipe, precision, pairs, extra))
    header = (
        f"{started:%Y-%m-%d}, {common.machine()}, PyTorch {pairs[-1]['torch']['details']['torch']}, "
        f"engine {common.revision()}, "
        f"{(datetime.datetime.now() - started).total_seconds() / 60:.1f} min, load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after"
    )
    table = "\n".join([HEADER, *lines])
    print(f"{table}\n{header}")
    if args.record:
        command = "python -m bench.pytorch " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(common.RESULTS, "a") as f:
            f.write(f"\n## {started:%Y-%m-%d}: `{command.strip()}`\n\n{header}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
