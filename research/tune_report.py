"""tune_report.png (research/tune.py's picture of a study): the objective per trial, the learning curves that pruning
judged, the parameters' importance, and a parallel-coordinates view of the complete trials. Matplotlib is imported
where the figure is drawn: it takes a second."""

import io
import math

import numpy as np
import optuna

from engine.settings.fields import show
from engine.state.files import write_text


def plot(path, config, trials, space, best, importances, objective, direction):
    """Writes tune_report.png (see figure), never through a link planted at the name."""
    buffer = io.BytesIO()
    figure(config, trials, space, best, importances, objective, direction).savefig(buffer, dpi=80, format="png")
    write_text(path, buffer.getvalue())


def figure(config, trials, space, best, importances, objective, direction):
    """tune_report.png as a matplotlib Figure: the objective per trial with the best so far, the learning curves
    that pruning judged, the parameters' importance (panels labelled history, curves, importance) and, below, a
    parallel-coordinates view of the complete trials (coordinates, with its colorbar when their values differ)."""
    from matplotlib.figure import Figure  # deferred: matplotlib takes a second to import

    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    values = [t.value for t in complete]
    tied = len(complete) > 1 and min(values) == max(values)
    metric = f"{config.validation_split} {objective}"
    fig = Figure(figsize=(18, 11), layout="constrained")
    grid = fig.add_gridspec(2, 3)
    history, curves, importance = (
        fig.add_subplot(grid[0, i], label=n) for i, n in enumerate(("history", "curves", "importance"))
    )
    coords = fig.add_subplot(grid[1, :], label="coordinates")  # the whole width, so eight axes' names fit
    tie = f"; all {len(complete)} complete trials tied at {values[0]:.4g}" if tied else ""
    fig.suptitle(
        f"study '{config.tune_study}': {len(complete)} complete, {len(pruned)} pruned ({direction} {metric}){tie}"
    )
    odd = collapsed(values, direction)
    apart = [t for t in complete if t.value in odd]
    _history(history, [t for t in complete if t not in apart], pruned, metric, direction)
    _curves(curves, complete, pruned, best, metric)
    shown = [t for t in trials if t not in apart]
    drawn = [t.value for t in shown if t in complete] + [v for t in shown for v in t.intermediate_values.values()]
    drawn = [v for v in drawn if math.isfinite(v)]  # a trial may report a NaN or an infinity
    for ax in (history, curves):
        low, high = ax.get_ylim()
        if apart and drawn:  # fitted to the other trials, as the colour scale is: a collapsed one is marked apart
            margin = 0.05 * ((max(drawn) - min(drawn)) or abs(max(drawn)) or 1.0)
            low, high = min(drawn) - margin, max(drawn) + margin
        # Margins must not cross 0 or 1 where no value does: an accuracy past 1, a negative loss or error.
        if drawn and min(drawn) >= 0:
            low = max(low, 0.0)
        if drawn and max(drawn) <= 1:
            high = min(high, 1.0)
        ax.set_ylim(low, high)
    _mark_apart(history, curves, apart)
    _importance(importance, importances, complete, tied)
    _parallel_coordinates(fig, coords, complete, space, best, metric, direction)
    return fig


def _history(ax, complete, pruned, metric, direction):
    from matplotlib.ticker import MaxNLocator

    ax.scatter([t.number for t in complete], [t.value for t in complete], label="complete", zorder=3, clip_on=False)
    last = [(t.number, t.intermediate_values[max(t.intermediate_values)]) for t in pruned if t.intermediate_values]
    if last:
        ax.scatter(*zip(*last), marker="x", color="tab:red", label="pruned (last evaluation)", zorder=3)
    better = max if direction == "max" else min
    best_so_far, xs = [], []
    for t in sorted(complete, key=lambda t: t.number):
        best_so_far.append(t.value if not best_so_far else better(best_so_far[-1], t.value))
        xs.append(t.number)
    if xs:
        ax.step(xs, best_so_far, where="post", color="tab:green", label="best so far")
    ax.set(title="objective per trial", xlabel="trial", ylabel=metric)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # there is no trial 2.5
    ax.legend()


def _mark_apart(history, curves, apart):
    """The collapsed trials, which the axes fitted to the others may leave out: a grey arrowhead at the edge of the
    objective panel, pointing to where the trial's value lies (a grey point where it is within the axis), with its
    number and value; both panels' titles say so."""
    if not apart:
        return
    low, high = history.get_ylim()
    where = []
    for t in apart:
        if low <= t.value <= high:  # within the other trials' early evaluations: drawn where it is, in grey
            y, marker, offset, place = t.value, "o", 8, "grey"
        else:
            below = t.value < low or math.isnan(t.value)
            y, marker, offset = (low, "v", 8) if below else (high, "^", -14)
            place = "below the axis" if below else "above the axis"
        history.scatter([t.number], [y], marker=marker, color="0.6", zorder=4, clip_on=False)
        history.annotate(
            f"trial {t.number}: {t.value:.4g}",
            (t.number, y),
            xytext=(0, offset),
            textcoords="offset points",
            ha="center",
            color="0.4",
            fontsize=8,
        )
        where.append(f"trial {t.number} at {t.value:.4g}, {place}")
    note = f"{len(apart)} collapsed: {'; '.join(where)}"
    history.set_title(f"objective per trial\n{note}")
    curves.set_title(f"evaluations during training\n{note}")


