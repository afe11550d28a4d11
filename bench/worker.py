"""One benchmark process: `python -m bench.worker TASK.json RESULT.json`, started by bench/run.py.

Each task runs in its own process because logical CPU devices must be set before the first
TensorFlow op, and peak RSS only means something for a process that ran one thing. Inside a
process every comparison is side by side: the candidates are built and warmed up first (tracing and
compilation are never timed), then timed in interleaved rounds, one window each per round, so a
noisy neighbour slows all of them alike; each candidate keeps its fastest window (bench/runners.py).
"""

import json
import os
import resource
import sys
import time

from bench.runners import (  # they import TensorFlow where it is first needed: after the log level below
    Calls,
    EngineRunner,
    FitRunner,
    MatmulRunner,
    NoInput,
    collect,
    create_strategy,
    make_config,
    time_side_by_side,
    warm_up,
)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


STARTED = time.perf_counter()


def progress(message):
    """One line for bench/run.py to pass on, with the seconds since this process started."""
    print(f"progress: {time.perf_counter() - STARTED:6.0f} s {message}", flush=True)


def main(task_path, result_path):
    with open(task_path) as f:
        task = json.load(f)
    kinds = {"speed": speed, "mirrored": mirrored, "memory": memory, "fit": fit_run, "matmuls": matmuls}
    result = kinds[task["kind"]](task)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)


# ---------------------------------------------------------------------------------------------
# The speed process: roofline, engine vs fit, precisions, input wait, host overhead.


def speed(task):
    import tensorflow as tf

    if task["gpu"] and not tf.config.list_physical_devices("GPU"):
        raise RuntimeError("--gpu: TensorFlow sees no GPU")
    first = make_config(next(iter(task["models"].values())), strategy="one_device")
    if task.get("with_mirrored"):  # --quick: one process for both, so the two devices come first
        two = mirrored_strategies()
    strategy = create_strategy(first)
    out = {"roofline": roofline(task), "models": {}}
    progress(f"roofline: {out['roofline']['flops_per_sec'] / 1e9:.1f} GFLOP/s")
    if not task["gpu"]:  # mixed_bfloat16's ceiling: a CPU with bfloat16 units (AMX) multiplies far faster in it
        out["roofline_bfloat16"] = roofline(task, tf.bfloat16)
        progress(f"bfloat16 roofline: {out['roofline_bfloat16']['flops_per_sec'] / 1e9:.1f} GFLOP/s")
    for name, spec in task["models"].items():
        out["models"][name] = model_speed(task, spec, strategy)
        progress(f"speed {name}: engine / fit {out['models'][name]['engine_vs_fit']:.2f}")
    out["tiny"] = host_overhead(task, task["tiny"], strategy)
    out["devices"] = [d.name for d in tf.config.list_logical_devices()]
    if task.get("with_mirrored"):
        out["mirrored"] = mirrored(task, two)
    return out


def roofline(task, dtype=None):
    """Peak matmul FLOP/s in `dtype` (default: the compute dtype): a loop of chained (m, k) x (k, k) products."""
    import tensorflow as tf

    dtype = dtype or (tf.float16 if task["precision"] == "mixed_float16" else tf.float32)

    # On a GPU the loop runs inside XLA, so the host's loop control is not timed with the matmuls.
    @tf.function(jit_compile=task["gpu"])
    def chain(x, w, n):
        for _ in tf.range(n):
            x = tf.matmul(x, w)  # w is orthogonal: values neither blow up nor become denormal
        return tf.reduce_sum(tf.cast(x[0, :1], tf.float32))

    results = {}
    for m, k in task["matmul_shapes"]:
        w = tf.cast(tf.linalg.qr(tf.random.normal((k, k)))[0], dtype)
        x = tf.cast(tf.random.normal((m, k)), dtype)
        chain(x, w, tf.constant(2)).numpy()
        n = 2
        while True:  # grow the window to about task["window_s"]
            tic = time.perf_counter()
            chain(x, w, tf.constant(n)).numpy()
            seconds = time.perf_counter() - tic
            if seconds > task["window_s"] or n > 1e6:
                break
            n *= 2
        best = min(_timed(lambda: chain(x, w, tf.constant(n)).numpy()) for _ in range(task["rounds"]))
        results[f"{m}x{k}x{k}"] = 2.0 * m * k * k * n / best
    return {"flops_per_sec": max(results.values()), "by_shape": results, "dtype": dtype.name}


