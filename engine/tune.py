"""--mode=tune: a hyperparameter search whose every trial is a real engine run.

Optuna does the searching (random, TPE or a Gaussian process) and the early stopping (median, successive
halving, Hyperband); this file turns its draws into configs, runs each with engine.loop.train in
<workdir>/trials/<n>, reports every evaluation back so a hopeless trial stops early, and writes the results.
The study lives in SQLite in the workdir (or in --tune_storage, which several machines can share), so a
killed tuner restarted with the same command keeps its finished trials and resumes an interrupted one from
that trial's own checkpoint. Trials are scored on --validation_split: tuning never sees the test split.

The search space is a text file, one searched flag per line (`#` starts a comment):

    learning_rate   log     1e-4  1e-1      # log-uniform float in [low, high]
    weight_decay    float   0     1e-3      # uniform float
    warmup_steps    int     0     100       # integer in [low, high]
    hidden_sizes    choice  64 128,128      # one of these values, written as after --flag=
"""

import contextlib
import dataclasses
import fcntl
import math
import os
import re
import time
import warnings

import optuna
import tensorflow as tf

from engine import distribute, loop
from engine.config import Config, ConfigError, first_line, show, validate
from engine.report import make_workdir, write_json

KINDS = ("int", "float", "log", "choice")
BETTER = {"accuracy": "max", "loss": "min"}  # the direction an eval metric improves in
# One strategy (and cluster) serves every trial of the process; where trials are scored and written is the tuner's.
NOT_SEARCHABLE = {
    "mode",
    "workdir",
    "eval_split",
    "validation_split",
    "members",
    "strategy",
    "num_cpu_devices",
    "tpu",
    "cluster_resolver",
    "collective_timeout",
    "connect_timeout",
    "local_workers",
    "num_ps",
    "slurm_port_base",
    "kubernetes_selector",
}
RESUMES = "resumes"  # user attribute of a requeued trial: the number whose sub-workdir (and checkpoint) it continues
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)  # what --tune_trials counts


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS
    low: float = None
    high: float = None
    choices: tuple = ()

    def suggest(self, trial):
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high)
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, self.choices)
        return trial.suggest_float(self.name, self.low, self.high, log=self.kind == "log")