def _curves(ax, complete, pruned, best, metric):
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    styles = {
        "complete": dict(color="tab:blue", linestyle="-", marker="o", markersize=3, linewidth=1, alpha=0.6),
        "pruned": dict(color="tab:red", linestyle="--", marker="x", markersize=6, linewidth=1, alpha=0.6),
        "best": dict(color="tab:green", linestyle="-", marker="o", markersize=4, linewidth=2.5),
    }
    counts = dict.fromkeys(styles, 0)
    for state, group in (("complete", complete), ("pruned", pruned)):
        for t in group:
            points = dict(t.intermediate_values)
            if state == "complete" and t.user_attrs.get("steps"):
                points[t.user_attrs["steps"]] = t.value  # the final evaluation, which is no intermediate report
            kind = "best" if best is not None and t.number == best.number else state
            if points:
                steps = sorted(points)
                ax.plot(steps, [points[s] for s in steps], gid=kind, **styles[kind])
                counts[kind] += 1
    ax.set(title="evaluations during training", xlabel="step", ylabel=metric)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    handles = [Line2D([], [], label=f"{kind} ({n})", **styles[kind]) for kind, n in counts.items() if n]
    if handles:
        ax.legend(handles=handles)


def _importance(ax, importances, complete, tied):
    if importances:
        names = list(importances)[::-1]
        bars = ax.barh(names, [importances[n] for n in names])
        ax.bar_label(bars, fmt="%.2f", padding=2)
        ax.set(
            title=f"parameter importance (PED-ANOVA over {len(complete)} complete trials)",
            xlabel="share of the importance",
            xlim=(0, 1.15 * max(importances.values())),  # room for the labels
        )
    else:
        ax.text(0.5, 0.5, _no_importance(complete, tied), ha="center", va="center")
        ax.set(title="parameter importance", xticks=[], yticks=[])


def collapsed(values, direction):
    """The values of `values` (complete trials' objectives) that collapsed, a diverged loss or an accuracy at chance:
    worse than Tukey's far-out fence (3 interquartile ranges past the worse quartile) and farther from the nearest
    other value than the others' whole range. Drawn apart, they leave the colour scale to the others."""
    if len(values) < 4:  # quartiles of three values say nothing about which is odd
        return []
    low, high = np.percentile(values, [25, 75])
    fence = low - 3 * (high - low) if direction == "max" else high + 3 * (high - low)
    out = [v for v in values if (v < fence if direction == "max" else v > fence)]
    kept = [v for v in values if v not in out]
    span = max(kept) - min(kept)
    return [v for v in out if min(abs(v - k) for k in kept) > span]


def _no_importance(complete, tied):
    if len(complete) < 2:
        return "importance needs at least two complete trials"
    if tied:
        return f"all {len(complete)} complete trials reached {complete[0].value:.4g}:\nno difference to attribute"
    return "no parameter separates the best complete trials\nfrom the rest (PED-ANOVA)"


def _parallel_coordinates(fig, ax, complete, space, best, metric, direction):
    import matplotlib as mpl

    count = len(space)
    ax.set(title="parallel coordinates of complete trials", xticks=range(count), yticks=[], ylim=(-0.05, 1.05))
    ax.set_xlim(-0.2, count - 0.8)
    ax.set_xticklabels([p.name for p in space])
    for i in range(count):
        ax.axvline(i, color="0.75", linewidth=0.8, zorder=1)
    if not complete:
        ax.text((count - 1) / 2, 0.5, "no complete trial yet", ha="center")
        return
    odd = collapsed([t.value for t in complete], direction)
    values = [t.value for t in complete if t.value not in odd]
    norm = mpl.colors.Normalize(min(values), max(values))
    cmap = mpl.colormaps["viridis"]
    spread = min(values) < max(values)  # one value has no range to colour: every line the same, no colour bar
    for t in complete:
        ys = [_position(p, t.params[p.name]) for p in space]
        is_best = best is not None and t.number == best.number
        style = dict(color="tab:red", linewidth=3, zorder=3) if is_best else dict(linewidth=1.2, zorder=2)
        if t.value in odd:
            style.update(color="0.6", linestyle="--", gid="collapsed")
        elif not is_best:
            style.update(color=cmap(norm(t.value)) if spread else "tab:blue")
        ax.plot(range(count), ys, marker="o", markersize=4, **style)  # markers: one parameter is one point
    for i, p in enumerate(space):
        ends = [show(c) for c in p.choices] if p.kind == "choice" else [f"{p.low:g}", f"{p.high:g}"]
        last = i == count - 1  # the last axis labels to its left, inside the panel
        for label, y in zip(ends, [_position(p, v) for v in (p.choices or (p.low, p.high))]):
            ax.annotate(
                label,
                (i, y),
                xytext=(-4 if last else 4, 0),
                textcoords="offset points",
                ha="right" if last else "left",
                va="center",
                fontsize=9,
                zorder=5,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="0.8", alpha=0.9),
            )
    apart = f"; {len(odd)} collapsed ({', '.join(f'{v:.4g}' for v in odd)}, grey)" if odd else ""
    if spread:
        bar = fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"{metric} (red: best)")
        bar.ax.set_label("colorbar")
        ax.set_title(f"parallel coordinates of complete trials{apart}")
    else:
        which = f"all {len(values)}" if len(values) > 1 else "the one"
        ax.set_title(f"parallel coordinates of complete trials: {which} at {metric} {values[0]:.4g} (red: best){apart}")


def _position(param, value):
    """Where `value` sits on its axis, from 0 (low, first choice) to 1 (high, last choice)."""
    if param.kind == "choice":
        return param.choices.index(value) / max(1, len(param.choices) - 1)
    if param.kind == "log":
        return (math.log(value) - math.log(param.low)) / (math.log(param.high) - math.log(param.low))
    return (value - param.low) / (param.high - param.low)