def _timed(fn):
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def model_speed(task, spec, strategy):
    """Engine (jit off/on) vs fit (steps_per_execution x jit) side by side; then, at the engine's best,
    the same trainer without input, and the other precisions."""
    base = make_config(spec, precision=task["precision"])
    runners, warm_steps = {}, {}
    for jit in task["jit"]:
        config = make_config(spec, precision=task["precision"], jit_compile=jit)
        runners[f"engine jit={int(jit)}"] = EngineRunner(config, strategy)
        for spe in task["steps_per_execution"]:
            runners[f"fit spe={spe} jit={int(jit)}"] = FitRunner(config, spe, jit)
    progress(f"{spec['model']}: built {len(runners)} candidates")
    for name, runner in runners.items():
        warm_steps[name] = warm_up(runner, task["window_s"], task["max_window_steps"])
        progress(f"{spec['model']}: warmed up {name}")
    # One window length for all, so every candidate amortizes its per-call cost alike.
    steps = dict.fromkeys(runners, min(warm_steps.values()))
    best = time_side_by_side(runners, steps, task["rounds"], task["model_budget_s"])
    engine_name = min((n for n in best if n.startswith("engine")), key=best.get)
    fit_name = min((n for n in best if n.startswith("fit")), key=best.get)
    engine = runners[engine_name]
    result = {
        "seconds_per_step": best,
        "window_steps": steps[engine_name],
        "engine_best": engine_name,
        "fit_best": fit_name,
        "engine_vs_fit": best[fit_name] / best[engine_name],
        "parameters": engine.parameters(),
        "precision": task["precision"],
        "global_batch_size": base.global_batch_size,
    }
    runners = None
    collect()

    # The other precisions, and input wait: the same trainer, the same compiled step, fed one fixed
    # batch instead of the iterator. Every runner is built before any is warmed up: building one
    # sets the global seed, which makes TensorFlow retrace every function traced before.
    runners = {"input": engine, "no input": NoInput(engine)}
    if spec["model"] == "mlp":
        runners["matmuls"] = MatmulRunner(spec, "float16" if task["precision"] == "mixed_float16" else "float32")
    for precision in task["precisions"]:
        if precision != task["precision"]:
            config = make_config(spec, precision=precision, jit_compile=engine.config.jit_compile)
            runners[precision] = EngineRunner(config, strategy)
    for name, runner in runners.items():
        if name == "input":
            runner.window(1)  # warm already; this re-instantiates what the new seed cleared
        else:
            warm_up(runner, task["window_s"], task["max_window_steps"])
    progress(f"{spec['model']}: warmed up {', '.join(runners)}")
    steps = dict.fromkeys(runners, steps[engine_name])
    second = time_side_by_side(runners, steps, task["rounds"], task["model_budget_s"])
    result["input_wait_fraction"] = 1.0 - second["no input"] / second["input"]
    if "matmuls" in second:
        result["matmul_seconds_per_step"] = second["matmuls"]
        result["matmul_flops_per_step"] = runners["matmuls"].flops
    result["precision_seconds_per_step"] = {task["precision"]: second["input"]}
    result["precision_seconds_per_step"].update({p: second[p] for p in task["precisions"] if p in second})
    runners = None
    collect()
    return result


