"""The benchmark's table: a row per ratio bench/run.py measured, judged against the issue's targets.

A row is a dict with its id, measurement, value (a number), shown (the value as printed), target, result (PASS,
FALL SHORT, info, or ERROR when it could not be measured) and detail. Each group of rows has its function, in the
order the table shows them.
"""

from bench import decode, end_to_end
from bench.common import TINY, label, not_judged, row

# The targets: the engine at least this much faster than fit at its best.
SPEED_TARGETS = {"mlp_1024": 1.4, "mlp_256": 1.1, "resnet": 1.1, "transformer": 1.1}
ROOFLINE_TARGET = 0.9
BFLOAT16_TARGET = 1.25
HOST_OVERHEAD_TARGET_US = 50.0
INPUT_WAIT_TARGET = 0.05
MEMORY_TARGET = 1.1


def rows(results, models, quick=False):
    """The table of `results` (bench/run.py's measure) for `models`. `quick`: a row with a target says "not judged"
    instead of a verdict (see bench/run.py's quick_note)."""
    speed = results.get("speed", {})
    out = [
        *_speed(speed, models),
        *_roofline(speed, models),
        *_bfloat16_roofline(speed, models),
        *_matmuls(speed, models),
        *_precisions(speed, models),
        *_mirrored(results.get("mirrored", {}), models),
        *_overhead(speed),
        *_input(speed, models),
        *_memory(results.get("memory", {}), models),
    ]
    if "decode" in results:
        out.extend(decode.rows(results["decode"]))
    out.extend(end_to_end.rows(results.get("end_to_end", {}), models))
    if quick:  # windows of a step or two on models that compile longer than they run: no number means anything
        out = not_judged(out)
    return out


def _ms(seconds):
    return f"{seconds * 1e3:.3g} ms/step"


def _speed(speed, models):
    out = []
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
        out.append(
            row(
                f"speed/{name}",
                f"engine / best fit: {label(spec)}",
                r and r["engine_vs_fit"],
                lambda v: f"{v:.2f}x",
                f">= {target:.2f}x",
                lambda v, t=target: v >= t,
                detail,
            )
        )
    return out


def _roofline(speed, models):
    by_model, roof = speed.get("models", {}), speed.get("roofline")
    out = [
        row(
            "roofline/peak",
            f"{roof['dtype'] if roof else 'float32'} matmul peak (chained, best shape)",
            roof and roof["flops_per_sec"],
            lambda v: f"{v / 1e9:.1f} GFLOP/s",
            detail=roof and ", ".join(f"{k}: {v / 1e9:.1f}" for k, v in roof["by_shape"].items()) or "",
        )
    ]
    for name in [n for n in ("mlp_1024", "mlp_256") if n in models]:
        r = by_model.get(name)
        value = detail = None
        if r and roof:
            examples = r["global_batch_size"] / r["seconds_per_step"][r["engine_best"]]
            achieved = 6 * r["parameters"] * examples
            value = achieved / roof["flops_per_sec"]
            detail = f"6 x {r['parameters']:,} parameters x {examples:,.0f} examples/s = {achieved / 1e9:.1f} GFLOP/s"
        target = name == "mlp_1024"
        out.append(
            row(
                f"roofline/{name}",
                f"engine FLOP/s / matmul peak: {label(models[name])}",
                value,
                lambda v: f"{v:.0%}",
                f">= {ROOFLINE_TARGET:.0%}" if target else None,
                (lambda v: v >= ROOFLINE_TARGET) if target else None,
                detail or "",
            )
        )
    return out


def _bfloat16_roofline(speed, models):
    """CPUs only: mixed_bfloat16's ceiling, which bfloat16 units (AMX) raise far above float32's."""
    by_model, roof, bf16_roof = speed.get("models", {}), speed.get("roofline"), speed.get("roofline_bfloat16")
    if not bf16_roof:
        return []
    out = [
        row(
            "roofline/bfloat16_peak",
            "bfloat16 matmul peak (chained, best shape) / float32's",
            roof and bf16_roof["flops_per_sec"] / roof["flops_per_sec"],
            lambda v: f"{v:.2f}x",
            detail=f"{bf16_roof['flops_per_sec'] / 1e9:.1f} GFLOP/s: "
            + ", ".join(f"{k}: {v / 1e9:.1f}" for k, v in bf16_roof["by_shape"].items()),
        )
    ]
    for name in [n for n in ("mlp_1024",) if n in models]:
        r = by_model.get(name)
        per = r and r["precision_seconds_per_step"].get("mixed_bfloat16")
        value = detail = None
        if per:
            achieved = 6 * r["parameters"] * r["global_batch_size"] / per
            value = achieved / bf16_roof["flops_per_sec"]
            detail = f"6 x {r['parameters']:,} parameters x {r['global_batch_size'] / per:,.0f} examples/s"
        out.append(
            row(
                f"roofline/{name}/bfloat16",
                f"engine mixed_bfloat16 FLOP/s / bfloat16 matmul peak: {label(models[name])}",
                value,
                lambda v: f"{v:.0%}",
                detail=detail or "",
            )
        )
    return out


