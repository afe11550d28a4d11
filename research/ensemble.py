"""--mode=ensemble: several trained models, their weights fitted on validation, reported on test.

A member is either the workdir of a train run (its config.json rebuilds the task and the models, its latest
checkpoint fills them, with the moving averages where the run kept them) or an .npz file of another model's
predictions, say gradient-boosted trees: for each split, the predictions as the task's own (`validation`, `test`:
one row per example) and the examples' positions in the split (`validation_index`, `test_index`: a run's
evaluation batches carry them as `index`), checked against the run members' examples. Arrays are named by the
split as --validation_split and --eval_split give it.

Every run member predicts the validation and the test split through the engine's own evaluation pipeline (the
same preparation); the members' predictions combine as their task says (`Task.ensemble`): probabilities by their
arithmetic mean or, with --ensemble_mean=geometric, their normalized geometric mean; values by their mean. A task
whose outputs mean nothing averaged (`Task.ensemble` None) is refused. The ensemble combines the members plainly
and with weights on the simplex that minimize the validation loss (Nelder-Mead or random search), and is scored
like an evaluation: the task's per-example `score`, its mean, the task's `report`. The test split is only
predicted and scored, never used to choose anything. The workdir gets summary.json, ensemble_report.png and
predictions.npz (the weighted ensemble's predictions as a member file, and each member's); it must not hold a
train run or a tuning study, whose summary.json the ensemble's would replace, and the ensemble writes it under the
lock a train run takes (engine/workdir.py).
"""

import dataclasses
import io
import os
import time
import zipfile

import numpy as np
import tensorflow as tf

from engine.cluster import distribute
from engine.data import datasets as data_lib
from engine.numerics import precision
from engine.run import build
from engine.run.inputs import batches
from engine.settings import config as config_lib
from engine.settings import plugins
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from engine.state import checkpoint as checkpoint_lib
from engine.state import workdir as workdir_lib
from engine.state.report import write_json
from research import checks

SETTINGS = {
    "members": ("", "comma-separated workdirs of trained runs and .npz files of other models' predictions"),
    "ensemble_search": (
        "nelder_mead",
        "how weights on the simplex are fitted on validation: nelder_mead|random",
        ("nelder_mead", "random"),
    ),
    "ensemble_samples": (2000, "with --ensemble_search=random, weight vectors drawn uniformly from the simplex"),
    "ensemble_mean": (
        "arithmetic",
        "how members' probabilities combine: arithmetic|geometric (normalized)",
        ("arithmetic", "geometric"),
    ),
}
READS = ("validation_split",)  # research/tune.py's: the split that fits the weights


_TINY = np.finfo(np.float64).tiny  # keeps log() finite for a probability that underflowed to 0
MEANS = ("arithmetic", "geometric")


@dataclasses.dataclass
class Member:
    name: str  # its workdir or file, as --members gives it
    model: str  # the model family, or "predictions" for a file
    step: int | None  # the checkpoint's step (None for a file)
    predictions: dict  # split -> [examples, ...] float64, in the order of the reference's examples


@dataclasses.dataclass
class Reference:
    """What the first run member establishes and every other member must match."""

    name: str
    config: Config
    task: object  # its tasks/<name>.py Task
    spec: dict  # {feature: tf.TensorSpec} of one prepared example
    examples: dict  # split -> {feature: [examples, ...]} (real examples, in order; with `index`)
    shapes: dict  # split -> shape of one example's predictions


def read_config(workdir):
    """The Config a train run wrote to workdir/config.json, checked like flags (ConfigError `<path>: ...`)."""
    saved = config_lib.load_run_config(workdir)
    if saved is None:
        raise ConfigError(f"--members: {workdir} has no config.json (not a train run's workdir?)")
    return saved


def is_file(member):
    """Whether a --members entry is a file of predictions rather than a workdir."""
    return member.endswith(".npz")


