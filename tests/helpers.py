"""Shared by the tests and by the worker processes they start (tests/mw_worker.py)."""

import dataclasses
import glob
import io
import json
import os
import re
import shutil
import subprocess
import time

import numpy as np

from engine.cluster.launcher import free_ports
from tests import forkserver


class Terminal(io.StringIO):
    """A console stream that says it is a terminal (a run then draws its live progress line)."""

    def isatty(self):
        return True


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The documentation pages, as a reader meets them: the README, BUILD.md, then docs/ by name.
DOC_PAGES = ["README.md", "BUILD.md", *sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")))]

# Small, fast runs of real training; each test overrides what it is about. Without XLA: compiling a small model's
# step takes 3 to 7 CPU-seconds, most of a 20-step run's time, and XLA's persistent cache cannot serve a test that
# traces the same step again in its process (the traced function's name, new at every trace, is in the cache's
# key); tests/test_parity.py, tests/test_jit_auto.py, and the runs below on XLA_CASE train the step XLA compiles,
# as --jit_compile=auto gives it to a dense model on a CPU.
TEST_DEFAULTS = dict(
    global_batch_size=64,
    hidden_sizes=(32, 32),
    jit_compile="false",
    resnet_depth=8,
    resnet_width=4,
    steps_per_loop=10,
    train_steps=20,
)
XLA_CASE = dict(jit_compile="auto")

# The parity cases: every optimizer with clipping active, and the ResNet with batch norm. Clipping hides the
# gradient's scale (a gradient twice too large clips to the same step): SGD also runs unclipped. Each as auto gives
# it (XLA for the dense models on a CPU, not for the ResNet's convolutions).
PARITY_CASES = {
    name: {**XLA_CASE, **case}
    for name, case in {
        "sgd": dict(optimizer="sgd", learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, clip_norm=0.2),
        "sgd_unclipped": dict(optimizer="sgd", learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        "adamw": dict(optimizer="adamw", learning_rate=3e-3, weight_decay=1e-2, clip_norm=0.2, warmup_steps=5),
        "lamb": dict(optimizer="lamb", learning_rate=1e-2, weight_decay=1e-2, clip_norm=0.2, lr_schedule="cosine"),
        "resnet": dict(
            model="resnet", resnet_width=16, optimizer="sgd", learning_rate=0.001, momentum=0.9, clip_norm=0.5
        ),
    }.items()
}

# A float16 run whose loss scale halves on the poisoned step and doubles back after two finite steps.
NONFINITE_CASE = dict(**XLA_CASE, precision="mixed_float16", loss_scale_growth_interval=2, initial_loss_scale=1024.0)


def make_config(data_dir, workdir="unused", **overrides):
    from engine.settings.config import validate
    from engine.settings.fields import Config

    return validate(Config(**{**TEST_DEFAULTS, "data_dir": data_dir, "workdir": workdir, **overrides}))


def as_flags(settings):
    """launch.py's command line for the settings `settings` ({name: value}), which validate(Config(**settings))
    builds in this process: a test's reference run trains in-process what a launch.py run trains, without the
    start-up of another TensorFlow process. Settings no part of the run reads (TEST_DEFAULTS' resnet_depth on an MLP
    run) are left out: launch.py refuses them typed on its command line."""
    from engine.settings.config import validate
    from engine.settings.fields import Config, applies, show

    config = validate(Config(**settings))
    return [f"--{name}={show(value)}" for name, value in settings.items() if applies(name, config)]


def in_process_run(settings):
    """The run `launch.py *as_flags(settings)` trains, trained in this process (its Config, and its strategy as
    launch.py builds it); returns its summary."""
    from engine.run import loop
    from engine.settings.config import validate
    from engine.settings.fields import Config

    return loop.train(validate(Config(**settings)))


def local_values(strategy, variable):
    """Every local replica's copy of a variable, as numpy arrays."""
    return [v.numpy() for v in strategy.experimental_local_results(variable)]


def all_variables(trainer):
    """{name: variable}: model weights as weight/i, the model's other state (batch-norm statistics) as
    state/i, optimizer slots as slot/i, the update counter, and the loss-scale state in float16."""
    named = {f"{'weight' if v.trainable else 'state'}/{i}": v.value for i, v in enumerate(trainer.model.variables)}
    named.update(
        {f"slot/{i}": s for i, s in enumerate(s for per_param in trainer.plans[0].optimizer.slots for s in per_param)}
    )
    named["iterations"] = trainer.plans[0].optimizer.iterations
    if trainer.program.float16:
        named.update(scale=trainer.plans[0].loss_scale.scale, good_steps=trainer.plans[0].loss_scale.good_steps)
    return named


def snapshot(trainer):
    """{name: [replica copies]} of all_variables."""
    return {name: local_values(trainer.strategy, v) for name, v in all_variables(trainer).items()}


def updates_snapshot(run):
    """{name: [replica copies]} of a run of several models and updates (a GAN's): every model's variables by
    <model>/<path>, each update's optimizer slots and update count."""
    named = {f"{name}/{v.path}": v.value for name, model in run.models.items() for v in model.variables}
    for plan in run.plans:
        for path, slots in plan.optimizer.slots_by_path.items():
            named.update({f"{plan.name}/{path}/{k}": slot for k, slot in enumerate(slots)})
        named[f"{plan.name}/iterations"] = plan.optimizer.iterations
    return {name: local_values(run.strategy, v) for name, v in named.items()}


def leaky_mlp(pairs, x, output):
    """A reference's dense layers as (kernel, bias) pairs: leaky ReLU (0.2) after each but the last, `output` after
    it (the MLP networks of tasks/gan.py, written out)."""
    import tensorflow as tf

    for kernel, bias in pairs[:-1]:
        x = tf.nn.leaky_relu(x @ kernel + bias, alpha=0.2)
    kernel, bias = pairs[-1]
    return output(x @ kernel + bias)


def train_and_snapshot(config, strategy):
    from engine.run import build

    trainer = build.run(config, strategy)
    out = trainer.program.run_steps(trainer.program.train_iterator(), config.train_steps)
    return snapshot(trainer), out


def train_and_snapshot_updates(config, strategy):
    """A run of several models and updates (a GAN's) trained config.train_steps steps: (its updates_snapshot, the
    round's outputs, the trainer, its models' trainable weights before the first step {model: [arrays]})."""
    from engine.run import build

    trainer = build.run(config, strategy)
    initial = {name: [v.numpy() for v in model.trainable_variables] for name, model in trainer.models.items()}
    out = trainer.program.run_steps(trainer.program.train_iterator(), config.train_steps)
    return updates_snapshot(trainer), out, trainer, initial


def step_function(trainer):
    """A tf.function running one replica step of `trainer` on a batch; returns the first replica's outputs."""
    import tensorflow as tf

    strategy = trainer.strategy

    @tf.function
    def run(batch):
        out = strategy.run(trainer.program.train_step, args=(batch,))
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], out)

    return run


