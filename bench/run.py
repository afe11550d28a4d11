"""The engine's benchmark: one table of ratios, each measured side by side in one run.

    python -m bench.run                 # the full table (about 15 min on 2 idle CPU cores, 30 when shared)
    python -m bench.run --quick         # tiny models, one round: checks that it all still runs (~40 s); no verdicts
    python -m bench.run --record        # also appends the table to bench/RESULTS.md
    bash bench/gpu.sh                   # the same table on one NVIDIA GPU, mixed_float16 and XLA

Every ratio compares two things timed in the same process, in interleaved windows, on the same
model, data, batch and machine (see bench/worker.py); absolute times are printed for context only.
Peak memory needs one process per side. The targets come from the issue that asked for this table.
"""

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile

from bench import decode, end_to_end
from bench.common import (
    MODELS,
    PRECISIONS,
    QUICK_MODELS,
    RESULTS,
    ROOT,
    format_table,
    label,
    machine,
    revision,
    run_worker,
)

QUICK_DEFAULT = "mlp_1024"  # --quick measures one model unless --models says otherwise
# Host overhead: a model whose math costs next to nothing, so a step is all overhead.
TINY = dict(model="mlp", hidden_sizes=(16,), global_batch_size=16, synthetic_shape=(8,), synthetic_examples=256)

# The targets: the engine at least this much faster than fit at its best.
SPEED_TARGETS = {"mlp_1024": 1.4, "mlp_256": 1.1, "resnet": 1.1, "transformer": 1.1}
ROOFLINE_TARGET = 0.9
BFLOAT16_TARGET = 1.25
HOST_OVERHEAD_TARGET_US = 50.0
INPUT_WAIT_TARGET = 0.05
MEMORY_TARGET = 1.1


def settings(quick, gpu):
    """Everything the worker processes need to know, besides which models."""
    return dict(
        gpu=gpu,
        precision="mixed_float16" if gpu else "float32",
        precisions=PRECISIONS,
        jit=[False] if quick else [False, True],  # engine --jit_compile and fit jit_compile: XLA off, on
        steps_per_execution=[1, 50],
        # Windows of about window_s seconds, at most max_window_steps steps (the default steps_per_loop).
        # Many short windows: on a shared machine the fastest of many is the most repeatable number.
        window_s=0.05 if quick else 0.25,
        max_window_steps=100,
        rounds=1 if quick else 6,
        # After two rounds, fewer rounds for slow models; on a GPU compiling dominates: keep within 8 minutes.
        model_budget_s=None if quick else 20.0 if gpu else 40.0,
        matmul_shapes=[[64, 64]] if quick else [[256, 1024], [1024, 1024], [4096 if gpu else 2048] * 2],
        tiny=TINY,
        tiny_calls=20 if quick else 200,
        tiny_fit=not quick,  # fit on the tiny model too, for reference
        with_mirrored=quick,  # --quick: the mirrored comparison inside the speed process, one start-up less
    )


# ---------------------------------------------------------------------------------------------
# Running the worker processes.


def measure(models, quick, gpu, jobs):
    """Runs the worker processes; returns {"speed", "mirrored", "memory", "errors"}."""
    common = settings(quick, gpu)
    env = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"} if gpu else {}  # memory processes share the GPU
    results = {"errors": {}, "memory": {name: {} for name in models}}

    def attempt(key, fn):
        try:
            results[key] = fn()
        except Exception as e:  # a failed process costs its rows, not the table
            results["errors"][key] = str(e)
            print(f"[{key}] {e}", file=sys.stderr, flush=True)

    def speed():
        task = {"kind": "speed", "models": models, **common}
        attempt("speed", lambda: run_worker(task, "speed", env if quick else None))
        by_model = results.get("speed", {}).get("models", {})
        return {name: r["engine_best"].endswith("jit=1") for name, r in by_model.items()}

    def mirrored(jit_by_model):
        task = {"kind": "mirrored", "models": models, "jit_by_model": jit_by_model, **common}
        attempt("mirrored", lambda: run_worker(task, "mirrored"))

    def memory(name, side):
        # The configuration that was fastest; in --quick (run before the speeds are known) jit off.
        r = results.get("speed", {}).get("models", {}).get(name)
        best = dict(item.split("=") for item in r[f"{side}_best"].split()[1:]) if r else {"jit": "0", "spe": "50"}
        task = {
            "kind": "memory",
            "side": side,
            "spec": models[name],
            "precision": common["precision"],
            "jit": best["jit"] == "1",
            "steps_per_execution": int(best.get("spe", 1)),
            "steps": max(2, min(20, r["window_steps"])) if r else 2,
        }
        try:
            results["memory"][name][side] = run_worker(task, f"memory {name} {side}", env)
        except Exception as e:
            results["errors"][f"memory {name} {side}"] = str(e)

    memory_runs = [(name, side) for name in models for side in ("engine", "fit")]
    if quick:
        # A smoke test, not a measurement: everything at once.
        with concurrent.futures.ThreadPoolExecutor(len(memory_runs) + 2) as pool:
            futures = [pool.submit(speed)] + [pool.submit(memory, *run) for run in memory_runs]
            futures.append(pool.submit(lambda: end_to_end.measure_all(models, PRECISIONS, 1, quick=True)))
            concurrent.futures.wait(futures)
        results["end_to_end"] = futures[-1].result()
        results["mirrored"] = results.get("speed", {}).pop("mirrored", {})
        return results
    # Timed processes run alone, so nothing else competes for the cores while they measure;
    # peak memory is not timed, and those processes may share them.
    mirrored(speed())
    attempt("decode", decode_pipeline)
    results["end_to_end"] = end_to_end.measure_all(models, PRECISIONS, end_to_end.REPEATS)
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        concurrent.futures.wait([pool.submit(memory, *run) for run in memory_runs])
    return results


