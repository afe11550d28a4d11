"""--mode=tune: a hyperparameter search whose every trial is a real engine run.

Optuna does the searching (random, TPE or a Gaussian process) and the early stopping (median, successive
halving, Hyperband); this file turns its draws into configs, runs each with engine.run.loop.train in
<workdir>/trials/<n>, reports every evaluation back so a hopeless trial stops early, and writes the results.
The study lives in SQLite in the workdir (or in --tune_storage, which several machines can share), so a
killed tuner restarted with the same command keeps its finished trials and resumes an interrupted one from
that trial's own checkpoint. Trials are scored on --validation_split: tuning never sees the test split.
A tuner holds its workdir's lock as a train run does (engine/workdir.py), and its study.json marks the workdir as a
study's: a train run is refused there, and a tuner in a train run's workdir. The storage URL's password is shown
as *** wherever the tuner writes or prints the URL, and a trial's config leaves the storage out.

Every task is tuned alike: the objective is a metric the task reports, by default its own `Task.objective`
(name and direction). The search space is a text file, one searched flag per line; research/space.py reads it and
says how it looks.
"""

import dataclasses
import io
import json
import math
import os
import re
import time
import urllib.parse
import warnings

import numpy as np
import optuna
import tensorflow as tf

from engine.cluster import distribute
from engine.data import datasets as data_lib
from engine.run import build, loop
from engine.settings.config import first_line
from engine.settings.errors import ConfigError, Preempted, TrainingError
from engine.settings.fields import SEED_LIMIT, Config, show
from engine.state import workdir as workdir_lib
from engine.state.report import write_json
from research import checks
from research.space import parse_space, with_values

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


RESUMES = "resumes"  # user attribute of a requeued trial: the number whose sub-workdir (and checkpoint) it continues
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)  # what --tune_trials counts
_DIRECTIONS = {"max": optuna.study.StudyDirection.MAXIMIZE, "min": optuna.study.StudyDirection.MINIMIZE}


def trial_config(config, values, number):
    """The engine config of trial `number` (its sub-workdir) with the searched `values`; validated."""
    return with_values(config, values, os.path.join(config.workdir, "trials", str(number)))


