"""Save, restore, resume and preemption. A checkpoint holds a run's `State` (engine/state/held.py). The input
pipeline is a pure function of the data position (engine/data/pipeline.py), so a restored run reads exactly the
batches an uninterrupted one would have: tf.distribute's iterators are not checkpointable, the position is. On
preemption (engine/cluster/signals.py) every worker stops after the same step, and the loop saves here and exits."""

import contextlib
import logging
import os
import re
import tempfile

import tensorflow as tf
from google.protobuf import text_format

from engine.settings.config import first_line
from engine.settings.errors import CheckpointError, ConfigError  # CheckpointError: also imported from here
from engine.state import held
from engine.state.files import check_listable, failed_file, is_local, remove_tree, replace_text

# What a refusal of a checkpoint another version of the engine saved tells a person to do.
OTHER_VERSION = "finish that run with the engine version that wrote it"


def describe_key(key):
    """A checkpoint key as a person reads it: models/model/mlp/dense/kernel."""
    name = key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "")
    return name.replace(".S", "/").replace("..", ".")


def step_of(path):
    return int(re.search(r"ckpt-(\d+)$", path).group(1))


def list_checkpoints(directory):
    """Checkpoint prefixes in `directory`, newest first, found by their files (so a damaged `checkpoint`
    state file hides nothing, and a checkpoint missing its index is still found and reported). A local directory
    that is there but cannot be listed (a permission, a file in its place) is CheckpointError: TensorFlow's glob
    finds nothing in it, and a run would start again from step 0, rewinding its logs, over its checkpoints."""
    directory = os.fspath(directory)
    check_listable(directory, "checkpoint directory")
    found = tf.io.gfile.glob(os.path.join(directory, "ckpt-*"))
    prefixes = {re.sub(r"\.(index|data-\d+-of-\d+)$", "", p) for p in found}
    return sorted((p for p in prefixes if re.search(r"ckpt-\d+$", p)), key=step_of, reverse=True)


def latest(directory):
    """The newest checkpoint prefix in `directory`, or None."""
    return next(iter(list_checkpoints(directory)), None)


def superseded(path):
    """The newest checkpoint beside `path` where it is newer than `path`, else None: a run still training rotates
    its older checkpoints away (--keep_checkpoints), the index first, so one read as that happens is unreadable."""
    newest = latest(os.path.dirname(path))
    return newest if newest is not None and step_of(newest) > step_of(path) else None


def latest_step(directory):
    """The step of the newest checkpoint in `directory` by its name (nothing read), or None."""
    path = latest(directory)
    return step_of(path) if path else None


