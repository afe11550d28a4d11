"""End to end: `launch.py` as a user runs it against Keras `fit` at its best, on every model and precision.

    python -m bench.end_to_end                      # bench/run.py's models x precisions (about 40 min on 2 cores)
    python -m bench.end_to_end --models=mlp_256 --precisions=float32 --repeats=5
    python -m bench.end_to_end --quick              # a tiny MLP, once: checks that it all runs

Each repeat runs, one after the other in fresh processes: the engine (`launch.py --dataset=synthetic ...` at its
default settings, so `--jit_compile=auto` chooses; the examples/s of its own summary.json, which leaves out the
first round with its tracing and compiling) and `fit` with XLA off and on, the engine first in even repeats and last
in odd ones (steps_per_execution 50, the same model, data pipeline, batch and optimizer; its first execution left
out alike). The row is the median (and the range) over the repeats of engine / fit, against the fit configuration
with the better median (not each repeat's faster fit, the better of two draws against the engine's one):
neighbours on a shared machine slow whichever side they meet, and alternating the sides spreads that over both. On
the MLPs the model's forward and backward matmuls alone, timed in their own process, give the share of the matmul
time the engine reaches end to end.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from bench import common

STEPS = {"mlp_1024": 600, "mlp_256": 2000, "resnet": 60, "transformer": 300}
STEPS_PER_LOOP = {"mlp_1024": 50, "mlp_256": 50, "resnet": 10, "transformer": 50}
QUICK = dict(
    model="mlp", hidden_sizes=(64, 64), global_batch_size=32, synthetic_shape=(8, 8, 1), synthetic_examples=256
)
TARGETS = {"mlp_256": 1.15}  # where per-step work outside the matmuls weighs more; every other row: 1.0
MATMUL_TARGET = 0.95  # the 1024-wide MLP in float32: fit reaches 92% of its matmuls there
REPEATS = 3


def engine_flags(spec, precision, steps, steps_per_loop, workdir):
    flags = [f"--{k}={','.join(map(str, v)) if isinstance(v, (tuple, list)) else v}" for k, v in spec.items()]
    return [
        "--dataset=synthetic",
        *flags,
        f"--precision={precision}",
        f"--train_steps={steps}",
        f"--steps_per_loop={steps_per_loop}",
        "--eval_every=0",
        f"--workdir={workdir}",
    ]


def engine_run(spec, precision, steps, steps_per_loop):
    """launch.py in a fresh process: examples/s and the input wait from its summary, its jit_compile choice."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        args = engine_flags(spec, precision, steps, steps_per_loop, os.path.join(tmp, "run"))
        proc = subprocess.run(
            [sys.executable, "launch.py", *args],
            cwd=common.ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"launch.py {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(tmp, "run", "summary.json")) as f:
            summary = json.load(f)
    if summary["examples_per_sec"] is None:  # one round, which traced and compiled the step: nothing timed
        raise RuntimeError(f"launch.py {' '.join(args)} timed no step: give more steps than --steps_per_loop")
    choice = re.search(r"jit_compile=(\S+) \((.*)\)$", proc.stdout, re.MULTILINE)
    return summary["examples_per_sec"], f"{choice[1]} ({choice[2]})" if choice else "?", summary["input_wait_fraction"]


def measure(name, spec, precision, repeats, steps, steps_per_loop, fit_jit=(False, True)):
    """One row's measurements: per repeat the engine's and each fit's examples/s."""
    out = {"engine": [], "input_wait": [], "fit": {int(j): [] for j in fit_jit}, "jit_choice": None}
    for r in range(repeats):
        # Which side goes first alternates: a neighbour that starts or stops mid-pair then favours neither.
        sides = ["engine", *fit_jit] if r % 2 == 0 else [*fit_jit, "engine"]
        for side in sides:
            if side == "engine":
                speed, out["jit_choice"], wait = engine_run(spec, precision, steps, steps_per_loop)
                out["engine"].append(speed)
                out["input_wait"].append(wait)
                continue
            task = dict(kind="fit", spec=spec, precision=precision, jit=side, steps_per_execution=50, steps=steps)
            result = common.run_worker(task, f"fit {name} {precision} jit={int(side)}")
            out["fit"][int(side)].append(result["examples_per_sec"])
        fits = ", ".join(f"fit jit={j} {v[r]:,.0f}" for j, v in out["fit"].items())
        print(
            f"progress: {name} {precision} repeat {r + 1}/{repeats}: engine {speed:,.0f} examples/s, {fits}",
            file=sys.stderr,
            flush=True,
        )
    if spec["model"] == "mlp":
        dtype = (
            "bfloat16" if precision == "mixed_bfloat16" else "float16" if precision == "mixed_float16" else "float32"
        )
        task = dict(kind="matmuls", spec=spec, dtype=dtype, steps=min(steps, 200), windows=5)
        out["matmuls"] = common.run_worker(task, f"matmuls {name} {dtype}")
    return out


def paired_ratios(r):
    """(jit, ratios): the fit configuration with the better median examples/s, and per repeat the engine's examples/s
    over that configuration's. Not over the faster fit of each repeat: that pits the engine's one process against
    the better of fit's two, and a process's speed varies from one process to the next (`fit` the most:
    bench/RESULTS.md), so the maximum of two draws would favour fit."""
    best = max(r["fit"], key=lambda j: statistics.median(r["fit"][j]))
    return best, [e / f for e, f in zip(r["engine"], r["fit"][best])]


def rows(results, models, quick=False):
    """bench/run.py table rows for `results[name][precision]`. `quick`: a smoke test's tiny MLP, measured once, stands
    in for the model it is named after: a row with a target says "not judged" instead of a verdict, as bench.run
    --quick's do."""
    table = []
    for name, by_precision in results.items():
        for precision, r in by_precision.items():
            what = f"{common.label(models[name])}, {precision}"
            if "error" in r:  # the row stays in the table, with the last line of what failed
                lines = r["error"].strip().splitlines()
                table.append(
                    common.row(
                        f"end_to_end/{name}/{precision}",
                        f"launch.py / best fit, end to end: {what}",
                        None,
                        "n/a",
                        detail=lines[-1] if lines else "",
                    )
                )
                continue
            table.append(_ratio_row(name, precision, r, what))
            if "matmuls" in r:
                table.append(_matmul_row(name, precision, r, what, models[name]["global_batch_size"]))
    if quick:
        table = common.not_judged(table)
    return table


def _ratio_row(name, precision, r, what):
    """launch.py / best fit: the median of the paired repeats, with each side's examples/s."""
    fits = {j: statistics.median(v) for j, v in r["fit"].items()}
    best, ratios = paired_ratios(r)
    ratio = statistics.median(ratios)
    target = TARGETS.get(name, 1.0)
    return common.row(
        f"end_to_end/{name}/{precision}",
        f"launch.py / best fit, end to end: {what}",
        ratio,
        f"{ratio:.2f}x",
        f">= {target:.2f}x",
        lambda v, t=target: v >= t,
        f"median of {len(ratios)} pairs, range {min(ratios):.2f}-{max(ratios):.2f} "
        f"({', '.join(f'{x:.2f}' for x in ratios)}): engine "
        f"{statistics.median(r['engine']):,.0f} examples/s, jit_compile={r['jit_choice']}; fit "
        + ", ".join(f"jit={j} {v:,.0f}" for j, v in fits.items())
        + f" (best jit={best}); {_input_wait_text(r.get('input_wait', []))}",
    )


def _input_wait_text(waits):
    """The engine's input wait per repeat. launch.py's summary has none (null) where it timed no wait: on a GPU or
    TPU, and under op determinism."""
    if any(w is None for w in waits):
        return "the engine's input wait was not timed (launch.py times it on CPUs only, not under --deterministic)"
    return f"the engine's steps waited for input {', '.join(f'{w:.1%}' for w in waits)} of the time"


def _matmul_row(name, precision, r, what, batch):
    """launch.py's examples/s over its model's matmuls alone (the MLPs)."""
    m = r["matmuls"]
    matmul_speed = batch / m["seconds_per_step"]
    share = statistics.median(r["engine"]) / matmul_speed
    best_fit = max(statistics.median(v) for v in r["fit"].values())
    target = name == "mlp_1024" and precision == "float32"
    return common.row(
        f"end_to_end/{name}/{precision}/matmuls",
        f"launch.py examples/s / its matmuls alone: {what}",
        share,
        f"{share:.0%}",
        f">= {MATMUL_TARGET:.0%}" if target else "",
        (lambda v: v >= MATMUL_TARGET) if target else None,
        f"matmuls alone {matmul_speed:,.0f} examples/s "
        f"({m['flops_per_step'] / m['seconds_per_step'] / 1e9:.0f} GFLOP/s); best fit reaches "
        f"{best_fit / matmul_speed:.0%}",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help=f"comma-separated: {','.join(common.MODELS)} (default: all)")
    parser.add_argument("--precisions", help=f"comma-separated: {','.join(common.PRECISIONS)} (default: all)")
    parser.add_argument("--repeats", type=int, help=f"alternations of engine and fit per row (default: {REPEATS})")
    parser.add_argument("--quick", action="store_true", help="a tiny MLP, float32, once: a smoke test")
    parser.add_argument("--steps", type=int, help="training steps of every run (default: per model, STEPS)")
    parser.add_argument("--json", help="also write the raw measurements here")
    args = parser.parse_args(argv)
    models, precisions = checked_args(parser, args)
    results = measure_all(models, precisions, args.repeats or REPEATS, args.quick, args.steps)
    table = rows(results, models, quick=args.quick)
    if args.quick:
        print(
            "--quick: a smoke test on a tiny MLP, once: it shows that every row still measures; no row is judged "
            "against its target (run without --quick for verdicts)"
        )
    print(common.format_table(table))
    print(common.machine())
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"rows": table, "results": results}, f, indent=1)
    return 1 if any(r["result"] == "ERROR" for r in table) else 0