def _matmuls(speed, models):
    out = []
    by_model = speed.get("models", {})
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
        out.append(
            row(
                f"roofline/{name}/matmuls",
                f"its forward+backward matmuls alone / engine step: {label(models[name])}",
                value,
                lambda v: f"{v:.0%}",
                detail=detail or "",
            )
        )
    return out


def _precisions(speed, models):
    out = []
    by_model = speed.get("models", {})
    for name, spec in models.items():
        r = by_model.get(name)
        per = r and r["precision_seconds_per_step"]
        for precision in ("mixed_bfloat16", "mixed_float16"):
            value = per and per.get("float32") and per.get(precision) and per["float32"] / per[precision]
            bf16 = precision == "mixed_bfloat16"
            out.append(
                row(
                    f"precision/{name}/{precision}",
                    f"{precision} / float32 (engine): {label(spec)}",
                    value,
                    lambda v: f"{v:.2f}x",
                    f">= {BFLOAT16_TARGET:.2f}x" if bf16 else None,
                    (lambda v: v >= BFLOAT16_TARGET) if bf16 else None,
                    per and value and f"{precision} {_ms(per[precision])} vs float32 {_ms(per['float32'])}" or "",
                )
            )
    return out


def _mirrored(mirrored, models):
    out = []
    for name, spec in models.items():
        r = mirrored.get(name)
        detail = ""
        if r:
            s = r["seconds_per_step"]
            detail = f"jit={int(r['jit'])}: mirrored {_ms(s['mirrored'])} vs one_device {_ms(s['one_device'])}"
        # Information, not a target: two logical devices on the same cores measure their contention, not the
        # replica machinery (issue 14 retired the 0.9x target).
        out.append(
            row(
                f"mirrored/{name}",
                f"mirrored (2 logical devices on the same cores) / one_device: {label(spec)}",
                r and r["mirrored_vs_one_device"],
                lambda v: f"{v:.2f}x",
                detail=detail,
            )
        )
    return out


def _overhead(speed):
    tiny = speed.get("tiny")
    s = tiny and tiny["seconds_per_step"]
    out = [
        row(
            "overhead/host",
            f"host overhead per step at steps_per_loop=100: {label(TINY)}",
            tiny and tiny["host_seconds_per_step_at_100"] * 1e6,
            lambda v: f"{v:.1f} us",
            f"< {HOST_OVERHEAD_TARGET_US:.0f} us",
            lambda v: v < HOST_OVERHEAD_TARGET_US,
            tiny
            and f"host round trip {tiny['host_seconds_per_round'] * 1e6:.0f} us, once per steps_per_loop steps"
            or "",
        ),
        row(
            "overhead/graph",
            "in-graph time per step of that tiny model (engine)",
            tiny and tiny["graph_seconds_per_step"] * 1e6,
            lambda v: f"{v:.0f} us",
            detail=s
            and f"per step at steps_per_loop 1: {s['engine spl=1'] * 1e6:.0f} us, "
            f"at 100: {s['engine spl=100'] * 1e6:.0f} us"
            or "",
        ),
    ]
    if not s or "fit spe=100" in s:  # --quick leaves fit out here
        out.append(
            row(
                "overhead/fit",
                "the same model in fit, per step at steps_per_execution=100",
                s and s["fit spe=100"] * 1e6,
                lambda v: f"{v:.0f} us",
                detail=s and f"at steps_per_execution=1: {s['fit spe=1'] * 1e6:.0f} us" or "",
            )
        )
    return out


def _input(speed, models):
    out = []
    by_model = speed.get("models", {})
    for name, spec in models.items():
        r = by_model.get(name)
        out.append(
            row(
                f"input/{name}",
                f"step time waiting for input: {label(spec)}",
                r and r["input_wait_fraction"],
                lambda v: f"{v:.1%}",
                f"< {INPUT_WAIT_TARGET:.0%}",
                lambda v: v < INPUT_WAIT_TARGET,
                r and f"{r['engine_best']}, the same step fed one fixed batch vs its own input" or "",
            )
        )
    return out


def _memory(memory, models):
    out = []
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
        out.append(
            row(
                f"memory/{name}",
                f"peak RSS, engine / fit: {label(spec)}",
                value,
                lambda v: f"{v:.2f}x",
                f"<= {MEMORY_TARGET:.2f}x",
                lambda v: v <= MEMORY_TARGET,
                detail or "",
            )
        )
    return out
