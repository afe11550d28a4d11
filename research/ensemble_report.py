"""What an ensemble shows (research/ensemble.py): its table, one line per member, the plain average and the weighted
ensemble, and ensemble_report.png. Matplotlib is imported where the figure is drawn: it takes a second."""

import io
import os

import numpy as np

from engine.state.files import write_text


def metric_names(summary):
    """The reported metrics, the objective first."""
    names = [name for name in summary["average"]["validation"] if name != "examples"]
    return sorted(names, key=lambda name: (name != summary["objective"], name))


def table(summary):
    """The members, the plain average and the weighted ensemble, one line each."""
    val, test = summary["validation_split"], summary["eval_split"]
    members = summary["members"]
    rows = [*members, summary["average"], summary["weighted"]]
    weights = [f"{m['weight']:.3f}" for m in members] + ["", ""]  # each member's weight in the weighted ensemble
    width = max(len(r["name"]) for r in rows)
    columns = [
        (key, split, name) for key, split in (("validation", val), ("test", test)) for name in metric_names(summary)
    ]
    widths = [max(11, len(f"{split} {name}")) for _, split, name in columns]
    lines = [
        f"ensemble of {len(members)} members (--task={summary['task']}, {summary['mean']} mean of "
        f"{summary['combines']}): weights fitted on {val} ({summary['validation_examples']} examples), reported on "
        f"{test} ({summary['test_examples']} examples)",
        f"{'':{width}}  {'model':11}  {'weight':>6}  "
        + "  ".join(f"{f'{split} {name}':>{w}}" for (_, split, name), w in zip(columns, widths)),
    ]
    for r, weight in zip(rows, weights):
        numbers = "  ".join(f"{r[key][name]:>{w}.4f}" for (key, _, name), w in zip(columns, widths))
        lines.append(f"{r['name']:{width}}  {r.get('model', ''):11}  {weight:>6}  {numbers}")
    return "\n".join(lines)


def plot(path, summary):
    """Writes ensemble_report.png (see figure), never through a link planted at the name."""
    buffer = io.BytesIO()
    figure(summary).savefig(buffer, dpi=80, format="png")
    write_text(path, buffer.getvalue())


def figure(summary):
    """ensemble_report.png as a matplotlib Figure: one panel per reported metric (labelled by its name) with each
    member, the average and the weighted ensemble on both splits, and the fitted weights (weights). Bars start at
    0, so their lengths compare, and the axis ends just above the tallest. An objective that is a share to
    maximize (accuracy) is drawn as what is left of it (1 - accuracy, the error rate): accuracies of 0.98 and
    0.99 are bars of one length, their errors are twice as long as one another."""
    from matplotlib.figure import Figure  # deferred: matplotlib takes a second to import

    rows = [*summary["members"], summary["average"], summary["weighted"]]
    names = [os.path.basename(r["name"].rstrip("/")) if r in summary["members"] else r["name"] for r in rows]
    metrics = metric_names(summary)
    fig = Figure(figsize=(max(12, (1.1 * len(rows) + 1) * len(metrics) + 3), 5.5), layout="constrained")
    *panels, weights = fig.subplots(1, len(metrics) + 1, width_ratios=[3] * len(metrics) + [1.2])
    x = np.arange(len(rows))
    splits = ((-0.2, summary["validation_split"], "validation"), (0.2, summary["eval_split"], "test"))
    for ax, metric in zip(panels, metrics):
        drawn = [r[key][metric] for r in rows for key in ("validation", "test")]
        complement = metric == summary["objective"] and summary["direction"] == "max" and 0 <= min(drawn)
        complement = complement and max(drawn) <= 1
        for offset, split, key in splits:
            label = f"{split} ({rows[0][key]['examples']} examples)"
            values = [1 - r[key][metric] if complement else r[key][metric] for r in rows]
            ax.bar_label(ax.bar(x + offset, values, width=0.4, label=label), fmt="%.4g", fontsize=8)
        heights = [bar.get_height() for bar in ax.patches]
        low, high = min(0.0, 1.15 * min(heights)), max(0.0, 1.15 * max(heights))
        if complement:
            name = "error rate (1 - accuracy)" if metric == "accuracy" else f"1 - {metric}"
            title = f"{name}, lower is better"
        else:
            better = {"max": ", higher is better", "min": ", lower is better"}[summary["direction"]]
            name, title = metric, metric + (better if metric == summary["objective"] else "")
        ax.set(xticks=x, ylim=(low, high) if high > low else (0, 1), ylabel=name, title=title)
        ax.set_xticklabels(names, rotation=20, ha="right")
        ax.set_label(metric)
    fig.legend(*panels[0].get_legend_handles_labels(), loc="outside upper center", ncols=2)
    shares = summary["weighted"]["weights"]
    weights.bar_label(weights.bar(names[: len(shares)], shares, color="tab:green"), fmt="%.2f", fontsize=8)
    weights.set(ylim=(0, 1), title=f"weights: {summary['weighted']['chosen']}", label="weights")
    weights.tick_params(axis="x", rotation=30)
    return fig