def ensemble(config, strategy=None):
    """Loads --members, fits the weights on --validation_split, reports on --eval_split; returns the summary,
    also written to workdir/summary.json with ensemble_report.png and predictions.npz beside it."""
    del strategy  # members predict in the main process, batch by batch: nothing to distribute
    started = time.time()
    checks.check(config)
    _check_own_workdir(config)  # before the slow part
    splits = (config.validation_split, config.eval_split)
    members, reference, kind = _members(config, splits)
    task = reference.task
    objective, direction = task.objective
    examples = {split: reference.examples[split] for split in splits}
    predictions = {split: [m.predictions[split] for m in members] for split in splits}
    if objective not in _scores(task, predictions[splits[0]][0], examples[splits[0]]):
        objective, direction = "loss", "min"  # the task's objective needs more than per-example scores (a probe)
    validation, test = splits

    weights, chosen, fitted = fit_weights(predictions[validation], examples[validation], task, config)

    def scored(name, ws, **extra):
        ws = [float(w) for w in ws]
        both = {
            key: _scores(task, combine(predictions[split], ws, config.ensemble_mean), examples[split])
            for key, split in (("validation", validation), ("test", test))
        }
        return {"name": name, **extra, "weights": ws, **both}

    members_scores = [
        scored(m.name, np.eye(len(members))[i], model=m.model, step=m.step, weight=float(weights[i]))
        for i, m in enumerate(members)
    ]
    count = len(members)
    summary = {
        "task": reference.config.task,
        "combines": kind,
        "mean": config.ensemble_mean,
        "objective": objective,
        "direction": direction,
        "members": members_scores,
        "average": scored("average", np.full(count, 1.0 / count)),
        "weighted": scored(f"weighted ({chosen})", weights, chosen=chosen),
        # What the search found, before the choice by the validation objective; its test score is not looked at.
        "fitted": {
            "search": config.ensemble_search,
            "weights": [float(w) for w in fitted],
            "validation": _scores(
                task, combine(predictions[validation], fitted, config.ensemble_mean), examples[validation]
            ),
        },
        "validation_split": validation,
        "eval_split": test,
        "validation_examples": len(predictions[validation][0]),
        "test_examples": len(predictions[test][0]),
        "wall_seconds": time.time() - started,
    }
    _write(config, summary, predictions, weights, reference)
    return summary


def _members(config, splits):
    """(the members in --members order, the first train run's as the reference, what they combine): the task and
    the files checked before the slow part, the runs' models loaded."""
    names = checks.members(config)
    runs = {name: read_config(name) for name in names if not is_file(name)}
    if not runs:
        raise ConfigError(
            f"--members={config.members}: needs at least one train run's workdir (it gives the task and the "
            "examples that files of predictions are checked against)"
        )
    kind = _check_task(config, runs)
    files = {name: _read_file(name, splits, kind) for name in names if is_file(name)}  # before the slow part
    loaded, reference = {}, None
    for name, member_config in runs.items():
        if config.data_dir:  # the data moved since the member trained
            member_config = dataclasses.replace(member_config, data_dir=config.data_dir)
        loaded[name], reference = _load_run(name, member_config, splits, reference)
    for name, arrays in files.items():
        loaded[name] = _align(name, arrays, splits, reference)
    return [loaded[name] for name in names], reference, kind


def _write(config, summary, predictions, weights, reference):
    with workdir_lib.Lock(config.workdir, doing="fitting an ensemble"):
        _check_own_workdir(config)  # again, under the lock: a run may have started there since
        print(table(summary), flush=True)
        write_json(os.path.join(config.workdir, "summary.json"), summary)
        _write_predictions(os.path.join(config.workdir, "predictions.npz"), predictions, weights, reference, config)
        plot(os.path.join(config.workdir, "ensemble_report.png"), summary)


def _check_own_workdir(config):
    """Refuses a --workdir that holds a train run or a tuning study: the ensemble's summary.json would replace
    theirs."""
    for name, holds in (("config.json", "a train run"), (workdir_lib.STUDY_NAME, "a tuning study")):
        path = os.path.join(config.workdir, name)
        if tf.io.gfile.exists(path):
            raise ConfigError(
                f"--workdir={config.workdir} holds {holds} ({path}): an ensemble needs a --workdir of its own"
            )


