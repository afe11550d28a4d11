"""--mode=tune: a hyperparameter search whose every trial is a real engine run.

Optuna does the searching (random, TPE or a Gaussian process) and the early stopping (median, successive
halving, Hyperband); this file turns its draws into configs, runs each with engine.run.loop.train in
<workdir>/trials/<n>, reports every evaluation back so a hopeless trial stops early, and writes the results.
The study lives in SQLite in the workdir (or in --tune_storage, which several machines can share), so a
killed tuner restarted with the same command keeps its finished trials and resumes an interrupted one from
that trial's own checkpoint. Trials are scored on --validation_split: tuning never sees the test split.
A tuner holds its workdir's lock as a train run does (engine/state/workdir.py), and its study.json marks the workdir
as a
study's: a train run is refused there, and a tuner in a train run's workdir. The storage URL's password is shown
as *** wherever the tuner writes or prints the URL, and a trial's config leaves the storage out.

Every task is tuned alike: the objective is a metric the task reports, by default its own `Task.objective`
(name and direction). The search space is a text file, one searched flag per line; research/space.py reads it and
says how it looks. research/tune_study.py opens the study; research/tune_summary.py writes what it leaves.
"""

import dataclasses
import json
import os
import time
import warnings

import optuna
import tensorflow as tf

from engine.cluster import distribute
from engine.data import datasets as data_lib
from engine.run import build, loop
from engine.run.actions.builtin import ON_EVAL
from engine.settings.config import validate
from engine.settings.errors import ConfigError, Preempted, TrainingError, counted
from engine.settings.fields import show
from engine.state import lock
from engine.state import workdir as workdir_lib
from engine.state.files import is_local, write_json
from research import checks, tune_summary
from research.space import parse_space, with_values
from research.tune_study import (
    CURVE,
    FINISHED,
    RESUMES,
    TUNER,
    WORKDIR,
    best_trial,
    masked,
    open_study,
    requeue,
    storage_answers,
    storage_url,
    trial_config,
    trial_dir,
)

SETTINGS = {
    "tune_space": ("", "search-space file, one 'flag type range' line per flag (experiments/*.space)"),
    "tune_trials": (20, "complete or pruned trials the study runs to; a resumed study runs the rest"),
    "tune_objective": ("", "metric the task reports on --validation_split to optimize; empty: the task's objective"),
    "tune_direction": (
        "",
        "max|min the objective; empty: the task's direction (another --tune_objective must say it)",
        ("", "max", "min"),
    ),
    "tune_sampler": (
        "tpe",
        "random|tpe (Bayesian, tree-structured Parzen)|gp (needs PyTorch)",
        ("random", "tpe", "gp"),
    ),
    "tune_pruner": (
        "hyperband",
        "stops bad trials from their --eval_every evaluations: none|median|successive_halving|hyperband",
        ("none", "median", "successive_halving", "hyperband"),
    ),
    "tune_startup_trials": (
        5,
        "trials drawn at random (and never pruned by median) before the search learns",
        (0, None),
    ),
    "tune_timeout": (0.0, "seconds after which no new trial starts (a running one ends); 0 = none", (0, None)),
    "tune_storage": ("", "SQLAlchemy URL of the study, to share one across machines; empty: sqlite <workdir>/study.db"),
    "tune_study": ("tune", "name of the study in --tune_storage"),
    "validation_split": (
        "validation",
        "the split that scores trials (and, for --mode=ensemble, fits its weights); never the test split",
    ),
}


def tune(config, strategy=None):
    """Runs (or resumes) the study until --tune_trials trials finished or --tune_timeout passed; returns the
    summary, also written to workdir/summary.json, with best.flags and tune_report.png beside it."""
    started = time.time()
    config = validate(dataclasses.replace(config, mode="tune"))  # a notebook's Config too, as launch.py checks flags
    checks.check(config)
    space = parse_space(config.tune_space, config)
    objective, direction = objective_of(config)
    _check_workdir(config)  # before anything is written
    strategy = strategy or distribute.create_strategy(config.cluster)
    if objective != data_lib.task_class(config).objective[0]:
        _check_reported(config, objective, strategy)
    # Every trial builds its own tf.functions, which TensorFlow would report as excessive retracing.
    tf.get_logger().setLevel("ERROR")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines say what happens, without tracebacks
    # Heartbeats and the retry callback are marked experimental; they have been stable since Optuna 2.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # The lock a train run takes: one process in a workdir, whatever its mode; and with the default storage a trial
    # still RUNNING in the study is one a killed tuner left behind.
    with lock.Lock(config.workdir, doing=f"tuning study '{config.tune_study}'"):
        _check_workdir(config)  # again, under the lock: a train run may have written its config.json since
        study = open_study(config, objective, direction, space)
        write_json(
            os.path.join(config.workdir, workdir_lib.STUDY_NAME),
            {"study": config.tune_study, "storage": masked(storage_url(config))},
        )
        with storage_answers(config):
            return _run_study(config, study, space, strategy, objective, direction, started)


