"""The tuner's Optuna study (research/tune.py): where it is stored, opened or resumed with the objective it was
started with, its sampler and pruner, and the trials a killed tuner left behind, requeued to resume from their own
checkpoints. The storage URL's password is shown as *** wherever the tuner writes or prints the URL."""

import contextlib
import dataclasses
import json
import os
import re
import time
import urllib.parse

import optuna
import sqlalchemy.exc
import tensorflow as tf

from engine.settings.config import first_line, load_run_config
from engine.settings.errors import CheckpointError, ConfigError, Preempted, TrainingError
from engine.settings.fields import SEED_LIMIT, applies, show
from engine.settings.identity import IDENTITY_SETTINGS
from engine.state.files import is_local
from research.space import with_values

RESUMES = "resumes"  # user attribute of a requeued trial: the number whose sub-workdir (and checkpoint) it continues
# User attribute of a requeued trial: the evaluations the trial it continues reported, {step as text: value}, which
# it reports again before it trains on: its learning curve (what pruners and tune_report.png read) starts at step 0.
CURVE = "curve"
# User attributes of a trial that drew its config: its sub-workdir, relative to its tuner's --workdir (which may be
# moved), and that --workdir as it was then (another tuner's, in a shared study).
WORKDIR, TUNER = "workdir", "tuner_workdir"
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)  # what --tune_trials counts
# Beside the identity settings, what makes a trial's number and what best.flags says of it: its length, the split that
# scores it (a trial's --eval_split), and whether it ran with --deterministic (best.flags promises "the same numbers").
# The command line's --eval_split is no trial's: trials evaluate on --validation_split.
TRIAL_SETTINGS = ("train_steps", "validation_split", "deterministic")
DIRECTIONS = {"max": optuna.study.StudyDirection.MAXIMIZE, "min": optuna.study.StudyDirection.MINIMIZE}


def trial_dir(number):
    """Trial `number`'s sub-workdir, relative to the study's --workdir."""
    return os.path.join("trials", str(number))


def trial_config(config, values, number):
    """The engine config of trial `number` (its sub-workdir) with the searched `values`; validated."""
    return with_values(config, values, os.path.join(config.workdir, trial_dir(number)))


def trial_workdir(config, trial):
    """The sub-workdir `trial` ran in (None: it drew no config): under this --workdir, wherever the workdir was moved
    since; where its own tuner keeps it when it is not here (another tuner's trial in a shared study). A study written
    before trials kept their sub-workdir relative named it whole: that path, when it is absolute and not here."""
    stored = trial.user_attrs.get(WORKDIR)
    if stored is None:
        return None
    here = os.path.join(config.workdir, trial_dir(os.path.basename(stored)))
    elsewhere = os.path.join(trial.user_attrs.get(TUNER, ""), stored)
    return here if tf.io.gfile.exists(here) or not _absolute(elsewhere) else elsewhere


def _absolute(path):
    return os.path.isabs(path) or not is_local(path)


def _trials_are_alike(study, config, space, where):
    """{"space": ..., "settings": ...}: what the study searched and the settings its trials share (those that make a
    run's numbers), JSON's values; ConfigError where a resumed study had others. Its trials must be comparable, and
    best.flags, written from this command line, must rerun its best trial (a resume with --train_steps=20 on a study
    of 300 ran a trial of 20 steps beside them, and wrote --train_steps=20 into best.flags)."""
    searched = {param.name for param in space}
    plain = json.loads(
        json.dumps(
            {
                "space": [dataclasses.asdict(p) for p in space],
                "settings": {
                    name: getattr(config, name)
                    for name in (*IDENTITY_SETTINGS, *TRIAL_SETTINGS)
                    if name not in searched and name != "eval_split" and applies(name, config)
                },
            }
        )
    )
    before = study.user_attrs.get("space", plain["space"])
    if before != plain["space"]:
        said = "; ".join(f"{p['name']} {p['kind']}" for p in before)
        raise ConfigError(
            f"--tune_space={config.tune_space}: study '{config.tune_study}' in {where} searched another space "
            f"({said}); use another --tune_study or --workdir"
        )
    for name, value in study.user_attrs.get("settings", {}).items():
        if plain["settings"].get(name, value) != value:
            was = tuple(value) if isinstance(value, list) else value
            raise ConfigError(
                f"--{name}={show(getattr(config, name))}: study '{config.tune_study}' in {where} ran its trials "
                f"with --{name}={show(was)}; resume it with the same settings, or use another --tune_study or "
                "--workdir"
            )
    return plain


def _check_trials_here(study, config, space, where):
    """Refuses a study that did not run the trials in this --workdir's trials/ (the workdir's study.db replaced by
    another study's, or made anew): its trials would run in their sub-workdirs, failing one trial a run there, and its
    summary would describe another study's trials."""
    folder = os.path.join(config.workdir, "trials")
    trials = study.get_trials(deepcopy=False)
    for name in sorted(tf.io.gfile.listdir(folder)) if tf.io.gfile.isdir(folder) else ():
        workdir = os.path.join(folder, name.rstrip("/"))
        ran = [t for t in trials if str(t.user_attrs.get(RESUMES, t.number)) == name.rstrip("/")]
        if not any(_drew_as_saved(t, config, space, workdir) for t in ran):
            raise ConfigError(
                f"--workdir={config.workdir}: study '{config.tune_study}' in {where} did not run {workdir} (the "
                "study was replaced, or made anew); put back the storage of the study that ran it, or give this "
                "study a new --workdir"
            )


