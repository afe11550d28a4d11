"""The engine's benchmark: one table of ratios, each measured side by side in one run.

    python -m bench.run                 # the full table (about 15 min on 2 idle CPU cores, 30 when shared)
    python -m bench.run --quick         # tiny models, one round: checks that it all still runs (~40 s); no verdicts
    python -m bench.run --record        # also appends the table to bench/RESULTS.md
    python -m bench.run --gpu           # the same table on one NVIDIA GPU, mixed_float16 the base precision

Every ratio compares two things timed in the same process, in interleaved windows, on the same
model, data, batch and machine (see bench/worker.py); absolute times are printed for context only.
Peak memory needs one process per side. The targets come from the issue that asked for this table.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import tempfile

from bench import end_to_end, rows
from bench.common import (
    MODELS,
    PRECISIONS,
    QUICK_MODELS,
    RESULTS,
    ROOT,
    TINY,
    format_table,
    machine,
    revision,
    run_worker,
)

QUICK_DEFAULT = "mlp_1024"  # --quick measures one model unless --models says otherwise


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
    parser.add_argument("--gpu", action="store_true", help="mixed_float16 as the base precision, on one GPU")
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
    table = rows.rows(results, models, args.quick)
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
