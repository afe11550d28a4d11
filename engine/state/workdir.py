"""A workdir holds one run: its settings (config.json) say which, and one process at a time trains in it.

The identity check: a train run started in a workdir whose config.json has other identity settings
(engine/settings/identity.py IDENTITY_SETTINGS: model, data, optimizer, schedule, seed, batch, precision, reported
split)
is refused, naming each setting, before anything is written; the same command resumes, a higher
--train_steps continues, cadence and execution settings never block.

The lock, one process at a time: engine/state/lock.py.

How a run writes its files there: engine/state/files.py.
"""

import dataclasses
import json
import os

import tensorflow as tf

from engine.settings import plugins
from engine.settings.config import load_run_config
from engine.settings.errors import ConfigError, counted
from engine.settings.fields import FIELD_BY_NAME, show
from engine.settings.identity import ORDER_SETTINGS, identity_changes
from engine.state import kept_source
from engine.state.checkpoint import list_checkpoints
from engine.state.files import is_local, write_json, writing

STUDY_NAME = "study.json"  # what marks a tuner's workdir (research/tune.py), which a train run is refused


def check_same_run(config, unread=ORDER_SETTINGS):
    """Refuses (ConfigError) a train run in a workdir that holds a tuning study, another job's results (an
    ensemble's summary.json) or a run with other identity settings; returns the saved Config, or None in a new
    workdir. A run that saved no checkpoint (refused as its first batches loaded: bad data, a source setting to
    correct) left nothing to resume: its workdir is new to a command with other settings. `unread`: the order
    settings its training split does not read, which its data says (Data.unread): all of them before it is loaded."""
    check_not_inside_a_run(config.workdir)
    job, marker = held_job(config.workdir)
    if job == "study":  # its summary.json is the study's, which this run's would replace
        raise ConfigError(
            f"--workdir={config.workdir} holds a tuning study ({marker}): a train run needs a --workdir of its own; "
            "the study's trials train in its trials/ folder"
        )
    if job == "results":
        raise others_results(config.workdir, marker, "config.json of a train run", "a train run")
    saved = load_run_config(config.workdir)
    if saved is None:  # a new workdir, or a train run's from before config.json: its checkpoints' check speaks
        return None
    changes = identity_changes(saved, config, unread)
    if changes and not list_checkpoints(os.path.join(config.workdir, "checkpoints")):
        return None
    if changes:
        listed = "; ".join(f"--{name}={show(old)} there, {show(new)} here" for name, old, new in changes)
        hint = ""
        if [name for name, _, _ in changes] == ["eval_split"]:
            hint = f" (to evaluate it on another split: --mode=eval --workdir={config.workdir} --eval_split=...)"
        raise ConfigError(
            f"--workdir={config.workdir} holds a run with other settings ({os.path.join(config.workdir, 'config.json')}"
            f"): {listed}. Rerun it with its own settings to resume it, or give this run a new --workdir"
            f" ({_free_name(config.workdir)} is free){hint}"
        )
    return saved


def check_not_inside_a_run(workdir):
    """Refuses a workdir that is the checkout itself or a file system's root, or inside another train run's workdir
    (its checkpoints/ or eval/ folder): the two runs' files would mix there (TensorBoard would draw both)."""
    remote = not is_local(workdir)
    path = workdir.rstrip("/") if remote else os.path.abspath(workdir)
    if not remote and (path == plugins.ROOT or path == os.path.dirname(path)):  # the checkout, or a disk's root
        what = "this checkout itself" if path == plugins.ROOT else "the root of the file system"
        raise ConfigError(f"--workdir={workdir} is {what}: give the run a folder of its own, as runs/NAME")
    for parent in _upward(_parent(path)):
        if _is_file(os.path.join(parent, "config.json")) and _is_dir(os.path.join(parent, "checkpoints")):
            raise ConfigError(
                f"--workdir={workdir} is inside the workdir of another run ({parent}): give this run a folder of its "
                "own, beside it"
            )


# The folders a run writes its own files in: a folder of another kind inside one would read as theirs.
RUN_FOLDERS = ("checkpoints", "train", "eval", "continuous_eval")


def check_not_in_run_folders(path, flag, instead):
    """Refuses --`flag`=`path` inside a run's own folders (RUN_FOLDERS): a SavedModel in checkpoints/ reads as a
    checkpoint to every later eval and resume of that run. `instead`: where it goes without the flag."""
    for parent in _upward(os.path.abspath(path) if is_local(path) else path.rstrip("/")):
        if os.path.basename(parent) in RUN_FOLDERS and _is_file(os.path.join(_parent(parent), "config.json")):
            raise ConfigError(
                f"--{flag}={path} is inside {parent}, the folder of a run's own {os.path.basename(parent)} files: give "
                f"it a folder of its own (without --{flag}: {instead})"
            )