def checked_args(parser, args):
    """({name: spec}, precisions) that the flags ask for; a flag --quick would not use, or a value no run can take,
    is refused in one line before anything runs."""
    if args.quick and (args.models or args.precisions or args.repeats is not None):
        parser.error("--quick measures a tiny MLP in float32 once: leave out --models, --precisions and --repeats")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be at least 1")
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps={args.steps}: must be at least 2 (the first round traces, the others are timed)")
    for flag, known in (("models", common.MODELS), ("precisions", common.PRECISIONS)):
        given = getattr(args, flag)
        unknown = [n for n in given.split(",") if n not in known] if given else []
        if unknown:
            parser.error(f"--{flag}: unknown {','.join(unknown)}; choose from {','.join(known)}")
    if args.quick:
        return {"mlp_1024": QUICK}, ["float32"]
    names = args.models.split(",") if args.models else list(common.MODELS)
    return {n: common.MODELS[n] for n in names}, args.precisions.split(",") if args.precisions else common.PRECISIONS


def measure_all(models, precisions, repeats, quick=False, steps=None):
    """{model: {precision: measurements}} for `models` ({name: spec}); a row that fails records its error.
    `quick`: float32 only, once, short runs, fit without XLA: a smoke test of the whole path."""
    if quick:
        precisions, repeats = ["float32"], 1
    results = {}
    for name, spec in models.items():
        runs, per_loop = (steps or 40, 10) if quick else (steps or STEPS[name], STEPS_PER_LOOP[name])
        for precision in precisions:
            try:
                fit_jit = (False,) if quick else (False, True)
                results.setdefault(name, {})[precision] = measure(
                    name, spec, precision, repeats, runs, min(per_loop, runs // 2), fit_jit
                )
            except Exception as e:  # a failed row costs that row, not the table
                results.setdefault(name, {})[precision] = {"error": str(e)}
    return results


if __name__ == "__main__":
    sys.exit(main())