def parse_space(path):
    """The search space in `path` as a list of Param; raises ConfigError naming the file, line and why."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"--tune_space={path}: cannot read it ({e.strerror})") from None
    fields = {f.name: f for f in dataclasses.fields(Config)}
    params = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#")[0].split()
        if not words:
            continue

        def bad(why):
            raise ConfigError(f"--tune_space={path}: line {number} ({line.strip()!r}): {why}")

        name, kind, args = words[0], (words[1] if len(words) > 1 else ""), words[2:]
        field = fields.get(name)
        if field is None:
            bad(f"no flag --{name}")
        if name in NOT_SEARCHABLE or name.startswith(("tune_", "ensemble_")):
            bad(f"--{name} belongs to the tuner and cannot be searched")
        if name in params:
            bad(f"--{name} appears twice")
        if kind not in KINDS:
            bad(f"the type must be one of {', '.join(KINDS)}")
        if kind == "choice":
            if not args:
                bad("choice needs at least one value")
            try:
                params[name] = Param(name, kind, choices=tuple(_choice_value(field.type, a) for a in args))
            except ValueError:
                bad(f"every value must be a {field.type.__name__} as --{name} takes it")
            continue
        wanted = int if kind == "int" else float
        if field.type is not wanted:
            bad(f"--{name} takes a {field.type.__name__}: use {'int' if field.type is int else 'choice'}")
        try:
            low, high = (wanted(a) for a in args)
        except ValueError:
            bad(f"{kind} needs LOW HIGH, two {wanted.__name__}s")
        if not low < high or (kind == "log" and low <= 0):
            bad("needs LOW < HIGH" + (" and LOW > 0 (log-uniform)" if kind == "log" else ""))
        params[name] = Param(name, kind, low, high)
    if not params:
        raise ConfigError(
            f"--tune_space={path}: no searched flag in it (lines look like 'learning_rate log 1e-4 1e-1')"
        )
    return list(params.values())


def _choice_value(kind, text):
    """A choice as Optuna stores it: bool, int, float, str; a list flag as its normalized text ("64,64")."""
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if kind is tuple:
        return ",".join(str(int(v)) for v in text.split(","))
    return kind(text)


def trial_config(config, values, number):
    """The engine config of trial `number` (its sub-workdir) with the searched `values`; validated."""
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    overrides = {
        name: tuple(int(v) for v in value.split(",")) if fields[name] is tuple else value
        for name, value in values.items()
    }
    return validate(
        dataclasses.replace(
            config,
            mode="train",
            workdir=os.path.join(config.workdir, "trials", str(number)),
            eval_split=config.validation_split,  # the tuner never looks at the test split
            **overrides,
        )
    )


def tune(config, strategy=None):
    """Runs (or resumes) the study until --tune_trials trials finished or --tune_timeout passed; returns the
    summary, also written to workdir/summary.json, with best.flags and tune_report.png beside it."""
    started = time.time()
    space = parse_space(config.tune_space)
    direction = config.tune_direction or BETTER[config.tune_objective]
    name = distribute.strategy_name(config)
    if name not in ("one_device", "mirrored", "tpu"):
        raise ConfigError(
            f"--strategy={name}: --mode=tune runs its trials in one process (one_device, mirrored or tpu); "
            "on several machines start one tuner on each, sharing a study through --tune_storage"
        )
    strategy = strategy or distribute.create_strategy(config)
    make_workdir(config.workdir)
    # Every trial builds its own tf.functions, which TensorFlow would report as excessive retracing.
    tf.get_logger().setLevel("ERROR")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines say what happens, without tracebacks
    # Heartbeats and the retry callback are marked experimental; they have been stable since Optuna 2.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    with _only_tuner(config):
        study = _open_study(config, direction, space)
        finished = len(study.get_trials(deepcopy=False, states=FINISHED))
        if finished < config.tune_trials:
            print(
                f"tune: study '{config.tune_study}' in {_masked(_storage_url(config))}: {finished} of "
                f"{config.tune_trials} trials finished; objective {config.validation_split} "
                f"{config.tune_objective} ({direction}), sampler {config.tune_sampler}, pruner {config.tune_pruner}",
                flush=True,
            )
            study.optimize(
                _objective(config, space, strategy),
                timeout=config.tune_timeout or None,
                callbacks=[optuna.study.MaxTrialsCallback(config.tune_trials, states=FINISHED), _announce(config)],
                gc_after_trial=True,
            )
    return _results(config, study, space, direction, time.time() - started)


def _storage_url(config):
    return config.tune_storage or f"sqlite:///{os.path.abspath(os.path.join(config.workdir, 'study.db'))}"


def _masked(url):
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


@contextlib.contextmanager
def _only_tuner(config):
    """With the default storage in the workdir, one tuner at a time: then a trial still RUNNING in the study
    is one a killed tuner left behind. A shared --tune_storage uses heartbeats instead."""
    if config.tune_storage:
        yield
        return
    path = os.path.join(config.workdir, "tune.lock")
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"--workdir={config.workdir}: another tuner is running this study ({path} is locked); "
                "to tune one study from several processes share it with --tune_storage"
            ) from None
        yield


def _open_study(config, direction, space):
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
                direction="maximize" if direction == "max" else "minimize",
                pruner=_pruner(config, space),
                load_if_exists=True,
            )
            break
        except Exception as e:  # SQLAlchemy raises many kinds for a bad URL, driver or database
            if attempt < 2:
                time.sleep(1 + attempt)  # tuners started together race to create a new database's tables
                continue
            raise ConfigError(f"--tune_storage={_masked(url)}: cannot open the study ({first_line(e)})") from None
    wanted = {"objective": config.tune_objective, "direction": direction}
    for key, value in wanted.items():
        if study.user_attrs.get(key, value) != value:
            raise ConfigError(
                f"--tune_{key}={value}: study '{config.tune_study}' in {_masked(url)} was started with "
                f"--tune_{key}={study.user_attrs[key]}; use another --tune_study or --workdir"
            )
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
    seed = config.seed + offset
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


def _objective(config, space, strategy):
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
            trial.report(results[config.tune_objective], step)
            if trial.should_prune():
                pruned_at.append(step)
            return bool(pruned_at)

        try:
            summary = loop.train(run_config, strategy, on_eval)
        except loop.TrainingError as e:  # a diverging draw is an outcome of the search, not a failure of it
            trial.set_user_attr("diverged", str(e))
            raise optuna.TrialPruned("diverged") from None
        except loop.Preempted:
            _requeue(trial.study, trial)  # it saved a checkpoint; the next tuner continues from it
            raise
        except ConfigError as e:
            raise ConfigError(f"--tune_space={config.tune_space}: trial {trial.number} cannot run: {e}") from None
        trial.set_user_attr("steps", summary["step"])
        if pruned_at:
            raise optuna.TrialPruned(f"at step {pruned_at[0]}")
        return summary["eval"][config.tune_objective]

    return objective


def _flags(values):
    return " ".join(f"--{name}={show(value)}" for name, value in values.items())


def _announce(config):
    def callback(study, trial):
        if trial.state == optuna.trial.TrialState.COMPLETE:
            outcome = f"complete: {config.tune_objective}={trial.value:.5g}"
        elif "diverged" in trial.user_attrs:
            outcome = "pruned: diverged"
        elif trial.state == optuna.trial.TrialState.PRUNED:
            last = max(trial.intermediate_values, default=None)
            outcome = f"pruned at step {last}" + (
                f" ({config.tune_objective}={trial.intermediate_values[last]:.5g})" if last is not None else ""
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


def _results(config, study, space, direction, wall_seconds):
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state in FINISHED]
    best = _best(study)
    importances = _importances(study)
    summary = {
        "study": config.tune_study,
        "storage": _masked(_storage_url(config)),
        "objective": config.tune_objective,
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
        write_flagfile(flagfile, config, best, space)
        summary["best"] = {
            "trial": best.number,
            "value": best.value,
            "params": best.params,
            "steps": best.user_attrs.get("steps"),
            "workdir": best.user_attrs.get("workdir"),
            "flagfile": flagfile,
        }
    write_json(os.path.join(config.workdir, "summary.json"), summary)
    plot(os.path.join(config.workdir, "tune_report.png"), config, trials, space, best, importances, direction)
    return summary


def _importances(study):
    """PED-ANOVA (Optuna's default; fANOVA would need scikit-learn): how much each parameter separates the
    best trials from the rest."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        return dict(optuna.importance.get_param_importances(study))
    except (ValueError, RuntimeError):  # e.g. every complete trial drew the same values
        return {}


def write_flagfile(path, config, best, space):
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
        f"{config.validation_split} {config.tune_objective} {best.value:.6g} at step {best.user_attrs.get('steps')}.",
        f"#   python launch.py --flagfile={path}",
        f"# reruns it with {exact}; add --eval_split=test (after the flagfile) for its held-out accuracy.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(header + lines) + "\n")


def plot(path, config, trials, space, best, importances, direction):
    """tune_report.png: the objective per trial with the best so far, the learning curves that pruning judged,
    the parameters' importance and a parallel-coordinates view of the complete trials."""
    from matplotlib.figure import Figure  # deferred: matplotlib takes a second to import

    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    pruned_numbers = {t.number for t in pruned}
    fig = Figure(figsize=(14, 10), layout="constrained")
    (history, curves), (importance, coords) = fig.subplots(2, 2)
    metric = f"{config.validation_split} {config.tune_objective}"
    fig.suptitle(f"study '{config.tune_study}': {len(complete)} complete, {len(pruned)} pruned ({direction} {metric})")

    history.scatter([t.number for t in complete], [t.value for t in complete], label="complete", zorder=3)
    last = [(t.number, t.intermediate_values[max(t.intermediate_values)]) for t in pruned if t.intermediate_values]
    if last:
        history.scatter(*zip(*last), marker="x", color="tab:red", label="pruned (last evaluation)", zorder=3)
    better = max if direction == "max" else min
    best_so_far, xs = [], []
    for t in sorted(complete, key=lambda t: t.number):
        best_so_far.append(t.value if not best_so_far else better(best_so_far[-1], t.value))
        xs.append(t.number)
    if xs:
        history.step(xs, best_so_far, where="post", color="tab:green", label="best so far")
    history.set(title="objective per trial", xlabel="trial", ylabel=metric)
    history.legend()

    for t in trials:
        points = dict(t.intermediate_values)
        if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("steps"):
            points[t.user_attrs["steps"]] = t.value  # the final evaluation, which is no intermediate report
        if points:
            steps = sorted(points)
            is_best = best is not None and t.number == best.number
            curves.plot(
                steps,
                [points[s] for s in steps],
                marker="o",
                markersize=3,
                color="tab:green" if is_best else ("tab:red" if t.number in pruned_numbers else "tab:blue"),
                linestyle="--" if t.number in pruned_numbers else "-",
                linewidth=2.5 if is_best else 1,
                alpha=1 if is_best else 0.6,
            )
    curves.set(title="evaluations during training (dashed: pruned, green: best)", xlabel="step", ylabel=metric)

    if importances:
        names = list(importances)[::-1]
        importance.barh(names, [importances[n] for n in names])
        importance.set(title="parameter importance (PED-ANOVA over complete trials)", xlabel="importance (normalized)")
    else:
        importance.text(0.5, 0.5, "importance needs two complete trials\nwith different values", ha="center")
        importance.set(title="parameter importance", xticks=[], yticks=[])

    _parallel_coordinates(fig, coords, complete, space, best, metric)
    fig.savefig(path, dpi=80)


def _parallel_coordinates(fig, ax, complete, space, best, metric):
    import matplotlib as mpl

    ax.set(title="parallel coordinates of complete trials", xticks=range(len(space)))
    ax.set_xticklabels([p.name for p in space], rotation=20)
    if not complete:
        return
    values = [t.value for t in complete]
    norm = mpl.colors.Normalize(min(values), max(values))
    cmap = mpl.colormaps["viridis"]
    for t in complete:
        ys = [_position(p, t.params[p.name]) for p in space]
        is_best = best is not None and t.number == best.number
        ax.plot(range(len(space)), ys, color="tab:red" if is_best else cmap(norm(t.value)), lw=3 if is_best else 1.2)
    for i, p in enumerate(space):
        ends = [str(c) for c in p.choices] if p.kind == "choice" else [f"{p.low:g}", f"{p.high:g}"]
        for label, y in zip(ends, [_position(p, v) for v in (p.choices or (p.low, p.high))]):
            ax.annotate(label, (i, y), fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.set(yticks=[], ylim=(-0.05, 1.05))
    fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"{metric} (red: best)")


def _position(param, value):
    """Where `value` sits on its axis, from 0 (low, first choice) to 1 (high, last choice)."""
    if param.kind == "choice":
        return param.choices.index(value) / max(1, len(param.choices) - 1)
    if param.kind == "log":
        return (math.log(value) - math.log(param.low)) / (math.log(param.high) - math.log(param.low))
    return (value - param.low) / (param.high - param.low)