def export_target(config, export_dir, step):
    """The folder `export_dir` names, which an export may be renamed onto: a link is refused (the rename fails on it)
    and so is a folder that holds anything. "." or "out/." name the folder itself: a partial copy beside "." was
    "..incomplete" inside it, and the rename onto it failed (exit 4), leaving it there."""
    where = os.path.abspath(export_dir) if is_local(export_dir) else export_dir.rstrip("/")
    if is_local(where) and os.path.islink(where):  # the rename would fail on it, exit 4
        target = os.readlink(where)
        raise ConfigError(
            f"--export_dir={export_dir}: is a symbolic link (to {target}); an export is renamed into place, not "
            "written through a link: name the folder itself"
        )
    if tf.io.gfile.exists(export_dir) and (not tf.io.gfile.isdir(export_dir) or tf.io.gfile.listdir(export_dir)):
        if not config.export_dir:  # where it goes unless told: the user typed no --export_dir
            raise ConfigError(
                f"--mode=export: step {step} is exported already, to {export_dir} (not an empty directory); refusing "
                "to overwrite it: give --export_dir to export it elsewhere"
            )
        raise ConfigError(f"--export_dir={export_dir}: exists and is not an empty directory; refusing to overwrite it")
    return where


def _upward(path):
    """`path` and the folders above it, nearest first, short of a local file system's root; a bucket's root (gs://b)
    included, which may hold a run."""
    while _parent(path) != path:
        yield path
        path = _parent(path)
    if not is_local(path):
        yield path


def _is_file(path):
    """os.path's answer for a local path (a folder named in bytes that are not UTF-8 is one TensorFlow cannot name),
    tf.io.gfile's for a remote one."""
    if is_local(path):
        return os.path.isfile(path)
    return tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path)


def _is_dir(path):
    return os.path.isdir(path) if is_local(path) else tf.io.gfile.isdir(path)


def _parent(path):
    """The folder `path` is in; a root's (/, gs://bucket) is itself."""
    scheme, _, rest = path.rpartition("://")
    if not scheme:
        return os.path.dirname(path)
    return f"{scheme}://{os.path.dirname(rest)}" if "/" in rest else path


# What marks each job's workdir, in the order they are told apart: a study's holds its summary.json too, a train
# run's its config.json (checkpoints/ alone, from before config.json); results alone are an ensemble's.
_MARKERS = (("study", STUDY_NAME), ("run", "config.json"), ("run", "checkpoints"), ("results", "summary.json"))


def held_job(workdir):
    """(the job `workdir` holds, the file that says so): ("study", its study.json), ("run", a train run's
    config.json or checkpoints/), ("results", summary.json: another job's, an ensemble's), or (None, None). Every
    mode asks this before it writes there: one job's files beside another's would read as that job's own."""
    for job, name in _MARKERS:
        path = os.path.join(workdir, name)
        if tf.io.gfile.exists(path):
            return job, path
    return None, None


def others_results(workdir, results, said, job):
    """The ConfigError refusing `job` ("a train run", "a study") in a workdir that holds another job's `results`
    (an ensemble's summary.json, which this job's would replace) and not `said` (what marks this job's own)."""
    return ConfigError(
        f"--workdir={workdir} holds another job's results ({results}, and no {said}): {job} needs a --workdir of its "
        "own"
    )


def _saved(workdir, key):
    """(config.json's path, what it says of `key`, None where it says nothing, or cannot be read: its own check
    speaks)."""
    path, saved = _saved_json(workdir)
    return path, saved.get(key)


def _saved_json(workdir):
    """(config.json's path, what it holds: {} where there is none, or it cannot be read or is not a dict)."""
    path = os.path.join(workdir, "config.json")
    try:
        with tf.io.gfile.GFile(path) as f:
            saved = json.loads(f.read())
    except (tf.errors.NotFoundError, ValueError):  # none, damaged
        return path, {}
    return path, saved if isinstance(saved, dict) else {}


# What config.json holds beside the settings (write_config).
BESIDE_SETTINGS = ("class_names", "updates", "training_split", "source")


def warn_of_unknown_settings(workdir):
    """Warns of the settings config.json holds that this engine does not (another engine version's, those of a
    plugin file no longer here, one written by hand), which the Config read from it goes without (from_json);
    returns them ({name: value}), which the config.json a resumed run writes keeps."""
    path, saved = _saved_json(workdir)
    unknown = {k: v for k, v in saved.items() if k not in FIELD_BY_NAME and k not in BESIDE_SETTINGS}
    if unknown:
        named = ", ".join(f"{name}={json.dumps(value)}" for name, value in unknown.items())
        print(
            f"warning: {path} holds settings this engine does not know, ignored here and kept in that file: {named} "
            "(another version of the engine's, a plugin file's no longer here, or a typo)",
            flush=True,
        )
    return unknown


def check_same_classes(workdir, task):
    """Refuses data that names its classes otherwise than the run of `workdir` trained on (config.json's
    class_names): a class folder renamed, added or removed moves the labels, and the trained model would read each
    as another class, its export name them wrong. Nothing to hold it against where config.json names none."""
    said = other_classes(workdir, task.class_names)
    if said:
        raise ConfigError(
            f"--dataset={task.config.dataset}: {said}: its classes changed since that run trained; restore the data "
            "as it was, or train in a new --workdir"
        )