def _run_study(config, study, space, strategy, objective, direction, started):
    """Runs the open study's trials until --tune_trials finished or --tune_timeout passed; returns the summary."""
    finished = len(study.get_trials(deepcopy=False, states=FINISHED))
    if finished < config.tune_trials:
        print(
            f"tune: study '{config.tune_study}' in {masked(storage_url(config))}: {finished} of "
            f"{counted(config.tune_trials, 'trial')} finished; objective {config.validation_split} "
            f"{objective} ({direction}), sampler {config.tune_sampler}, pruner {config.tune_pruner}",
            flush=True,
        )
        study.optimize(
            _objective(config, space, strategy, objective),
            timeout=config.tune_timeout or None,
            callbacks=[
                optuna.study.MaxTrialsCallback(config.tune_trials, states=FINISHED),
                _announce(objective),
            ],
            gc_after_trial=True,
        )
    return tune_summary.results(config, study, space, objective, direction, time.time() - started)


def objective_of(config):
    """(metric, "max" or "min") the study optimizes: --tune_objective, by default the task's own objective, and
    --tune_direction, by default the task's direction for its own objective. Another metric needs its direction
    said: a task's reported numbers do not say which way is better."""
    own, own_direction = data_lib.task_class(config).objective
    name = config.tune_objective or own
    if config.tune_direction:
        return name, config.tune_direction
    if name != own:
        raise ConfigError(
            f"--tune_objective={name}: --task={config.task}'s own objective is {own} ({own_direction}); "
            f"for {name} say which way is better with --tune_direction=max or min"
        )
    return name, own_direction


def _check_reported(config, name, strategy):
    """Refuses, before any trial, an objective that an evaluation of this task does not report: the task's metrics
    as its report() names them, then what its probe() adds."""
    run = build.run(with_values(config, {}), strategy, "evaluate")
    # Ones, not zeros: a report may take a logarithm or divide.
    reported = set(run.task.report({metric: 1.0 for metric in run.evaluator.metric_names}))
    if name not in reported:
        reported |= set(run.task.probe(run.models, run.evaluator.examples))
    if name not in reported:
        raise ConfigError(
            f"--tune_objective={name}: --task={config.task} reports no such metric "
            f"(it reports {', '.join(sorted(reported))})"
        )


class Unreported(ConfigError):
    """An evaluation did not report the objective (a task whose own objective is none of its metrics)."""


def _value(results, name, config):
    """The objective in an evaluation's results; Unreported when the task did not report it."""
    if name not in results:
        reported = ", ".join(sorted(k for k in results if k != "examples"))
        raise Unreported(
            f"--tune_objective={name}: --task={config.task} reports no such metric (it reports {reported})"
        )
    return results[name]


def _check_workdir(config):
    """Refuses a workdir that holds a train run or another job's results (an ensemble's: the study's summary.json
    would replace theirs) or another study (its study.json names it)."""
    job, marker = workdir_lib.held_job(config.workdir)
    if job == "run":
        raise ConfigError(
            f"--workdir={config.workdir} holds a train run ({marker}): a study needs a --workdir of its own"
        )
    if job == "results":
        raise workdir_lib.others_results(config.workdir, marker, "study.json of a study", "a study")
    path = os.path.join(config.workdir, workdir_lib.STUDY_NAME)
    try:
        with tf.io.gfile.GFile(path) as f:
            said = json.loads(f.read())
            held, storage = said.get("study"), said.get("storage")
    except (tf.errors.NotFoundError, ValueError, AttributeError):  # none yet, or damaged: this tuner rewrites it
        return
    if held != config.tune_study:
        raise ConfigError(
            f"--tune_study={config.tune_study}: --workdir={config.workdir} holds study '{held}' ({path}); resume "
            f"it with --tune_study={held}, or give this study a new --workdir"
        )
    if _another_storage(config, storage):
        raise ConfigError(
            f"--tune_storage={masked(config.tune_storage)}: --workdir={config.workdir} holds study '{held}' in "
            f"{storage} ({path}); resume it with --tune_storage={storage}, or give this study a new --workdir"
        )
    database = os.path.join(config.workdir, "study.db")
    if not config.tune_storage and not tf.io.gfile.exists(database):  # deleted: opening it would make a new study
        raise ConfigError(
            f"--workdir={config.workdir}: {database} is gone, which holds study '{held}' ({path}); put it back, or "
            "give this study a new --workdir"
        )


