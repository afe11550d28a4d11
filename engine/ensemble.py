"""--mode=ensemble: several trained runs, their weights fitted on validation, reported on test.

Each member is the workdir of a train run: its config.json rebuilds the model and its latest checkpoint
fills it. Every member predicts the validation and the test split (the engine's own evaluation pipeline,
so the same preprocessing); the ensemble averages the members' probabilities, plainly or with weights on
the simplex that minimize the validation cross-entropy (Nelder-Mead or random search). The test split is
only predicted and scored, never used to choose anything.
"""

import dataclasses
import os
import time

import numpy as np
import tensorflow as tf

from engine import checkpoint as checkpoint_lib
from engine import config as config_lib
from engine import data as data_lib
from engine import loop, precision
from engine.config import Config, ConfigError
from engine.report import make_workdir, write_json

_TINY = 1e-12  # keeps log() finite for a probability that underflowed to 0


@dataclasses.dataclass
class Member:
    workdir: str
    config: Config
    step: int
    probabilities: dict  # split -> [examples, classes] float64


def read_config(workdir):
    """The Config a train run wrote to workdir/config.json, checked like flags (ConfigError `<path>: ...`)."""
    saved = config_lib.load_run_config(workdir)
    if saved is None:
        raise ConfigError(f"--members: {workdir} has no config.json (not a train run's workdir?)")
    return saved


def ensemble(config, strategy=None):
    """Loads --members, fits the weights on --validation_split, reports on --eval_split; returns the summary,
    also written to workdir/summary.json with ensemble_report.png beside it."""
    del strategy  # members predict in the main process, batch by batch: nothing to distribute
    started = time.time()
    workdirs = config_lib.members(config)
    splits = (config.validation_split, config.eval_split)
    cache = {}
    members = [_load_member(config, workdir, splits, cache) for workdir in workdirs]
    labels = _check_same_examples(config, members, cache)
    validation, test = (labels[s] for s in splits)
    val_probs = [m.probabilities[config.validation_split] for m in members]
    test_probs = [m.probabilities[config.eval_split] for m in members]

    weights, chosen, fitted = fit_weights(val_probs, validation, config)

    def scores(name, ws, **extra):
        ws = [float(w) for w in ws]
        valid, held_out = score(combine(val_probs, ws), validation), score(combine(test_probs, ws), test)
        return {"name": name, **extra, "weights": ws, "validation": valid, "test": held_out}

    members_scores = [
        scores(m.workdir, np.eye(len(members))[i], model=m.config.model, step=m.step, weight=float(weights[i]))
        for i, m in enumerate(members)
    ]
    summary = {
        "members": members_scores,
        "average": scores("average", np.full(len(members), 1.0 / len(members))),
        "weighted": scores(f"weighted ({chosen})", weights, chosen=chosen),
        # What the search found, before the choice by validation accuracy; its test score is not looked at.
        "fitted": {
            "search": config.ensemble_search,
            "weights": [float(w) for w in fitted],
            "validation": score(combine(val_probs, fitted), validation),
        },
        "validation_split": config.validation_split,
        "eval_split": config.eval_split,
        "validation_examples": len(validation),
        "test_examples": len(test),
        "wall_seconds": time.time() - started,
    }
    make_workdir(config.workdir)
    print(table(summary), flush=True)
    write_json(os.path.join(config.workdir, "summary.json"), summary)
    plot(os.path.join(config.workdir, "ensemble_report.png"), summary)
    return summary