def other_classes(workdir, class_names):
    """How `class_names` (this run's, None for a task that names none) differ from those the run of `workdir`
    trained on (config.json's), naming the first label that moved and config.json; None where they are the same, or
    either names none."""
    path, saved = _saved(workdir, "class_names")
    names = None if class_names is None else list(class_names)
    if not isinstance(saved, list) or names is None or names == saved:
        return None
    differs = next((i for i, (old, new) in enumerate(zip(saved, names)) if old != new), None)
    said = (
        f"label {differs} is {names[differs]!r} here, {saved[differs]!r} in the run of {workdir}"
        if differs is not None
        else f"it has {len(names)} classes here, {len(saved)} in the run of {workdir}"
    )
    return f"{said} ({path})"


def training_split(data):
    """What config.json says of the training split a run reads (engine/data/datasets.py Data): its examples, its
    record files where it streams them, and a digest of its examples where it holds them in memory."""
    digest = {"digest": data.train_digest()} if data.train_digest else {}
    return {"examples": data.train_examples, "files": data.train_files, **digest}


def warn_of_another_split(config, data, step):
    """Warns where the training split holds other examples than when the run of config.json last started (record
    files added or removed, a file of arrays replaced): the run goes on from its data position (step `step`), which
    counts into the order of what the split holds now, not into the order an uninterrupted run read. Not refused: a
    job a scheduler restarts would stop on it for good."""
    path, saved = _saved(config.workdir, "training_split")
    now = training_split(data)
    if not isinstance(saved, dict):
        return
    if "digest" not in saved:  # a config.json from before splits held in memory kept a digest
        now.pop("digest", None)
    if saved != now:
        same = _counts(saved) == _counts(now)  # as many examples and files: only the digest differs
        held = f"other examples (as many, {_split(now)}, of other values)" if same else _split(now)
        print(
            f"warning: --dataset={config.dataset}: its --train_split={config.train_split} holds {held} now, "
            f"{'not those' if same else _split(saved)} when this run last started ({path}): it goes on from its data "
            f"position at step {step} in the order of what the split holds now, not the examples an uninterrupted "
            "run would have read",
            flush=True,
        )


def _counts(held):
    return {k: v for k, v in held.items() if k != "digest"}


def _split(held):
    files = f" in {counted(held['files'], 'record file')}" if held.get("files") else ""
    return f"{counted(held.get('examples'), 'example')}{files}"


def write_config(config, task, updates=None, data=None, unknown=None):
    """workdir/config.json: every setting of the run. It says which run the workdir holds (a restart with other
    settings is refused) and rebuilds its model for --mode=eval, continuous_eval, export and ensemble. Beside
    them, what the labels mean (a classification task's class_names, null for others): no setting, read by
    people and by the programs that use the export; and in a run of several updates the settings each trains with
    (`updates`: engine/numerics/updates.py effective_settings), read by people, not by the engine; and what the
    training split held (`data`), which a resumed run holds its split against, and what the source gave the task
    (engine/state/kept_source.py), from which export and sampling build it without the data. `unknown`: the
    settings of the config.json a run resumed that this engine does not know, kept as they were."""
    names = task.class_names
    saved = {**(unknown or {}), **dataclasses.asdict(config), "class_names": None if names is None else list(names)}
    if updates:
        saved["updates"] = updates
    if data is not None:
        saved["training_split"] = training_split(data)
        kept = kept_source.record(data.source_spec, task.info)
        if kept is not None:
            saved["source"] = kept
    write_json(os.path.join(config.workdir, "config.json"), saved)


def saved_source(workdir):
    """(spec, info) of the source the run of `workdir` trained on, as its config.json keeps them; None where it keeps
    none (engine/state/kept_source.py)."""
    _, kept = _saved(workdir, "source")
    return None if kept is None else kept_source.source(kept)


def _free_name(workdir):
    base = workdir.rstrip("/")
    return next(f"{base}-{n}" for n in range(2, 10_000) if not tf.io.gfile.exists(f"{base}-{n}"))


def summary_at(workdir, step):
    """summary.json when it reports `step` (a run that ended there), else None (killed before writing it)."""
    path = os.path.join(workdir, "summary.json")
    if not tf.io.gfile.exists(path):
        return None
    try:
        # One the run cannot read (a folder in its place) is one it cannot write either: exit 4, naming it
        with writing(path), tf.io.gfile.GFile(path) as f:
            summary = json.loads(f.read())
    except ValueError:  # damaged: the final evaluation runs again and rewrites it
        return None
    return summary if isinstance(summary, dict) and summary.get("step") == step else None


def stopped_by(workdir, step):
    """What stopped the run at `step` before --train_steps (summary.json's `stopped_by`: an early stop, a tuner's
    pruning), which a rerun of its command does not train past; None where nothing did."""
    summary = summary_at(workdir, step)
    return summary.get("stopped_by") if summary is not None else None