def _drew_as_saved(trial, config, space, workdir):
    """Whether `trial` (or a trial that resumes it) drew the searched values that the run in `workdir` saved in its
    config.json. A trial still to draw, or a run killed before it wrote a config.json that reads, says nothing."""
    try:
        saved = load_run_config(workdir)
    except ConfigError:
        return True
    if saved is None or not trial.params:
        return True
    drawn = trial_config(config, trial.params, trial.number)
    return all(getattr(drawn, p.name) == getattr(saved, p.name) for p in space)


def storage_url(config):
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


def masked(url, text=None):
    """`text` (by default the URL itself) with the storage URL's passwords shown as ***."""
    text = url if text is None else text
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def open_study(config, objective, direction, space):
    url = storage_url(config)
    shared = bool(config.tune_storage)
    for attempt in range(3):
        try:
            storage = optuna.storages.RDBStorage(
                url,
                # Several machines on one study: a trial whose machine died (no heartbeat for 3 minutes) is
                # failed and requeued by whichever tuner notices first.
                heartbeat_interval=60 if shared else None,
                grace_period=180 if shared else None,
                heartbeat_stale_trial_callback=requeue if shared else None,
            )
            study = optuna.create_study(
                storage=storage,
                study_name=config.tune_study,
                direction=DIRECTIONS[direction],
                pruner=make_pruner(config, space),
                load_if_exists=True,
            )
            break
        except Exception as e:  # SQLAlchemy raises many kinds for a bad URL, driver or database
            if attempt < 2:
                time.sleep(1 + attempt)  # tuners started together race to create a new database's tables
                continue
            raise ConfigError(
                f"--tune_storage={masked(url)}: cannot open the study ({masked(url, first_line(e))})"
            ) from None
    wanted = {"objective": objective, "direction": direction}
    for key, value in wanted.items():
        if study.user_attrs.get(key, value) != value:
            raise ConfigError(
                f"--tune_{key}={value}: study '{config.tune_study}' in {masked(url)} was started with "
                f"--tune_{key}={study.user_attrs[key]}; use another --tune_study or --workdir"
            )
    wanted.update(_trials_are_alike(study, config, space, masked(url)))
    _check_trials_here(study, config, space, masked(url))
    if study.direction != DIRECTIONS[direction]:  # a study made outside the tuner (Optuna's default minimizes)
        ways = {DIRECTIONS["max"]: "maximizes", DIRECTIONS["min"]: "minimizes"}
        raise ConfigError(
            f"--tune_direction={direction}: study '{config.tune_study}' in {masked(url)} {ways[study.direction]} "
            "its objective; use another --tune_study or --workdir"
        )
    for key, value in wanted.items():
        study.set_user_attr(key, value)
    if not shared:
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            # We hold the workdir's lock, so no one is running it: a killed tuner left it.
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            requeue(study, trial)
    # Reseeded past the trials already drawn: a resumed study must not draw its first points again.
    study.sampler = make_sampler(config, offset=len(study.get_trials(deepcopy=False)))
    return study


@contextlib.contextmanager
def storage_answers(config):
    """Ends a study whose storage fails once it is open (its disk full or read-only, its database gone) with one
    CheckpointError line naming the storage, as a run whose workdir cannot be written ends (exit 4), not in the
    traceback Optuna's own error handling raises then. The same command resumes the study once the storage answers:
    the trial it was running is still RUNNING there, and is requeued."""
    try:
        yield
    except (ConfigError, CheckpointError, Preempted, TrainingError):
        raise
    except Exception as e:
        failed = _storage_error(e)
        if failed is None:
            raise
        url = storage_url(config)
        raise CheckpointError(
            f"--tune_storage={masked(url)}: the study's storage failed ({masked(url, first_line(failed))}); its "
            "finished trials are kept there: run the same command to resume once it answers"
        ) from None


def _storage_error(error):
    """The database's own error behind `error` (Optuna raises others over it, and fails again handling it), or
    None."""
    while error is not None:
        if isinstance(error, sqlalchemy.exc.DBAPIError) and error.orig is not None:
            return error.orig
        if isinstance(error, sqlalchemy.exc.SQLAlchemyError):
            return error
        error = error.__cause__ or error.__context__
    return None


def requeue(study, trial):
    """Runs an interrupted trial's parameters again, in its own sub-workdir, so it resumes from its checkpoint, with
    the evaluations it reported."""
    if not trial.params:
        return  # stopped before it drew anything: nothing to resume
    origin = trial.user_attrs.get(RESUMES, trial.number)
    # A running trial's own Trial object holds no reports: its record in the study does.
    (record,) = [t for t in study.get_trials(deepcopy=False) if t.number == trial.number]
    curve = {str(step): value for step, value in sorted(record.intermediate_values.items())}
    study.enqueue_trial(trial.params, user_attrs={RESUMES: origin, CURVE: curve})
    print(f"tune: trial {trial.number} was interrupted; requeued to resume in trials/{origin}", flush=True)


def make_sampler(config, offset):
    seed = (config.seed + offset) % SEED_LIMIT  # NumPy's generators under Optuna's samplers take 32 bits
    if config.tune_sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if config.tune_sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=config.tune_startup_trials)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=config.tune_startup_trials)


def make_pruner(config, space):
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


def best_trial(study):
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None