def _check_task(config, runs):
    """Refuses run members of different tasks, a task whose outputs cannot be averaged, and a geometric mean of
    anything but probabilities; returns how the task's predictions combine (Task.ensemble)."""
    (first, first_config), *others = runs.items()
    for name, member_config in others:
        if member_config.task != first_config.task:
            raise ConfigError(
                f"--members: {name} trains --task={member_config.task} but {first} trains "
                f"--task={first_config.task}: an ensemble's members must share one task"
            )
    kind = data_lib.task_class(first_config).ensemble
    if kind is None:
        raise ConfigError(
            f"--members: {first} trains --task={first_config.task}, whose outputs an ensemble cannot average "
            "(its Task.ensemble is None)"
        )
    if config.ensemble_mean == "geometric" and kind != "probabilities":
        raise ConfigError(
            f"--ensemble_mean=geometric: --task={first_config.task} averages {kind}, not probabilities; "
            "use --ensemble_mean=arithmetic"
        )
    return kind


def _load_run(workdir, member_config, splits, reference):
    """A run member: its models restored from the latest checkpoint (with its moving averages where it kept
    them), predicting `splits`; checked against `reference` (None: it becomes the reference). Returns (Member,
    reference)."""
    found = checkpoint_lib.latest(os.path.join(workdir, "checkpoints"))
    if not found:
        raise ConfigError(f"--members: {workdir} has no checkpoint (train it first)")
    where = f"--members: {workdir} ({_data_name(member_config)})"
    # One device; the run's own evaluation data is the first split (one data load fewer).
    run_config = dataclasses.replace(member_config, strategy="one_device", num_cpu_devices=1, eval_split=splits[0])
    try:  # building the run sets the member's precision: its layers take the policy they are created under
        run = build.run(run_config, distribute.create_strategy(run_config), training=False)
        if reference is not None:
            described = f"{reference.name} ({_data_name(reference.config)})"
            for feature in sorted(reference.spec.keys() | run.data.spec.keys()):
                theirs, ours = reference.spec.get(feature), run.data.spec.get(feature)
                if theirs != ours:
                    raise ConfigError(
                        f"{where} takes {feature} {_spec_text(ours)} but {described} takes {feature} "
                        f"{_spec_text(theirs)}: an ensemble's members must share one input space"
                    )
        checkpoint = run.state.evaluated()
        try:
            checkpoint_lib.restore(checkpoint, found, partial=True)
        except checkpoint_lib.Unreadable as e:
            raise ConfigError(f"--members: {found} is unreadable ({e})") from None
        task = run.task
        predict = tf.function(lambda batch: task.predictions(task.forward(run.models, batch, False)))
        predictions, examples = {}, {}
        with run.evaluator.averaged_weights():
            for split in splits:
                own = split == splits[0]
                ctx = tf.distribute.InputContext()
                read = batches(run.data.eval_fn(ctx)) if own else run.evaluator.examples(split)
                predictions[split], examples[split] = _predict(predict, read)
    finally:
        precision.set_policy("float32")
    member = Member(workdir, member_config.model, int(run.state.step.numpy()), predictions)
    if reference is None:
        shapes = {split: p.shape[1:] for split, p in predictions.items()}
        return member, Reference(workdir, member_config, task, run.data.spec, examples, shapes)
    described = f"{reference.name} ({_data_name(reference.config)})"
    for split in splits:
        if predictions[split].shape[1:] != reference.shapes[split]:
            raise ConfigError(
                f"{where} predicts {_outputs_text(predictions[split].shape[1:], task)} but {described} predicts "
                f"{_outputs_text(reference.shapes[split], task)}: an ensemble's members must share one "
                f"{'label' if task.ensemble == 'probabilities' else 'output'} space"
            )
        ours, theirs = examples[split], reference.examples[split]
        if ours.keys() != theirs.keys() or not all(
            ours[k].shape == theirs[k].shape and np.array_equal(ours[k], theirs[k]) for k in theirs
        ):
            raise ConfigError(
                f"{where} sees other {split} examples than {described}: "
                "an ensemble's members must be evaluated on the same examples"
            )
    return member, reference


def _predict(predict, batches):
    """(predictions [examples, ...] float64, {feature: [examples, ...]}) of the real examples of `batches`."""
    outputs, features = [], {}
    for batch in batches:
        real = batch["weight"].numpy() > 0  # padding that completes the last batch has weight 0
        outputs.append(np.asarray(predict(batch), np.float64)[real])
        for name, values in batch.items():
            if name != "weight":
                features.setdefault(name, []).append(values.numpy()[real])
    return np.concatenate(outputs), {name: np.concatenate(values) for name, values in features.items()}