class Checkpoints:
    """The run's checkpoints in workdir/checkpoints; on a multi-worker job every worker saves (the save
    is collective) and only the chief's copy is kept. `keep_initial` (--save_initial): step 0's is kept beside the
    `keep` newest, written outside the manager's rotation."""

    def __init__(self, state, workdir, keep, chief=True, task_id=0, keep_initial=False):
        self.state = state
        self.directory = os.path.join(workdir, "checkpoints")
        self.keep_initial = keep_initial
        self.checkpoint = tf.train.Checkpoint(**state.tracked())
        self.chief, self.keep = chief, keep
        # The checkpoint (in the chief's directory) that holds the current state, saved or restored here: known
        # to be readable, unlike whatever is newest on disk.
        self.saved_path = None
        # Called before each save and after each restore (a resume, a rollback): a train run's actions' own state goes
        # with the rest (engine/run/actions/base.py hold and hand_back).
        self.before_save = self.after_restore = lambda: None
        write_dir = self.directory if chief else os.path.join(self.directory, f".worker{task_id}")
        if is_local(self.directory) and os.path.islink(self.directory):
            # Rotation deletes the old ckpt-N files in it: through a link, another run's.
            raise ConfigError(
                f"{self.directory} is a symbolic link (to {os.readlink(self.directory)}); checkpoints rotate inside "
                "the workdir only: make it a directory, or link the whole --workdir instead"
            )
        try:
            if chief:  # the only writer of this directory (it holds the workdir's lock)
                self._tidy()
            self.manager = tf.train.CheckpointManager(self.checkpoint, write_dir, max_to_keep=keep)
        except (tf.errors.OpError, OSError) as e:
            raise CheckpointError(f"cannot use checkpoint directory {write_dir}: {first_line(e)}") from None

    def _tidy(self):
        """Removes what saves killed midway left (ckpt-N_temp/ directories), and rebuilds the `checkpoint` state
        file from the checkpoints' own files when it is damaged or missing: the manager reads it to know which
        old checkpoints to delete."""
        for temp in tf.io.gfile.glob(os.path.join(self.directory, "ckpt-*_temp")):
            remove_tree(temp)
        found = list_checkpoints(self.directory)
        state_file = os.path.join(self.directory, "checkpoint")
        try:
            state, damaged = tf.train.get_checkpoint_state(self.directory), False
        except (ValueError, text_format.ParseError, tf.errors.OpError) as e:  # ValueError: undecodable bytes
            print(f"warning: {state_file} is unreadable ({first_line(e)}); rebuilt from the files")
            state, damaged = None, True
        if not damaged:  # what it lists (nothing, where there is none yet) tells a save that never finished
            found = self._unfinished(found, _listed(state))
            # A step 0 beside the rotation is a --save_initial's, kept though this command does not give the flag.
            self.keep_initial = self.keep_initial or "ckpt-0" in set(_names(found)) - set(_names(_listed(state)))
        found, listed_paths = self._rotated(found), self._rotated(_listed(state))
        readable = not damaged and (state is not None or not found)
        # A kept step 0 the state file lists (one saved before --save_initial was given) it would rotate away.
        readable = readable and listed_paths == _listed(state)
        # The manager deletes what the state file lists: a path outside this directory (absolute, or through ..)
        # would make it delete another run's files; one gone, or one left out, it would never delete.
        strays = [p for p in listed_paths if not _inside(p, self.directory)]
        listed, held = _names(listed_paths), _names(found)
        if readable and state is not None and (strays or listed != held):
            where = f"names checkpoints outside {self.directory} ({strays[0]})" if strays else ""
            where = where or f"lists {', '.join(listed)}, the folder holds {', '.join(held) or 'none'}"
            print(f"warning: {state_file} {where}; rebuilt from the files")
            readable = False
        if not readable:
            self._write_state(found)

    def _rotated(self, paths):
        """`paths` without --save_initial's step 0, which no rotation deletes: the checkpoints the manager keeps."""
        return [p for p in paths if not (self.keep_initial and os.path.basename(p) == "ckpt-0")]

    def _write_state(self, found):
        """The `checkpoint` state file listing the checkpoints `found` (newest first) that rotate; none if none do."""
        state_file = os.path.join(self.directory, "checkpoint")
        found = self._rotated(found)
        if not found:
            if tf.io.gfile.exists(state_file):
                tf.io.gfile.remove(state_file)
            return
        # The manager deletes only checkpoints listed with a timestamp: their files' times stand in.
        times = [
            tf.io.gfile.stat(p + ".index").mtime_nsec / 1e9 if tf.io.gfile.exists(p + ".index") else 0.0
            for p in found[::-1]
        ]
        lines = [f'model_checkpoint_path: "{os.path.basename(found[0])}"']
        lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in found[::-1]]
        lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in times]
        lines += [f"last_preserved_timestamp: {min(times) - 1.0!r}"]
        replace_text(state_file, "\n".join(lines) + "\n")

    def discard_after(self, step):
        """Removes the checkpoints newer than `step` (on the chief, which writes them): those of the steps a rollback
        to `step` discarded (a preemption's save among them), which a restart would otherwise resume from, as the
        newest. Returns their paths."""
        newer = [path for path in list_checkpoints(self.directory) if step_of(path) > step]
        if not self.chief or not newer:
            return newer
        for path in newer:
            for name in tf.io.gfile.glob(path + ".*"):
                tf.io.gfile.remove(name)
        self._write_state(list_checkpoints(self.directory))  # and a manager that knows only what is left
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=self.keep)
        return newer

    def _unfinished(self, found, listed):
        """`found` without the saves a kill stopped before they finished, whose files are removed: a checkpoint
        whose data files were moved into place but whose index was never written, which the state file (when there
        is one, readable) does not list. A listed one without its index is damage, reported as such when read."""
        listed = {os.path.basename(p) for p in listed}
        kept = []
        for path in found:
            if tf.io.gfile.exists(path + ".index") or os.path.basename(path) in listed:
                kept.append(path)
                continue
            for data in tf.io.gfile.glob(path + ".data-*"):
                tf.io.gfile.remove(data)
            print(f"removed {path}'s data files: a save that a kill stopped before it wrote the index", flush=True)
        return kept

    def save(self):
        """Saves at the current step; raises CheckpointError naming the path if it cannot be written."""
        step = int(self.state.step.numpy())
        if self.saved_path and step_of(self.saved_path) == step:  # e.g. a run resumed at its last step
            return self.saved_path
        # Every floating-point variable: weights and the statistics a forward pass updates alike.
        bad = [
            v.path
            for model in self.state.models.values()
            for v in model.variables
            if v.dtype.startswith("float") and not bool(tf.reduce_all(tf.math.is_finite(v)))
        ]
        if bad:  # never let a diverged model replace a good checkpoint
            raise CheckpointError(f"refusing to save step {step}: non-finite values in {bad[0]}")
        self.before_save()
        temp = os.path.join(self.manager.directory, f"ckpt-{step}_temp")
        if is_local(temp) and os.path.islink(temp):  # TensorFlow would write the shards there, then empty it
            os.remove(temp)
        try:
            if step == 0 and self.keep_initial:  # written beside the manager, which never lists it, nor deletes it
                self.checkpoint.save_counter.assign_add(1)  # as the manager's saves do: a restore expects it
                path = self.checkpoint.write(os.path.join(self.manager.directory, "ckpt-0"))
            else:
                path = self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            if isinstance(e, PEER_ERRORS) and REMOTE_TASK.search(e.message or ""):
                # A peer that holds variables (a parameter server) died or went silent as they were read: not the
                # storage's failure (exit 4), the job's lost peer, which launch.py names (exit 5).
                raise
            raise CheckpointError(
                f"cannot write checkpoint for step {step} to {self.manager.directory}: {failed_file(e)[1]}"
            ) from None
        if not self.chief:
            with contextlib.suppress(OSError, tf.errors.OpError):
                remove_tree(self.manager.directory)
        self.saved_path = os.path.join(self.directory, os.path.basename(path))  # a worker's own copy is gone
        return self.saved_path

    def restore(self, path):
        """Restores the checkpoint at `path` (restore()), then after_restore(). One saved before checkpoints held the
        actions' state is restored without it: its actions go on as they are."""
        tracked = self.state.tracked()
        if "actions" in tracked and not _holds(path, "actions/.ATTRIBUTES/VARIABLE_VALUE"):
            tracked.pop("actions")
            restore(tf.train.Checkpoint(**tracked), path)
        else:
            restore(self.checkpoint, path)
        self.after_restore()

    def restore_latest(self, log=print):
        """Restores the newest readable checkpoint; returns its path, or None when there is none.

        A damaged checkpoint is reported and the previous one used; when every one is damaged the run stops
        (ConfigError naming them) rather than start again from step 0 and save over them. One of another model
        or other shapes (a workdir from before config.json, or whose config.json was replaced) is refused
        (ConfigError naming the variable and both shapes); a storage error is not damage (CheckpointError).
        """
        damaged = []
        for path in list_checkpoints(self.directory):
            try:
                self.restore(path)
                self.saved_path = path
                return path
            except ConfigError as e:
                raise ConfigError(f"{e}; give this run a new --workdir") from None
            except Unreadable as e:
                log(f"warning: checkpoint {path} is unreadable ({e}); trying the previous one")
                damaged.append(f"{path} ({e})")
        if damaged:
            raise ConfigError(
                f"every checkpoint in {self.directory} is unreadable: {', '.join(damaged)}; nothing was changed. To "
                f"start this run over from step 0 on purpose, move {self.directory} away, or give this run a new "
                "--workdir"
            )
        return None