def _load_member(config, workdir, splits, cache):
    """A member's model, restored from its latest checkpoint, and its probabilities on `splits`."""
    member_config = read_config(workdir)
    if config.data_dir:  # the data moved since the member trained
        member_config = dataclasses.replace(member_config, data_dir=config.data_dir)
    found = checkpoint_lib.latest(os.path.join(workdir, "checkpoints"))
    if not found:
        raise ConfigError(f"--members: {workdir} has no checkpoint (train it first)")
    shape, classes = _split(member_config, splits[0], cache)[2:]
    precision.set_policy(member_config.precision)  # layers take the policy they are created under
    try:
        model = loop.create_model(member_config, shape, classes)
    finally:
        precision.set_policy("float32")
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = checkpoint_lib.model_checkpoint(model, step)
    try:
        checkpoint_lib.restore(checkpoint, found, partial=True, model=model)
    except checkpoint_lib.Unreadable as e:
        raise ConfigError(f"--members: {found} is unreadable ({e})") from None
    probabilities = {}
    for split in splits:
        images = _split(member_config, split, cache)[0]
        logits = [model(batch, training=False) for batch in np.array_split(images, max(1, len(images) // 256))]
        probabilities[split] = tf.nn.softmax(tf.cast(tf.concat(logits, 0), tf.float64)).numpy()
    return Member(workdir, member_config, int(step.numpy()), probabilities)


def _split(config, split, cache):
    """(images, labels, input_shape, num_classes) of every example of `split`, in order, through the engine's
    evaluation pipeline; members that share their data share the arrays."""
    key = (config.dataset, config.data_dir, split, config.synthetic_shape, config.synthetic_classes)
    key += (config.synthetic_examples, config.seed)
    key = key if config.dataset == "synthetic" else key[:3]  # only synthetic data depends on the rest
    if key not in cache:
        data = data_lib.load(dataclasses.replace(config, eval_split=split))
        images, labels = [], []
        for x, y, weight in data.eval_fn(tf.distribute.InputContext()):
            real = weight.numpy() > 0  # padding that completes the last batch has weight 0
            images.append(x.numpy()[real])
            labels.append(y.numpy()[real])
        cache[key] = (np.concatenate(images), np.concatenate(labels), data.input_shape, data.num_classes)
    return cache[key]


def _check_same_examples(config, members, cache):
    """Refuses members whose predictions cannot be averaged; returns {split: labels} of the first member."""
    first = members[0]
    splits = (config.validation_split, config.eval_split)
    reference = {s: _split(first.config, s, cache) for s in splits}
    described = f"{first.workdir} ({_data_name(first.config)})"
    for member in members[1:]:
        for split in splits:
            images, labels, shape, classes = _split(member.config, split, cache)
            ref_images, ref_labels, ref_shape, ref_classes = reference[split]
            where = f"--members: {member.workdir} ({_data_name(member.config)})"
            if shape != ref_shape:
                raise ConfigError(
                    f"{where} takes inputs of shape {shape} but {described} takes {ref_shape}: "
                    "an ensemble's members must share one input space"
                )
            if classes != ref_classes:
                raise ConfigError(
                    f"{where} predicts {classes} classes but {described} predicts {ref_classes}: "
                    "an ensemble's members must share one label space"
                )
            if labels.shape != ref_labels.shape or not (
                np.array_equal(labels, ref_labels) and np.array_equal(images, ref_images)
            ):
                raise ConfigError(
                    f"{where} sees other {split} examples than {described}: "
                    "an ensemble's members must be trained on the same dataset"
                )
    return {s: reference[s][1] for s in splits}


def _data_name(config):
    if config.dataset == "synthetic":
        shape = ",".join(str(d) for d in config.synthetic_shape)
        return f"synthetic {shape} with {config.synthetic_classes} classes"
    return config.dataset


def combine(probabilities, weights):
    """The weighted average of the members' predicted probabilities."""
    return np.tensordot(np.asarray(weights, dtype=np.float64), np.stack(probabilities), axes=1)


def score(probabilities, labels):
    """accuracy, loss (mean cross-entropy) and examples, like an engine evaluation."""
    picked = probabilities[np.arange(len(labels)), labels]
    return {
        "accuracy": float(np.mean(np.argmax(probabilities, axis=1) == labels)),
        "loss": float(-np.mean(np.log(picked + _TINY))),
        "examples": int(len(labels)),
    }


def fit_weights(probabilities, labels, config):
    """Weights on the simplex (non-negative, summing to 1) fitted on validation only.

    The search minimizes the validation cross-entropy, which is smooth, where accuracy on a few hundred
    examples is a staircase. The answer is then chosen by validation accuracy (ties: cross-entropy) among
    the fitted weights, the plain average and every member alone, so it is never worse on validation than
    the best member. Returns (weights, which candidate they are, the search's own weights).
    """
    count = len(probabilities)
    stacked = np.stack(probabilities)

    def loss(weights):
        return score(np.tensordot(weights, stacked, axes=1), labels)["loss"]

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
        result = score(np.tensordot(candidate[0], stacked, axes=1), labels)
        return (-result["accuracy"], result["loss"])

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


def table(summary):
    """The members, the plain average and the weighted ensemble, one line each."""
    val, test = summary["validation_split"], summary["eval_split"]
    members = summary["members"]
    rows = [*members, summary["average"], summary["weighted"]]
    weights = [f"{m['weight']:.3f}" for m in members] + ["", ""]  # each member's weight in the weighted ensemble
    width = max(len(r["name"]) for r in rows)
    columns = (f"{val} acc", f"{val} loss", f"{test} acc", f"{test} loss")
    lines = [
        f"ensemble of {len(members)} members: weights fitted on {val} "
        f"({summary['validation_examples']} examples), reported on {test} ({summary['test_examples']} examples)",
        f"{'':{width}}  {'model':11}  {'weight':>6}  " + "  ".join(f"{c:>15}" for c in columns),
    ]
    for r, weight in zip(rows, weights):
        numbers = (r["validation"]["accuracy"], r["validation"]["loss"], r["test"]["accuracy"], r["test"]["loss"])
        model = r.get("model", "")
        lines.append(f"{r['name']:{width}}  {model:11}  {weight:>6}  " + "  ".join(f"{n:>15.4f}" for n in numbers))
    return "\n".join(lines)


def plot(path, summary):
    """Writes ensemble_report.png (see figure)."""
    figure(summary).savefig(path, dpi=80)


def figure(summary):
    """ensemble_report.png as a matplotlib Figure: the error rate and the cross-entropy of each member, the
    average and the weighted ensemble on both splits (panels labelled error and loss), and the fitted weights
    (weights). Bars start at 0, so their lengths compare."""
    from matplotlib.figure import Figure  # deferred: matplotlib takes a second to import

    rows = [*summary["members"], summary["average"], summary["weighted"]]
    names = [os.path.basename(r["name"].rstrip("/")) if r in summary["members"] else r["name"] for r in rows]
    fig = Figure(figsize=(max(12, 2.2 * len(rows) + 5), 5.5), layout="constrained")
    error, loss, weights = fig.subplots(1, 3, width_ratios=[3, 3, 1.2])
    x = np.arange(len(rows))
    splits = ((-0.2, summary["validation_split"], "validation"), (0.2, summary["eval_split"], "test"))
    for offset, split, key in splits:
        label = f"{split} ({rows[0][key]['examples']} examples)"
        errors = [100 * (1 - r[key]["accuracy"]) for r in rows]
        error.bar_label(error.bar(x + offset, errors, width=0.4, label=label), fmt="%.1f", fontsize=8)
        losses = [r[key]["loss"] for r in rows]
        loss.bar_label(loss.bar(x + offset, losses, width=0.4), fmt="%.3f", fontsize=8)
    # Ensembles gain most in cross-entropy: a few hundred examples move accuracy in whole examples only.
    panels = (
        (error, "error", "error rate (%)", "error rate = 100 x (1 - accuracy), lower is better"),
        (loss, "loss", "cross-entropy", "loss (cross-entropy), lower is better"),
    )
    for ax, key, ylabel, title in panels:
        top = max(bar.get_height() for bar in ax.patches)
        ax.set(xticks=x, ylim=(0, 1.15 * top if top > 0 else 1), ylabel=ylabel, title=title)
        ax.set_xticklabels(names, rotation=20, ha="right")
        ax.set_label(key)
    fig.legend(*error.get_legend_handles_labels(), loc="outside upper center", ncols=2)
    shares = summary["weighted"]["weights"]
    weights.bar_label(weights.bar(names[: len(shares)], shares, color="tab:green"), fmt="%.2f", fontsize=8)
    weights.set(ylim=(0, 1), title=f"weights: {summary['weighted']['chosen']}", label="weights")
    weights.tick_params(axis="x", rotation=30)
    return fig