def _read_file(path, splits, kind):
    """A member given as an .npz of predictions: {split: (predictions, index)}, checked for what needs no other
    member (the arrays there, one row per example, finite, probabilities where the task combines them)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {key: f[key] for key in f.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError(f"--members: {path}: cannot read it as an .npz of predictions ({e})") from None
    where = f"--members: {path}"
    read = {}
    for split, flag in zip(splits, ("validation_split", "eval_split")):
        for key in (split, f"{split}_index"):
            if key not in arrays:
                raise ConfigError(
                    f"{where} has no array '{key}' (it must hold '{split}' and '{split}_index' for "
                    f"--{flag}={split}; it has {', '.join(sorted(arrays)) or 'none'})"
                )
        values, index = arrays[split], arrays[f"{split}_index"]
        if not (np.issubdtype(values.dtype, np.number) and np.issubdtype(index.dtype, np.integer)) or (
            values.ndim < 1 or index.ndim != 1 or len(values) != len(index)
        ):
            raise ConfigError(
                f"{where}: '{split}' must be numbers, one row per example, and '{split}_index' their positions, "
                f"integers (they are {values.dtype} {values.shape} and {index.dtype} {index.shape})"
            )
        values = np.asarray(values, np.float64)
        if not np.all(np.isfinite(values)):
            raise ConfigError(f"{where}: '{split}' holds values that are not finite")
        if kind == "probabilities" and (
            values.ndim != 2 or np.any(values < 0) or not np.allclose(values.sum(axis=-1), 1.0, rtol=0, atol=1e-4)
        ):
            raise ConfigError(
                f"{where}: '{split}' must hold probabilities (one row per example, non-negative, summing to 1)"
            )
        read[split] = values, index
    return read


def _align(path, arrays, splits, reference):
    """The file member's predictions in the order of the reference's examples, which they must cover exactly
    (a model outside the engine may have written its rows in any order)."""
    where = f"--members: {path}"
    predictions = {}
    for split in splits:
        values, index = arrays[split]
        expected = reference.examples[split]["index"]
        if len(index) != len(expected):
            raise ConfigError(
                f"{where} holds {len(index)} {split} predictions but {reference.name} sees {len(expected)} "
                "examples: an ensemble's members must predict the same examples"
            )
        order = np.argsort(index, kind="stable")
        if not np.array_equal(index[order], np.sort(expected)):
            raise ConfigError(
                f"{where}: '{split}_index' names other {split} examples than {reference.name} sees (positions "
                f"{_first_difference(index[order], np.sort(expected))}): an ensemble's members must predict the "
                "same examples"
            )
        values = values[order[np.searchsorted(index[order], expected)]]
        if values.shape[1:] != reference.shapes[split]:
            raise ConfigError(
                f"{where} predicts {_outputs_text(values.shape[1:], reference.task)} for {split} but "
                f"{reference.name} predicts {_outputs_text(reference.shapes[split], reference.task)}"
            )
        predictions[split] = values
    return Member(path, "predictions", None, predictions)


def _write_predictions(path, predictions, weights, reference, config):
    """predictions.npz: the weighted ensemble's predictions in the member file's format (so it can join another
    ensemble), and each member's as `member<i>_<split>`, in the order of --members."""
    arrays = {}
    for split, members in predictions.items():
        arrays[split] = combine(members, weights, config.ensemble_mean)
        arrays[f"{split}_index"] = reference.examples[split]["index"]
        arrays.update({f"member{i}_{split}": p for i, p in enumerate(members)})
    buffer = io.BytesIO()  # zipfile reads back what it writes, which a GFile (any file system) cannot
    np.savez(buffer, **arrays)
    workdir_lib.replace_text(path, buffer.getvalue())  # never through a link planted at the name


def _first_difference(ours, theirs):
    differs = np.flatnonzero(ours != theirs)[0]
    return f"{ours[differs]} where {theirs[differs]} was expected"


def _spec_text(spec):
    return "nothing" if spec is None else f"{spec.dtype.name} {tuple(spec.shape)}"