def one_step(trainer, batch):
    """One replica step of `trainer` on `batch`; its outputs as numpy."""
    return {k: np.array(v) for k, v in step_function(trainer)(batch).items()}


def nonfinite_scenario(config, strategy, bad_replica):
    """One step where only `bad_replica` sees a NaN input, then `growth` finite steps.

    Returns snapshots before and after the bad step, after the finite steps, and each step's outputs.
    """
    import tensorflow as tf

    from engine.run import build

    trainer = build.run(config, strategy)
    whole = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))

    def batch(poison):
        def per_replica(ctx):
            part = {k: v[: config.global_batch_size // strategy.num_replicas_in_sync] for k, v in whole.items()}
            if poison and ctx.replica_id_in_sync_group == bad_replica:
                part["image"] = tf.tensor_scatter_nd_update(part["image"], [[0, 0, 0, 0]], [float("nan")])
            return part

        return strategy.experimental_distribute_values_from_function(per_replica)

    run = step_function(trainer)
    before = snapshot(trainer)
    bad_out = run(batch(poison=True))
    after_bad = snapshot(trainer)
    good_outs = [run(batch(poison=False)) for _ in range(config.loss_scale_growth_interval)]
    after_good = snapshot(trainer)
    as_numpy = lambda out: {k: np.array(v) for k, v in out.items()}  # noqa: E731
    return before, after_bad, after_good, as_numpy(bad_out), [as_numpy(o) for o in good_outs]


def bash_blocks(text):
    """The lines of each ```bash block of the Markdown `text` as CommonMark parses it, `\\` continuations joined:
    one list per block."""
    from markdown_it import MarkdownIt

    return [
        token.content.replace("\\\n", " ").splitlines()
        for token in MarkdownIt("commonmark").parse(text)
        if token.type == "fence" and token.info.strip() == "bash"
    ]


def logged_steps(workdir, name="metrics.jsonl"):
    """The steps a run logged to workdir/name so far ([] before the file exists)."""
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def checkpoint_tensors(workdir):
    """(path, {name: value}) of the newest checkpoint in workdir/checkpoints, its save counter left out."""
    import tensorflow as tf

    from engine.state import checkpoint

    path = checkpoint.latest(os.path.join(workdir, "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    return path, {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if "save_counter" not in k}


def by_path(tensors, kind, model="model"):
    """{Keras variable path: value} of `model`'s variables among checkpoint `tensors` (checkpoint_tensors): kind
    "models" for its weights, "ema" for their moving averages."""
    from engine.state import checkpoint

    prefix = f"{kind}/{model}/"
    return {checkpoint.describe_key(k.split("/")[2]): v for k, v in tensors.items() if k.startswith(prefix)}


def copy_checkout(destination, root=None):
    """Copies what launch.py reads of the checkout at `root` (this one) to `destination`, as a fork holds it: no
    tests or runs, nothing hidden (.git, the virtual environments .venv and .venv-torch, .gpu's packed TensorFlow,
    caches: a gigabyte and more where .ci/run made .venv-torch in the checkout, copied into every fork a test made)."""

    def left_out(directory, names):
        return [n for n in names if n.startswith(".") or n in ("runs", "tests", "__pycache__") or ".egg-info" in n]

    shutil.copytree(root or ROOT, destination, ignore=left_out)
    return destination


def without_xla_cache():
    """Environment variables for a process whose files may not grow (a full disk, RLIMIT_FSIZE): the test session's
    XLA cache (tests/conftest.py) left out, since writing a compiled program there would fail before what the
    test is about."""
    flags = os.environ.get("TF_XLA_FLAGS", "").split()
    return {"TF_XLA_FLAGS": " ".join(f for f in flags if not f.startswith("--tf_xla_persistent_cache_directory"))}


def launch(*args, env=None, timeout=300):
    """Runs `python launch.py *args` from the repository root; returns the CompletedProcess (text output)."""
    return forkserver.run(
        ["launch.py", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def start_launch(workdir, *args, env=None, **popen):
    """Starts `python launch.py --workdir=workdir *args`; returns its Popen (text output, piped)."""
    return forkserver.popen(
        ["launch.py", f"--workdir={workdir}", *args],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        **popen,
    )


def kill_after(proc, workdir, step, timeout=180):
    """SIGKILLs `proc` as soon as metrics.jsonl shows `step`; returns the last step it logged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        steps = logged_steps(workdir)
        if steps and steps[-1] >= step:
            proc.kill()
            proc.communicate()
            return logged_steps(workdir)[-1]
        time.sleep(0.02)
    raise AssertionError(f"the run ended or stalled before step {step}: {proc.communicate()}")


def straight_and_killed(tmp_path, settings, step, capsys, timeout=180):
    """The run of `settings` twice: straight through in this process (tmp_path/straight), and by launch.py SIGKILLed
    once metrics.jsonl shows `step`, then resumed in this process (tmp_path/killed): launch.py's Config and strategy
    for the same flags. Returns (the killed process's return code, the last step it logged, the step the restart
    resumed from, the straight workdir, the killed one)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    in_process_run({**settings, "workdir": str(straight)})
    proc = start_launch(killed, *as_flags(settings))
    stopped = kill_after(proc, killed, step, timeout)
    capsys.readouterr()
    in_process_run({**settings, "workdir": str(killed)})
    resumed = int(re.search(r"resumed from step (\d+)", capsys.readouterr().out).group(1))
    return proc.returncode, stopped, resumed, straight, killed


def run_workers(args, count, timeout, env=None):
    """Runs `python *args` as `count` multi-worker processes on localhost; returns their CompletedProcess-like
    (returncode, output) pairs. Kills them all on timeout."""
    cluster = {"worker": [f"localhost:{p}" for p in free_ports(count)]}
    procs = []
    for index in range(count):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        worker_env = {**os.environ, **(env or {}), "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "3"}
        procs.append(
            forkserver.popen(
                list(args),
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, output))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def config_dict(config):
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def bench_measurements(engine_vs_fit=1.41, peak_rss_engine=105):
    """bench/worker.py's measurements for mlp_1024, every part measured: the engine `engine_vs_fit` times fit's
    speed, its peak memory `peak_rss_engine` against fit's 100."""
    speed = {
        "engine_best": "engine jit=1",
        "fit_best": "fit spe=50 jit=1",
        "seconds_per_step": {"engine jit=1": 0.01, "fit spe=50 jit=1": 0.01 * engine_vs_fit},
        "engine_vs_fit": engine_vs_fit,
        "window_steps": 1,
        "parameters": 1000,
        "precision": "float32",
        "matmul_seconds_per_step": 0.005,
        "matmul_flops_per_step": 1e6,
        "global_batch_size": 256,
        "input_wait_fraction": 0.01,
        "precision_seconds_per_step": {"float32": 0.01, "mixed_bfloat16": 0.008, "mixed_float16": 0.02},
    }
    return {
        "speed": {
            "models": {"mlp_1024": speed},
            "roofline": {"flops_per_sec": 1.6e8, "by_shape": {"1024x1024x1024": 1.0}, "dtype": "float32"},
            "tiny": {
                "seconds_per_step": {"engine spl=1": 1e-3, "engine spl=100": 2e-4},
                "host_seconds_per_round": 1e-3,
                "host_seconds_per_step_at_100": 1e-5,
                "graph_seconds_per_step": 2e-4,
            },
        },
        "mirrored": {
            "mlp_1024": {
                "jit": False,
                "seconds_per_step": {"one_device": 0.01, "mirrored": 0.02},
                "mirrored_vs_one_device": 0.5,
            }
        },
        "memory": {"mlp_1024": {"engine": {"peak_rss": peak_rss_engine, "baseline_rss": 1}, "fit": {"peak_rss": 100}}},
        "end_to_end": {"mlp_1024": {"float32": {"engine": [100.0], "fit": {0: [80.0]}, "jit_choice": "false"}}},
        "errors": {},
    }


def tensorboard_values(directory, keep):
    """{tag: {step: array}} of the TensorBoard values in the events files of `directory` (a run's train/) for which
    `keep(value)` holds."""
    import tensorflow as tf

    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if keep(value):
                    found.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor)
    return found