def _another_storage(config, held):
    """Whether this command's storage is not `held`, the one study.json names: the study resumed there would be
    another, new one, whose trials would run in the first one's sub-workdirs. The workdir's own study.db is the
    study's wherever the workdir was moved to."""
    if held in (None, masked(storage_url(config))):
        return False
    return bool(config.tune_storage) or not tf.io.gfile.exists(os.path.join(config.workdir, "study.db"))


def _objective(config, space, strategy, name):
    def objective(trial):
        values = {p.name: p.suggest(trial) for p in space}
        resumes = trial.user_attrs.get(RESUMES)
        number = trial.number if resumes is None else resumes
        try:
            run_config = trial_config(config, values, number)
        except ConfigError as e:
            raise ConfigError(
                f"--tune_space={config.tune_space}: trial {trial.number} drew a bad config: {e}"
            ) from None
        if resumes is None and os.path.exists(run_config.workdir):
            raise ConfigError(
                f"--workdir={config.workdir}: {run_config.workdir} exists but study '{config.tune_study}' has not "
                "run it (a study of another name used this workdir?); use a fresh --workdir"
            )
        # Relative, so the study reads the same wherever its workdir is moved.
        trial.set_user_attr(WORKDIR, trial_dir(number))
        trial.set_user_attr(TUNER, config.workdir if not is_local(config.workdir) else os.path.abspath(config.workdir))
        again = "" if resumes is None else f" (trial {resumes} again, from its checkpoint)"
        print(f"tune: trial {trial.number}{again}: {_flags(values)} in {run_config.workdir}", flush=True)
        pruned_at = []
        reported = {int(step): value for step, value in trial.user_attrs.get(CURVE, {}).items()}
        for step, value in reported.items():  # a requeued trial's evaluations before it was interrupted
            trial.report(value, step)

        def on_eval(step, results):
            if step not in reported:  # a resumed run evaluates the step it resumes at again: reported already
                trial.report(_value(results, name, config), step)
            if trial.should_prune():
                pruned_at.append(step)
            return bool(pruned_at)

        try:
            summary = loop.train(run_config, strategy, on_eval)
        except TrainingError as e:  # a diverging draw is an outcome of the search, not a failure of it
            trial.set_user_attr("diverged", str(e))
            raise optuna.TrialPruned("diverged") from None
        except Preempted:
            requeue(trial.study, trial)  # it saved a checkpoint; the next tuner continues from it
            raise
        except Unreported:
            raise
        except ConfigError as e:
            raise ConfigError(f"--tune_space={config.tune_space}: trial {trial.number} cannot run: {e}") from None
        trial.set_user_attr("steps", summary["step"])
        if summary.get("stopped_by") == ON_EVAL and not pruned_at:  # pruned before a kill: its rerun says so
            pruned_at.append(summary["step"])
            # With the evaluation it was pruned at, which this trial (a requeued one) may not have reported: its value
            # and step, as a trial pruned without a kill has them.
            if summary["step"] not in reported:
                trial.report(_value(summary["eval"], name, config), summary["step"])
        if pruned_at:
            raise optuna.TrialPruned(f"at step {pruned_at[0]}")
        return _value(summary["eval"], name, config)

    return objective


def _flags(values):
    return " ".join(f"--{name}={show(value)}" for name, value in values.items())


def _announce(objective):
    def callback(study, trial):
        if trial.state == optuna.trial.TrialState.COMPLETE:
            outcome = f"complete: {objective}={trial.value:.5g}"
        elif "diverged" in trial.user_attrs:
            outcome = "pruned: diverged"
        elif trial.state == optuna.trial.TrialState.PRUNED:
            last = max(trial.intermediate_values, default=None)
            outcome = f"pruned at step {last}" + (
                f" ({objective}={trial.intermediate_values[last]:.5g})" if last is not None else ""
            )
        else:
            outcome = trial.state.name.lower()
        seconds = trial.duration.total_seconds() if trial.duration else 0.0
        best = best_trial(study)
        best_text = f"; best so far trial {best.number} ({best.value:.5g})" if best else ""
        print(f"tune: trial {trial.number} {outcome} in {seconds:.1f} s{best_text}", flush=True)

    return callback