# What a save raises where a peer that holds some of the variables stops answering, its gRPC context naming the
# task ("... from remote target /job:ps/replica:0/task:0 ..."); a storage error (a full disk) is none of them.
PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)
REMOTE_TASK = re.compile(r"remote target /job:\w+/replica:\d+/task:\d+")


def _listed(state):
    """The checkpoint paths a `checkpoint` state file lists (TensorFlow has made the relative ones absolute)."""
    if state is None:
        return []
    return [state.model_checkpoint_path, *state.all_model_checkpoint_paths]


def _names(paths):
    """The checkpoints `paths` name, by their names (ckpt-N), oldest first."""
    return sorted({os.path.basename(p) for p in paths}, key=step_of)


def _inside(path, directory):
    """Whether the checkpoint prefix `path` is in `directory` itself (not beside it, not below it)."""
    if not is_local(path):
        return os.path.dirname(path) == directory.rstrip("/") and ".." not in path.split("/")
    return os.path.dirname(os.path.abspath(path)) == os.path.abspath(directory)


class Unreadable(Exception):
    """A checkpoint's files are missing or damaged."""


# What a missing, truncated or overwritten checkpoint raises (measured on TF 2.21: truncated, garbage and
# bit-flipped index and data files, each one missing, a directory in a file's place). The checkpoint reader
# reports most of them as UNKNOWN with the file system's text, so for UNKNOWN the text decides.
_DAMAGE_ERRORS = (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError)
_DAMAGE_TEXTS = (
    "sstable",
    "Unable to read file",
    "checksum does not match",
    "corrupt",
    "No such file or directory",
    "Is a directory",
    "Read less bytes than requested",
)