def tune(config, strategy=None):
    """Runs (or resumes) the study until --tune_trials trials finished or --tune_timeout passed; returns the
    summary, also written to workdir/summary.json, with best.flags and tune_report.png beside it."""
    started = time.time()
    checks.check(config)
    space = parse_space(config.tune_space, config)
    objective, direction = objective_of(config)
    name = distribute.strategy_name(config)
    if name not in ("one_device", "mirrored", "tpu"):
        raise ConfigError(
            f"--strategy={name}: --mode=tune runs its trials in one process (one_device, mirrored or tpu); "
            "on several machines start one tuner on each, sharing a study through --tune_storage"
        )
    _check_workdir(config)  # before anything is written
    strategy = strategy or distribute.create_strategy(config)
    if objective != data_lib.task_class(config).objective[0]:
        _check_reported(config, objective, strategy)
    # Every trial builds its own tf.functions, which TensorFlow would report as excessive retracing.
    tf.get_logger().setLevel("ERROR")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines say what happens, without tracebacks
    # Heartbeats and the retry callback are marked experimental; they have been stable since Optuna 2.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # The lock a train run takes: one process in a workdir, whatever its mode; and with the default storage a trial
    # still RUNNING in the study is one a killed tuner left behind.
    with workdir_lib.Lock(config.workdir, doing=f"tuning study '{config.tune_study}'"):
        _check_workdir(config)  # again, under the lock: a train run may have written its config.json since
        study = _open_study(config, objective, direction, space)
        write_json(
            os.path.join(config.workdir, workdir_lib.STUDY_NAME),
            {"study": config.tune_study, "storage": _masked(_storage_url(config))},
        )
        finished = len(study.get_trials(deepcopy=False, states=FINISHED))
        if finished < config.tune_trials:
            print(
                f"tune: study '{config.tune_study}' in {_masked(_storage_url(config))}: {finished} of "
                f"{config.tune_trials} trials finished; objective {config.validation_split} "
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
        return _results(config, study, space, objective, direction, time.time() - started)


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
    run = build.run(with_values(config, {}), strategy, training=False)
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
    """Refuses a workdir that holds a train run (the study's summary.json would replace the run's) or another
    study (its study.json names it)."""
    path = os.path.join(config.workdir, "config.json")
    if tf.io.gfile.exists(path):
        raise ConfigError(
            f"--workdir={config.workdir} holds a train run ({path}): a study needs a --workdir of its own"
        )
    path = os.path.join(config.workdir, workdir_lib.STUDY_NAME)
    try:
        with tf.io.gfile.GFile(path) as f:
            held = json.loads(f.read()).get("study")
    except (tf.errors.NotFoundError, ValueError, AttributeError):  # none yet, or damaged: this tuner rewrites it
        return
    if held != config.tune_study:
        raise ConfigError(
            f"--tune_study={config.tune_study}: --workdir={config.workdir} holds study '{held}' ({path}); resume "
            f"it with --tune_study={held}, or give this study a new --workdir"
        )


def _storage_url(config):
    return config.tune_storage or f"sqlite:///{os.path.abspath(os.path.join(config.workdir, 'study.db'))}"


def _secrets(url):
    """The passwords in a storage URL, as written and percent-decoded: its user part's (everything from the
    user's ':' to the last '@' before the query, so a password with an '@' or a malformed URL is still covered)
    and any password parameter of its query."""
    head, _, query = url.partition("?")
    found = re.findall(r"(?:^|[&;])(?:password|passwd|pwd)=([^&;]*)", query, flags=re.IGNORECASE)
    if "@" in head:
        found.append(head.rpartition("@")[0].split("://", 1)[-1].partition(":")[2])
    return sorted({text for raw in found for text in (raw, urllib.parse.unquote(raw)) if text}, key=len, reverse=True)


def _masked(url, text=None):
    """`text` (by default the URL itself) with the storage URL's passwords shown as ***."""
    text = url if text is None else text
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def _open_study(config, objective, direction, space):
    url = _storage_url(config)
    shared = bool(config.tune_storage)
    for attempt in range(3):
        try:
            storage = optuna.storages.RDBStorage(
                url,
                # Several machines on one study: a trial whose machine died (no heartbeat for 3 minutes) is
                # failed and requeued by whichever tuner notices first.
                heartbeat_interval=60 if shared else None,
                grace_period=180 if shared else None,
                heartbeat_stale_trial_callback=_requeue if shared else None,
            )
            study = optuna.create_study(
                storage=storage,
                study_name=config.tune_study,
                direction=_DIRECTIONS[direction],
                pruner=_pruner(config, space),
                load_if_exists=True,
            )
            break
        except Exception as e:  # SQLAlchemy raises many kinds for a bad URL, driver or database
            if attempt < 2:
                time.sleep(1 + attempt)  # tuners started together race to create a new database's tables
                continue
            raise ConfigError(
                f"--tune_storage={_masked(url)}: cannot open the study ({_masked(url, first_line(e))})"
            ) from None
    wanted = {"objective": objective, "direction": direction}
    for key, value in wanted.items():
        if study.user_attrs.get(key, value) != value:
            raise ConfigError(
                f"--tune_{key}={value}: study '{config.tune_study}' in {_masked(url)} was started with "
                f"--tune_{key}={study.user_attrs[key]}; use another --tune_study or --workdir"
            )
    if study.direction != _DIRECTIONS[direction]:  # a study made outside the tuner (Optuna's default minimizes)
        ways = {_DIRECTIONS["max"]: "maximizes", _DIRECTIONS["min"]: "minimizes"}
        raise ConfigError(
            f"--tune_direction={direction}: study '{config.tune_study}' in {_masked(url)} {ways[study.direction]} "
            "its objective; use another --tune_study or --workdir"
        )
    for key, value in wanted.items():
        study.set_user_attr(key, value)
    if not shared:
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            # We hold the workdir's lock, so no one is running it: a killed tuner left it.
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            _requeue(study, trial)
    # Reseeded past the trials already drawn: a resumed study must not draw its first points again.
    study.sampler = _sampler(config, offset=len(study.get_trials(deepcopy=False)))
    return study


def _requeue(study, trial):
    """Runs an interrupted trial's parameters again, in its own sub-workdir, so it resumes from its checkpoint."""
    if not trial.params:
        return  # stopped before it drew anything: nothing to resume
    origin = trial.user_attrs.get(RESUMES, trial.number)
    study.enqueue_trial(trial.params, user_attrs={RESUMES: origin})
    print(f"tune: trial {trial.number} was interrupted; requeued to resume in trials/{origin}", flush=True)


def _sampler(config, offset):
    seed = (config.seed + offset) % SEED_LIMIT  # NumPy's generators under Optuna's samplers take 32 bits
    if config.tune_sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if config.tune_sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=config.tune_startup_trials)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=config.tune_startup_trials)


def _pruner(config, space):
    """Pruners count resources in training steps: trials report at every --eval_every steps."""
    if config.tune_pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=config.tune_startup_trials, n_warmup_steps=0)
    if config.tune_pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=config.eval_every, reduction_factor=3)
    if config.tune_pruner == "hyperband":
        searched_steps = any(p.name == "train_steps" for p in space)
        return optuna.pruners.HyperbandPruner(
            min_resource=config.eval_every,
            max_resource="auto" if searched_steps else config.train_steps,
            reduction_factor=3,
        )
    return optuna.pruners.NopPruner()


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
        trial.set_user_attr("workdir", run_config.workdir)
        again = "" if resumes is None else f" (trial {resumes} again, from its checkpoint)"
        print(f"tune: trial {trial.number}{again}: {_flags(values)} in {run_config.workdir}", flush=True)
        pruned_at = []

        def on_eval(step, results):
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
            _requeue(trial.study, trial)  # it saved a checkpoint; the next tuner continues from it
            raise
        except Unreported:
            raise
        except ConfigError as e:
            raise ConfigError(f"--tune_space={config.tune_space}: trial {trial.number} cannot run: {e}") from None
        trial.set_user_attr("steps", summary["step"])
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
        best = _best(study)
        best_text = f"; best so far trial {best.number} ({best.value:.5g})" if best else ""
        print(f"tune: trial {trial.number} {outcome} in {seconds:.1f} s{best_text}", flush=True)

    return callback


