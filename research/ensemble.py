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
lock a train run takes (engine/state/workdir.py).
"""

import dataclasses
import json
import os
import time

import numpy as np
import tensorflow as tf

from engine.data import datasets as data_lib
from engine.settings import config as config_lib
from engine.settings.errors import ConfigError
from engine.state import lock
from engine.state import workdir as workdir_lib
from engine.state.files import write_json
from research import checks
from research.ensemble_members import align, load_run, read_file, write_predictions
from research.ensemble_report import plot, table
from research.ensemble_weights import combine, fit_weights, scores

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
    config = config_lib.validate(dataclasses.replace(config, mode="ensemble"))  # a notebook's too, as flags are
    checks.check(config)
    _check_own_workdir(config)  # before the slow part
    splits = (config.validation_split, config.eval_split)
    members, reference, kind = _members(config, splits)
    task = reference.task
    objective, direction = task.objective
    examples = {split: reference.examples[split] for split in splits}
    predictions = {split: [m.predictions[split] for m in members] for split in splits}
    if objective not in scores(task, predictions[splits[0]][0], examples[splits[0]]):
        objective, direction = "loss", "min"  # the task's objective needs more than per-example scores (a probe)
    validation, test = splits

    weights, chosen, fitted = fit_weights(predictions[validation], examples[validation], task, config)

    def scored(name, ws, **extra):
        ws = [float(w) for w in ws]
        both = {
            key: scores(task, combine(predictions[split], ws, config.ensemble_mean), examples[split])
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
            "validation": scores(
                task, combine(predictions[validation], fitted, config.ensemble_mean), examples[validation]
            ),
        },
        "validation_split": validation,
        "eval_split": test,
        # Counted as an evaluation counts them, by their weights (an int where every weight is 1 or 0).
        "validation_examples": members_scores[0]["validation"]["examples"],
        "test_examples": members_scores[0]["test"]["examples"],
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
    files = {name: read_file(name, splits, kind) for name in names if is_file(name)}  # before the slow part
    loaded, reference = {}, None
    for name, member_config in runs.items():
        if config.data_dir:  # the data moved since the member trained
            member_config = dataclasses.replace(member_config, data_dir=config.data_dir)
        loaded[name], reference = load_run(name, member_config, splits, reference)
    for name, arrays in files.items():
        loaded[name] = align(name, arrays, splits, reference)
    return [loaded[name] for name in names], reference, kind


def _write(config, summary, predictions, weights, reference):
    with lock.Lock(config.workdir, doing="fitting an ensemble"):
        _check_own_workdir(config)  # again, under the lock: a run may have started there since
        print(table(summary), flush=True)
        write_json(os.path.join(config.workdir, "summary.json"), summary)
        write_predictions(os.path.join(config.workdir, "predictions.npz"), predictions, weights, reference, config)
        plot(os.path.join(config.workdir, "ensemble_report.png"), summary)


def _check_own_workdir(config):
    """Refuses a --workdir that holds a train run, a tuning study or an ensemble of other members: this ensemble's
    summary.json would replace theirs. One of the same members is made again (its runs may have trained on)."""
    job, marker = workdir_lib.held_job(config.workdir)
    if job in ("run", "study"):
        holds = "a train run" if job == "run" else "a tuning study"
        raise ConfigError(
            f"--workdir={config.workdir} holds {holds} ({marker}): an ensemble needs a --workdir of its own"
        )
    path = os.path.join(config.workdir, "summary.json")
    try:
        with tf.io.gfile.GFile(path) as f:
            before = [member["name"] for member in json.loads(f.read())["members"]]
    except (tf.errors.NotFoundError, ValueError, KeyError, TypeError):  # none, or damaged: this one rewrites it
        return
    if before != checks.members(config):
        raise ConfigError(
            f"--members={config.members}: --workdir={config.workdir} holds an ensemble of other members "
            f"({','.join(map(str, before))}; {path}), whose results this one's would replace; give it a --workdir of "
            "its own"
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