def _outputs_text(shape, task):
    if task.ensemble == "probabilities" and len(shape) == 1:
        return f"{shape[0]} classes"
    return f"values of shape {tuple(shape)} per example"


def _data_name(config):
    name = config.dataset or plugins.default_dataset(config.task)
    if name == "synthetic":
        shape = ",".join(str(d) for d in config.synthetic_shape)
        return f"synthetic {shape} with {config.synthetic_classes} classes"
    return name


def combine(predictions, weights, mean="arithmetic"):
    """The weighted mean of the members' predictions: arithmetic, or (probabilities) geometric, renormalized so
    each example's probabilities sum to 1."""
    weights, stacked = np.asarray(weights, np.float64), np.stack(predictions)
    if mean == "arithmetic":
        return np.tensordot(weights, stacked, axes=1)
    logs = np.tensordot(weights, np.log(np.maximum(stacked, _TINY)), axes=1)
    logs -= logs.max(axis=-1, keepdims=True)  # the largest becomes exp(0) = 1: nothing overflows or all underflows
    combined = np.exp(logs)
    return combined / combined.sum(axis=-1, keepdims=True)


def _scores(task, predictions, examples):
    """The task's reported numbers for `predictions` of `examples`, like an evaluation: the means of its
    per-example scores, through its report; with the example count."""
    means = {name: float(np.mean(values)) for name, values in task.score(predictions, examples).items()}
    return {**task.report(means), "examples": int(len(predictions))}


def fit_weights(predictions, examples, task, config):
    """Weights on the simplex (non-negative, summing to 1) fitted on validation only.

    The search minimizes the validation loss (the task's score `loss`: cross-entropy for probabilities), which is
    smooth, where accuracy on a few hundred examples is a staircase. The answer is then chosen by the task's
    objective on validation (ties: the loss) among the fitted weights, the plain average and every member alone,
    so it is never worse on validation than the best member. Returns (weights, which candidate they are, the
    search's own weights).
    """
    count = len(predictions)
    objective, direction = task.objective
    memo = {}

    def result(weights):
        key = tuple(np.asarray(weights, np.float64))
        if key not in memo:
            memo[key] = _scores(task, combine(predictions, weights, config.ensemble_mean), examples)
        return memo[key]

    def loss(weights):
        return result(weights)["loss"]

    if config.ensemble_search == "random":
        rng = np.random.default_rng(config.seed)
        draws = rng.dirichlet(np.ones(count), size=config.ensemble_samples)  # uniform on the simplex
        # With its center and corners, so the search is never worse than the average or a member alone.
        fitted = min([np.full(count, 1.0 / count), *np.eye(count), *draws], key=loss)
    else:
        fitted = _nelder_mead(loss, count)
    candidates = [(fitted, config.ensemble_search), (np.full(count, 1.0 / count), "plain average")]
    candidates += [(np.eye(count)[i], f"member {i} alone") for i in range(count)]

    def rank(candidate):
        scores = result(candidate[0])
        value = scores.get(objective, scores["loss"])
        return (-value if direction == "max" else value, scores["loss"])

    weights, chosen = min(candidates, key=rank)
    return weights, chosen, fitted


def _nelder_mead(loss, count):
    """scipy's Nelder-Mead over |z| / sum |z|, which maps every point to the simplex; started from the plain
    average and from each member alone, the best end wins."""
    from scipy.optimize import minimize  # deferred: scipy takes a second to import

    def on_simplex(z):
        z = np.abs(z)
        return z / z.sum() if z.sum() > 0 else np.full(count, 1.0 / count)

    best = None
    for start in [np.full(count, 1.0 / count), *np.eye(count)]:
        simplex = np.vstack([start, start + 0.5 * np.eye(count)])  # steps large enough to leave a corner
        result = minimize(
            lambda z: loss(on_simplex(z)),
            start,
            method="Nelder-Mead",
            options={"initial_simplex": simplex, "xatol": 1e-4, "fatol": 1e-7, "maxiter": 400 * count},
        )
        if best is None or result.fun < best.fun:
            best = result
    return on_simplex(best.x)


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
    workdir_lib.replace_text(path, buffer.getvalue())


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