def is_damage(error):
    """Whether a restore's error says the checkpoint's files are damaged or missing, not that the storage failed
    to answer (UnavailableError, DeadlineExceededError, PermissionDeniedError... of a gs:// blip)."""
    if isinstance(error, IndexError):  # the reader's for a truncated data file
        return True
    if isinstance(error, _DAMAGE_ERRORS):
        return True
    text = str(error).lower()
    return error.error_code == tf.errors.UNKNOWN and any(t.lower() in text for t in _DAMAGE_TEXTS)


def storage_error(path, error):
    return CheckpointError(
        f"cannot read checkpoint {path}: {type(error).__name__}: {first_line(error)}; nothing was changed: run the "
        "same command again once the storage answers"
    )


def restore(checkpoint, path, partial=False):
    """Restores `checkpoint` from `path`: all of it, or (`partial`) what exists in this program.

    Raises Unreadable for missing or damaged files, CheckpointError when the storage failed (nothing is known
    about the files then), ConfigError for a checkpoint that does not fit.
    """
    try:
        status = checkpoint.restore(path)
        status.expect_partial()  # no warnings at garbage collection: the checks below speak instead
        status.assert_existing_objects_matched()
        if not partial:
            status.assert_consumed()
    except (tf.errors.OpError, IndexError) as e:
        # Failed inside TensorFlow, the restore returned no status to expect_partial() on: what it had not restored
        # yet is logged as it is collected, some 20 lines after the one line this error becomes.
        logging.getLogger("tensorflow").addFilter(_unrestored)  # once: a filter already there is not added again
        if not is_damage(e):
            raise storage_error(path, e) from None
        raise Unreadable(first_line(e)) from None
    except (AssertionError, ValueError):
        if not _whole(path):  # rotated away as it was read (--keep_checkpoints of a run still training)
            raise Unreadable(f"its files went away as it was read ({path}.index or its data)") from None
        why = _mismatch(checkpoint, path, partial)
        if OTHER_VERSION not in why:
            why += " (a run with other settings saved it)"
        raise ConfigError(f"checkpoint {path} does not fit this run: {why}") from None


def _unrestored(record):
    """False for TensorFlow's account, at garbage collection, of the values a failed restore left unrestored."""
    return not str(record.msg).startswith(("Detecting that an object", "Value in checkpoint", "An attribute in the"))


def _whole(path):
    """Whether a checkpoint's index and every data file its name counts are there."""
    data = tf.io.gfile.glob(path + ".data-*")
    shards = re.search(r"-of-(\d+)$", data[0]) if data else None
    return tf.io.gfile.exists(path + ".index") and shards is not None and len(data) == int(shards.group(1))


def _holds(path, key):
    """Whether the checkpoint at `path` holds `key`; True where it cannot be read (restore() says what is wrong)."""
    try:
        return tf.train.load_checkpoint(path).has_tensor(key)
    except (tf.errors.OpError, ValueError):
        return True


def _mismatch(checkpoint, path, partial):
    """Names the first variable whose presence or shape differs between this run and a checkpoint."""
    try:
        saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    except (tf.errors.OpError, ValueError) as e:  # gone or going since it was listed, or the storage failed
        if isinstance(e, tf.errors.OpError) and not is_damage(e):
            raise storage_error(path, e) from None
        raise Unreadable(first_line(e)) from None
    with tempfile.TemporaryDirectory() as tmp:
        ours = tf.train.load_checkpoint(checkpoint.write(os.path.join(tmp, "probe"))).get_variable_to_shape_map()
    if any(k.startswith("model/") for k in saved) and not any(k.startswith("models/") for k in saved):
        return (
            "it was saved before this engine keyed variables by path (its keys are model/0, model/1, ...); "
            + OTHER_VERSION
        )
    ignore = {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"}
    unknown = sorted({key.split("/")[0] for key in saved.keys() - ignore} - held.KEYS)
    if unknown and not partial:  # a piece of a run's state this engine never saves (a newer engine's)
        saved_by = f"it holds {unknown[0]}, which this engine never saves (another version of the engine saved it)"
        return f"{saved_by}; {OTHER_VERSION}"
    name = describe_key
    for key in sorted((ours.keys() | saved.keys()) - ignore):
        if key not in saved:
            return f"this run has {name(key)} {ours[key]} that the checkpoint lacks"
        if key not in ours and not partial:
            return f"the checkpoint has {name(key)} {saved[key]} that this run lacks"
        if key in ours and ours[key] != saved[key]:
            return f"{name(key)} has shape {saved[key]} in the checkpoint and {ours[key]} in this run"
    return "its objects differ from this run's (another model?)"