def decode_pipeline():
    """bench/decode.py's measurements (full mode only: it times its own windows, alone on the cores)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "decode.json")
        proc = subprocess.run(
            [sys.executable, "-m", "bench.decode", f"--json={out}"], cwd=ROOT, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"bench.decode failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------------
# The table.


def _ms(seconds):
    return f"{seconds * 1e3:.3g} ms/step"


def rows(results, models, quick=False):
    """The table: one dict per row with its id, measurement, value (a number), shown (the value as
    printed), target, result (PASS, FALL SHORT, info, or ERROR when it could not be measured) and detail.
    `quick`: a row with a target says "not judged" instead of a verdict (see quick_note)."""
    out = []

    def add(row_id, what, value, shown, target=None, passes=None, detail=""):
        row = dict(id=row_id, measurement=what, value=value, shown="n/a", target=target or "", detail=detail)
        if value is None or not math.isfinite(value):
            out.append({**row, "value": None, "result": "ERROR"})
            return
        verdict = "info" if passes is None else ("PASS" if passes(value) else "FALL SHORT")
        out.append({**row, "shown": shown(value), "result": verdict})

    speed = results.get("speed", {})
    by_model = speed.get("models", {})
    for name, spec in models.items():
        r = by_model.get(name)
        target = SPEED_TARGETS.get(name, 1.1)
        detail = ""
        if r:
            s = r["seconds_per_step"]
            detail = (
                f"{r['engine_best']} {_ms(s[r['engine_best']])} vs {r['fit_best']} {_ms(s[r['fit_best']])}, "
                f"windows of {r['window_steps']} step{'s' if r['window_steps'] != 1 else ''}"
            )
        add(
            f"speed/{name}",
            f"engine / best fit: {label(spec)}",
            r and r["engine_vs_fit"],
            lambda v: f"{v:.2f}x",
            f">= {target:.2f}x",
            lambda v, t=target: v >= t,
            detail,
        )

    roof = speed.get("roofline")
    add(
        "roofline/peak",
        f"{roof['dtype'] if roof else 'float32'} matmul peak (chained, best shape)",
        roof and roof["flops_per_sec"],
        lambda v: f"{v / 1e9:.1f} GFLOP/s",
        detail=roof and ", ".join(f"{k}: {v / 1e9:.1f}" for k, v in roof["by_shape"].items()) or "",
    )
    for name in [n for n in ("mlp_1024", "mlp_256") if n in models]:
        r = by_model.get(name)
        value = detail = None
        if r and roof:
            examples = r["global_batch_size"] / r["seconds_per_step"][r["engine_best"]]
            achieved = 6 * r["parameters"] * examples
            value = achieved / roof["flops_per_sec"]
            detail = f"6 x {r['parameters']:,} parameters x {examples:,.0f} examples/s = {achieved / 1e9:.1f} GFLOP/s"
        target = name == "mlp_1024"
        add(
            f"roofline/{name}",
            f"engine FLOP/s / matmul peak: {label(models[name])}",
            value,
            lambda v: f"{v:.0%}",
            f">= {ROOFLINE_TARGET:.0%}" if target else None,
            (lambda v: v >= ROOFLINE_TARGET) if target else None,
            detail or "",
        )

    bf16_roof = speed.get("roofline_bfloat16")
    if bf16_roof:  # CPUs: mixed_bfloat16's ceiling, which bfloat16 units (AMX) raise far above float32's
        add(
            "roofline/bfloat16_peak",
            "bfloat16 matmul peak (chained, best shape) / float32's",
            roof and bf16_roof["flops_per_sec"] / roof["flops_per_sec"],
            lambda v: f"{v:.2f}x",
            detail=f"{bf16_roof['flops_per_sec'] / 1e9:.1f} GFLOP/s: "
            + ", ".join(f"{k}: {v / 1e9:.1f}" for k, v in bf16_roof["by_shape"].items()),
        )
        for name in [n for n in ("mlp_1024",) if n in models]:
            r = by_model.get(name)
            per = r and r["precision_seconds_per_step"].get("mixed_bfloat16")
            value = detail = None
            if per:
                achieved = 6 * r["parameters"] * r["global_batch_size"] / per
                value = achieved / bf16_roof["flops_per_sec"]
                detail = f"6 x {r['parameters']:,} parameters x {r['global_batch_size'] / per:,.0f} examples/s"
            add(
                f"roofline/{name}/bfloat16",
                f"engine mixed_bfloat16 FLOP/s / bfloat16 matmul peak: {label(models[name])}",
                value,
                lambda v: f"{v:.0%}",
                detail=detail or "",
            )

    for name in [n for n in ("mlp_1024", "mlp_256") if n in models]:
        r = by_model.get(name)
        value = detail = None
        if r and "matmul_seconds_per_step" in r:
            value = r["matmul_seconds_per_step"] / r["precision_seconds_per_step"][r["precision"]]
            detail = (
                f"{_ms(r['matmul_seconds_per_step'])} of matmuls "
                f"({r['matmul_flops_per_step'] / r['matmul_seconds_per_step'] / 1e9:.1f} GFLOP/s) "
                f"in a {_ms(r['precision_seconds_per_step'][r['precision']])} engine step"
            )
        add(
            f"roofline/{name}/matmuls",
            f"its forward+backward matmuls alone / engine step: {label(models[name])}",
            value,
            lambda v: f"{v:.0%}",
            detail=detail or "",
        )

    for name, spec in models.items():
        r = by_model.get(name)
        per = r and r["precision_seconds_per_step"]
        for precision in ("mixed_bfloat16", "mixed_float16"):
            value = per and per.get("float32") and per.get(precision) and per["float32"] / per[precision]
            bf16 = precision == "mixed_bfloat16"
            add(
                f"precision/{name}/{precision}",
                f"{precision} / float32 (engine): {label(spec)}",
                value,
                lambda v: f"{v:.2f}x",
                f">= {BFLOAT16_TARGET:.2f}x" if bf16 else None,
                (lambda v: v >= BFLOAT16_TARGET) if bf16 else None,
                per and value and f"{precision} {_ms(per[precision])} vs float32 {_ms(per['float32'])}" or "",
            )

    mirrored = results.get("mirrored", {})
    for name, spec in models.items():
        r = mirrored.get(name)
        detail = ""
        if r:
            s = r["seconds_per_step"]
            detail = f"jit={int(r['jit'])}: mirrored {_ms(s['mirrored'])} vs one_device {_ms(s['one_device'])}"
        # Information, not a target: two logical devices on the same cores measure their contention, not the
        # replica machinery (issue 14 retired the 0.9x target).
        add(
            f"mirrored/{name}",
            f"mirrored (2 logical devices on the same cores) / one_device: {label(spec)}",
            r and r["mirrored_vs_one_device"],
            lambda v: f"{v:.2f}x",
            detail=detail,
        )

    tiny = speed.get("tiny")
    s = tiny and tiny["seconds_per_step"]
    add(
        "overhead/host",
        f"host overhead per step at steps_per_loop=100: {label(TINY)}",
        tiny and tiny["host_seconds_per_step_at_100"] * 1e6,
        lambda v: f"{v:.1f} us",
        f"< {HOST_OVERHEAD_TARGET_US:.0f} us",
        lambda v: v < HOST_OVERHEAD_TARGET_US,
        tiny and f"host round trip {tiny['host_seconds_per_round'] * 1e6:.0f} us, once per steps_per_loop steps" or "",
    )
    add(
        "overhead/graph",
        "in-graph time per step of that tiny model (engine)",
        tiny and tiny["graph_seconds_per_step"] * 1e6,
        lambda v: f"{v:.0f} us",
        detail=s
        and f"per step at steps_per_loop 1: {s['engine spl=1'] * 1e6:.0f} us, "
        f"at 100: {s['engine spl=100'] * 1e6:.0f} us"
        or "",
    )
    if not s or "fit spe=100" in s:  # --quick leaves fit out here
        add(
            "overhead/fit",
            "the same model in fit, per step at steps_per_execution=100",
            s and s["fit spe=100"] * 1e6,
            lambda v: f"{v:.0f} us",
            detail=s and f"at steps_per_execution=1: {s['fit spe=1'] * 1e6:.0f} us" or "",
        )

    for name, spec in models.items():
        r = by_model.get(name)
        add(
            f"input/{name}",
            f"step time waiting for input: {label(spec)}",
            r and r["input_wait_fraction"],
            lambda v: f"{v:.1%}",
            f"< {INPUT_WAIT_TARGET:.0%}",
            lambda v: v < INPUT_WAIT_TARGET,
            r and f"{r['engine_best']}, the same step fed one fixed batch vs its own input" or "",
        )

    memory = results.get("memory", {})
    for name, spec in models.items():
        r = memory.get(name, {})
        value = detail = None
        if "engine" in r and "fit" in r:
            value = r["engine"]["peak_rss"] / r["fit"]["peak_rss"]
            detail = (
                f"{r['engine']['peak_rss'] / 2**20:,.0f} MiB vs {r['fit']['peak_rss'] / 2**20:,.0f} MiB "
                f"(after imports: {r['engine']['baseline_rss'] / 2**20:,.0f} MiB)"
            )
            if "peak_gpu" in r["engine"]:
                detail += (
                    f"; GPU peak {r['engine']['peak_gpu'] / 2**20:,.0f} vs {r['fit']['peak_gpu'] / 2**20:,.0f} MiB"
                )
        add(
            f"memory/{name}",
            f"peak RSS, engine / fit: {label(spec)}",
            value,
            lambda v: f"{v:.2f}x",
            f"<= {MEMORY_TARGET:.2f}x",
            lambda v: v <= MEMORY_TARGET,
            detail or "",
        )
    if "decode" in results:
        out.extend(decode.rows(results["decode"]))
    out.extend(end_to_end.rows(results.get("end_to_end", {}), models))
    if quick:  # windows of a step or two on models that compile longer than they run: no number means anything
        out = [{**row, "result": "not judged"} if row["result"] in ("PASS", "FALL SHORT") else row for row in out]
    return out


def quick_note(results):
    """The line --quick prints above its table, saying why none of it is a result."""
    windows = [r["window_steps"] for r in results.get("speed", {}).get("models", {}).values()]
    steps = f"{min(windows)} step{'s' if min(windows) != 1 else ''}" if windows else "a few steps"
    return (
        f"--quick: a smoke test on tiny models, one round, timing windows of {steps}: it shows that every row "
        "still measures; no row is judged against its target (run without --quick for verdicts)"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one round: a smoke test, not a result")
    parser.add_argument(
        "--models", help=f"comma-separated subset of {','.join(MODELS)}; default: all ({QUICK_DEFAULT} with --quick)"
    )
    parser.add_argument("--gpu", action="store_true", help="mixed_float16 as the base precision (bench/gpu.sh)")
    parser.add_argument(
        "--jobs", type=int, default=max(2, min(8, (os.cpu_count() or 2) // 2)), help="memory processes at once"
    )
    parser.add_argument("--json", help="also write the raw measurements here")
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args(argv)

    catalog = QUICK_MODELS if args.quick else MODELS
    names = (args.models or (QUICK_DEFAULT if args.quick else ",".join(MODELS))).split(",")
    unknown = [n for n in names if n not in catalog]
    if unknown:
        parser.error(f"--models: unknown {','.join(unknown)}; choose from {','.join(catalog)}")
    models = {name: catalog[name] for name in names}

    started, load_before = datetime.datetime.now(), os.getloadavg()[0]
    results = measure(models, args.quick, args.gpu, args.jobs)
    table = rows(results, models, args.quick)
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.quick:
        print(quick_note(results))
    print(format_table(table))
    for key, error in results["errors"].items():
        print(f"error in {key}: {error.strip().splitlines()[-1] if error.strip() else ''}")
    # The load average says how much else ran: on a shared machine it is the noise behind every number.
    header = (
        f"{started:%Y-%m-%d}, {machine()}, engine {revision()}, {minutes:.1f} min, "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "results": results, "header": header}, f, indent=1)
    if args.record:
        with open(RESULTS, "a") as f:
            note = f"{quick_note(results)}\n\n" if args.quick else ""
            f.write(f"\n## {started:%Y-%m-%d}: `{command.strip()}`\n\n{header}\n\n{note}{format_table(table, True)}\n")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