def _best(study):
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


def _results(config, study, space, objective, direction, wall_seconds):
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state in FINISHED]
    best = _best(study)
    importances = _importances(study)
    summary = {
        "study": config.tune_study,
        "storage": _masked(_storage_url(config)),
        "task": config.task,
        "objective": objective,
        "direction": direction,
        "split": config.validation_split,
        "sampler": config.tune_sampler,
        "pruner": config.tune_pruner,
        "trials": len(finished),
        "complete": sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials),
        "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in trials),
        "failed": sum(t.state == optuna.trial.TrialState.FAIL for t in trials),
        "wall_seconds": wall_seconds,
        "trial_seconds": sum(t.duration.total_seconds() for t in finished if t.duration),
        "importances": importances,
        "best": None,
        "all": [
            {
                "number": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "params": t.params,
                "steps": t.user_attrs.get("steps"),
                "workdir": t.user_attrs.get("workdir"),
                "seconds": t.duration.total_seconds() if t.duration else None,
            }
            for t in trials
        ],
    }
    if best is not None:
        flagfile = os.path.join(config.workdir, "best.flags")
        write_flagfile(flagfile, config, best, space, objective)
        summary["best"] = {
            "trial": best.number,
            "value": best.value,
            "params": best.params,
            "steps": best.user_attrs.get("steps"),
            "workdir": best.user_attrs.get("workdir"),
            "flagfile": flagfile,
        }
    write_json(os.path.join(config.workdir, "summary.json"), summary)
    plot(
        os.path.join(config.workdir, "tune_report.png"), config, trials, space, best, importances, objective, direction
    )
    return summary


def _importances(study):
    """PED-ANOVA (Optuna's default; fANOVA would need scikit-learn): how much each parameter separates the
    best trials from the rest."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():  # that the quantiles select the same trials: the zero sum below says it
            warnings.simplefilter("ignore")
            raw = optuna.importance.get_param_importances(study, normalize=False)
    except (ValueError, RuntimeError):  # e.g. every complete trial drew the same values
        return {}
    total = sum(raw.values())
    # All zero when no parameter tells the best trials from the rest (say, all tied): Optuna would then call
    # every parameter equally important.
    return {name: value / total for name, value in sorted(raw.items(), key=lambda kv: -kv[1])} if total > 0 else {}


def write_flagfile(path, config, best, space, objective):
    """best.flags: every flag of the best trial that differs from the defaults, plus its seed and determinism,
    so `launch.py --flagfile=best.flags` trains it again and reaches the same number."""
    run_config = trial_config(config, best.params, best.number)
    default = Config()
    searched = {p.name for p in space}
    tuner_only = {"mode", "workdir", "eval_split", "validation_split", "members", "checkpoint", "export_dir"}
    lines = []
    for field in dataclasses.fields(Config):
        name, value = field.name, getattr(run_config, field.name)
        if name in tuner_only or name.startswith(("tune_", "ensemble_")) or name in ("seed", "deterministic"):
            continue
        if name in searched or value != getattr(default, name):
            lines.append(f"--{name}={show(value)}")
    lines += [
        f"--eval_split={config.validation_split}",
        f"--workdir={os.path.join(config.workdir, 'best')}",
        f"--seed={run_config.seed}",
        f"--deterministic={show(run_config.deterministic)}",
    ]
    exact = (
        "the same numbers"
        if run_config.deterministic
        else "numbers within run-to-run noise (the trials ran without --deterministic)"
    )
    header = [
        f"# Best trial {best.number} of study '{config.tune_study}' ({config.workdir}): "
        f"{config.validation_split} {objective} {best.value:.6g} at step {best.user_attrs.get('steps')}.",
        f"#   python launch.py --flagfile={path}",
        f"# reruns it with {exact}; add --eval_split=test (after the flagfile) for its held-out {objective}.",
    ]
    workdir_lib.replace_text(path, "\n".join(header + lines) + "\n")  # never through a link planted at the name


def plot(path, config, trials, space, best, importances, objective, direction):
    """Writes tune_report.png (see figure), never through a link planted at the name."""
    buffer = io.BytesIO()
    figure(config, trials, space, best, importances, objective, direction).savefig(buffer, dpi=80, format="png")
    workdir_lib.replace_text(path, buffer.getvalue())


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