def host_overhead(task, spec, strategy):
    """Round time T(n) = a + b n on a tiny model: a is the host's cost per round trip, b the in-graph
    cost per step. Measured at steps_per_loop 1 and 100, side by side; fit at the same two for reference."""
    config = make_config(spec, precision="float32")
    engine = EngineRunner(config, strategy)
    fits = {spe: FitRunner(config, spe, False) for spe in (1, 100)} if task["tiny_fit"] else {}
    for runner in (engine, *fits.values()):
        warm_up(runner, 0.1, 100)

    calls = task["tiny_calls"]
    runners = {
        "engine spl=1": Calls(engine, calls),
        "engine spl=100": Calls(engine, max(1, calls // 20), steps_per_call=100),
        **{f"fit spe={spe}": fit for spe, fit in fits.items()},
    }
    steps = {"engine spl=1": calls, "engine spl=100": 100 * max(1, calls // 20), "fit spe=1": 200, "fit spe=100": 200}
    best = time_side_by_side(runners, steps, task["rounds"])
    per_step = (best["engine spl=100"] * 100 - best["engine spl=1"]) / 99  # b
    per_round = best["engine spl=1"] - per_step  # a
    engine = fits = runners = None
    collect()
    return {
        "seconds_per_step": best,
        "host_seconds_per_round": per_round,
        "host_seconds_per_step_at_100": per_round / 100,
        "graph_seconds_per_step": per_step,
    }


# ---------------------------------------------------------------------------------------------
# The mirrored process: one_device vs mirrored over two logical devices on the same hardware.


def mirrored_strategies():
    """(one_device, mirrored over two logical devices of the same hardware); call before any other op."""
    import tensorflow as tf

    gpu = bool(tf.config.list_physical_devices("GPU"))
    config = make_config({}, strategy="mirrored", num_cpu_devices=2)
    two = create_strategy(config, gpu_mirrored=gpu)
    return tf.distribute.OneDeviceStrategy("/gpu:0" if gpu else "/cpu:0"), two


def mirrored(task, strategies=None):
    one, two = strategies or mirrored_strategies()
    out = {}
    for name, spec in task["models"].items():
        jit = task.get("jit_by_model", {}).get(name, False)
        if spec["model"] == "resnet":
            jit = False  # synchronized batch norm on two replicas cannot be compiled (the engine says so)
        config = make_config(spec, precision=task["precision"], jit_compile=jit)
        runners = {"one_device": EngineRunner(config, one), "mirrored": EngineRunner(config, two)}
        warm = [warm_up(r, task["window_s"], task["max_window_steps"]) for r in runners.values()]
        steps = dict.fromkeys(runners, min(warm))
        best = time_side_by_side(runners, steps, task["rounds"], task["model_budget_s"])
        out[name] = {
            "seconds_per_step": best,
            "mirrored_vs_one_device": best["one_device"] / best["mirrored"],
            "jit": jit,
            "replicas": two.num_replicas_in_sync,
        }
        progress(f"mirrored {name}: mirrored / one_device {out[name]['mirrored_vs_one_device']:.2f}")
        runners = None
        collect()
    return out


# ---------------------------------------------------------------------------------------------
# A memory process: one model, engine or fit, in the configuration that was fastest.


def memory(task):
    import psutil
    import tensorflow as tf

    spec = task["spec"]
    config = make_config(spec, precision=task["precision"], jit_compile=task["jit"])
    strategy = create_strategy(config)
    baseline = psutil.Process().memory_info().rss  # TensorFlow and Keras loaded, nothing built
    if task["side"] == "engine":
        runner = EngineRunner(config, strategy)
    else:
        runner = FitRunner(config, task["steps_per_execution"], task["jit"])
    warm_up(runner, 0.2, 100)
    runner.window(task["steps"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    out = {"peak_rss": peak, "baseline_rss": baseline}
    if tf.config.list_physical_devices("GPU"):
        out["peak_gpu"] = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    return out


def fit_run(task):
    """bench/end_to_end.py's fit side: `fit` as a user runs it, its first execution (tracing, compiling) left out
    as the engine's summary leaves out its first round; examples/s over `steps` more."""
    config = make_config(task["spec"], precision=task["precision"])
    create_strategy(config)
    runner = FitRunner(config, task["steps_per_execution"], task["jit"])
    runner.window(task["steps_per_execution"])
    seconds = runner.window(task["steps"])
    return {"examples_per_sec": task["steps"] * config.global_batch_size / seconds}


def matmuls(task):
    """An MLP's forward and backward matmuls alone in `dtype`: the best of `windows` windows of `steps` steps."""
    runner = MatmulRunner(task["spec"], task["dtype"])
    runner.window(2)
    best = min(runner.window(task["steps"]) for _ in range(task["windows"])) / task["steps"]
    return {"seconds_per_step": best, "flops_per_step": runner.flops}


if __name__ == "__main__":
    main(*sys.argv[1:3])
