"""Save, restore, resume and preemption.

A checkpoint holds the model (weights and batch-norm statistics), the optimizer's slots and update
count, the loss scale, the step, the data position (global batches consumed) and the skipped-step
count. The input pipeline is a pure function of the data position (engine/data.py), so a restored
run reads exactly the batches an uninterrupted one would have: tf.distribute's iterators are not
checkpointable, the position is.

Preemption (engine/preemption.py): SIGTERM or SIGINT set a flag that the replica step all-reduces
with the gradients, so every worker stops after the same step; the loop then saves here and exits.
"""

import os
import re
import shutil
import tempfile

import tensorflow as tf
from google.protobuf import text_format

from engine.config import ConfigError, first_line


class CheckpointError(RuntimeError):
    """A file of the run (a checkpoint, a log, the summary) could not be written; the message names the path."""


def model_state(model):
    """The model's variables in Keras's own order. Keras 3 layers held in Python lists are invisible to
    tf.train.Checkpoint's object graph (they would be silently left out), so the engine checkpoints the
    variables themselves: weights, batch-norm statistics and dropout seed-generator states."""
    return [v.value for v in model.variables]


def model_checkpoint(model, step):
    """The part of a training checkpoint that evaluation, export and ensembles read: the model and the step
    (restore it with partial=True; the optimizer's state stays in the file)."""
    return tf.train.Checkpoint(model=model_state(model), step=step)


def tracked_state(trainer):
    """What a checkpoint holds; one place, so training, evaluation and export restore the same names."""
    return dict(
        model=model_state(trainer.model),
        optimizer=trainer.optimizer,
        loss_scale=trainer.loss_scale,
        step=trainer.step,
        batches=trainer.batches,
        skipped=trainer.skipped,
    )


def describe_key(key, model):
    """A checkpoint key as a person reads it: model variables get this run's Keras path (a checkpoint stores
    positions, not names, so the checkpoint's own variable there may be another)."""
    name = key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "")
    match = re.fullmatch(r"model/(\d+)", name)
    if match and int(match.group(1)) < len(model.variables):
        return f"model variable {match.group(1)} ({model.variables[int(match.group(1))].path} in this run)"
    return name


def _step_of(path):
    return int(re.search(r"ckpt-(\d+)$", path).group(1))


def list_checkpoints(directory):
    """Checkpoint prefixes in `directory`, newest first, found by their files (so a damaged `checkpoint`
    state file hides nothing, and a checkpoint missing its index is still found and reported)."""
    found = tf.io.gfile.glob(os.path.join(directory, "ckpt-*"))
    prefixes = {re.sub(r"\.(index|data-\d+-of-\d+)$", "", p) for p in found}
    return sorted((p for p in prefixes if re.search(r"ckpt-\d+$", p)), key=_step_of, reverse=True)


def latest(directory):
    """The newest checkpoint prefix in `directory`, or None."""
    return next(iter(list_checkpoints(directory)), None)


class Checkpoints:
    """The run's checkpoints in workdir/checkpoints; on a multi-worker job every worker saves (the save
    is collective) and only the chief's copy is kept."""

    def __init__(self, trainer, workdir, keep, chief=True, task_id=0):
        self.trainer = trainer
        self.directory = os.path.join(workdir, "checkpoints")
        self.checkpoint = tf.train.Checkpoint(**tracked_state(trainer))
        self.chief = chief
        # The checkpoint (in the chief's directory) that holds the current state, saved or restored here: known
        # to be readable, unlike whatever is newest on disk.
        self.saved_path = None
        write_dir = self.directory if chief else os.path.join(self.directory, f".worker{task_id}")
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
            tf.io.gfile.rmtree(temp)
        found = list_checkpoints(self.directory)
        try:
            state = tf.train.get_checkpoint_state(self.directory)
            readable = state is not None or not found
        except (ValueError, text_format.ParseError, tf.errors.OpError) as e:  # ValueError: undecodable bytes
            print(f"warning: {self.directory}/checkpoint is unreadable ({first_line(e)}); rebuilt from the files")
            readable = False
        state_file = os.path.join(self.directory, "checkpoint")
        if not readable and not found:
            tf.io.gfile.remove(state_file)
        elif not readable:
            # The manager deletes only checkpoints listed with a timestamp: their files' times stand in.
            times = [
                tf.io.gfile.stat(p + ".index").mtime_nsec / 1e9 if tf.io.gfile.exists(p + ".index") else 0.0
                for p in found[::-1]
            ]
            lines = [f'model_checkpoint_path: "{os.path.basename(found[0])}"']
            lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in found[::-1]]
            lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in times]
            lines += [f"last_preserved_timestamp: {min(times) - 1.0!r}"]
            with tf.io.gfile.GFile(state_file + ".tmp", "w") as f:
                f.write("\n".join(lines) + "\n")
            tf.io.gfile.rename(state_file + ".tmp", state_file, overwrite=True)

    def latest(self):
        return latest(self.directory)

    def save(self):
        """Saves at the current step; raises CheckpointError naming the path if it cannot be written."""
        step = int(self.trainer.step.numpy())
        if self.saved_path and _step_of(self.saved_path) == step:  # e.g. a run resumed at its last step
            return self.saved_path
        # Every floating-point variable: weights and the statistics a forward pass updates alike.
        bad = [
            v.path
            for v in self.trainer.model.variables
            if v.dtype.startswith("float") and not bool(tf.reduce_all(tf.math.is_finite(v)))
        ]
        if bad:  # never let a diverged model replace a good checkpoint
            raise CheckpointError(f"refusing to save step {step}: non-finite values in {bad[0]}")
        try:
            path = self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as e:
            raise CheckpointError(
                f"cannot write checkpoint for step {step} to {self.manager.directory}: {first_line(e)}"
            ) from None
        if not self.chief:
            shutil.rmtree(self.manager.directory, ignore_errors=True)
        self.saved_path = os.path.join(self.directory, os.path.basename(path))  # a worker's own copy is gone
        return self.saved_path

    def restore_latest(self, log=print):
        """Restores the newest readable checkpoint; returns its path, or None when there is none.

        A damaged checkpoint is reported and the previous one used; one of another model or other shapes
        is refused (ConfigError naming the variable and both shapes).
        """
        for path in list_checkpoints(self.directory):
            try:
                restore(self.checkpoint, path, model=self.trainer.model)
                self.saved_path = path
                return path
            except Unreadable as e:
                log(f"warning: checkpoint {path} is unreadable ({e}); trying the previous one")
        return None


class Unreadable(Exception):
    """A checkpoint's files are missing or damaged."""


def restore(checkpoint, path, partial=False, model=None):
    """Restores `checkpoint` from `path`: all of it, or (`partial`) what exists in this program.

    Raises Unreadable for missing or damaged files, ConfigError for a checkpoint that does not fit.
    """
    try:
        status = checkpoint.restore(path)
        status.expect_partial()  # no warnings at garbage collection: the checks below speak instead
        status.assert_existing_objects_matched()
        if not partial:
            status.assert_consumed()
    except (tf.errors.OpError, IndexError) as e:  # the reader raises IndexError for a truncated data file
        raise Unreadable(first_line(e)) from None
    except (AssertionError, ValueError):
        why = _mismatch(checkpoint, path, partial, model)
        raise ConfigError(
            f"checkpoint {path} does not fit this run: {why} (a run with other settings saved it)"
        ) from None


def _mismatch(checkpoint, path, partial, model):
    """Names the first variable whose presence or shape differs between this run and a checkpoint."""
    saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    with tempfile.TemporaryDirectory() as tmp:
        ours = tf.train.load_checkpoint(checkpoint.write(os.path.join(tmp, "probe"))).get_variable_to_shape_map()
    ignore = {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"}
    name = (lambda key: describe_key(key, model)) if model is not None else (lambda key: key)
    for key in sorted((ours.keys() | saved.keys()) - ignore):
        if key not in saved:
            return f"this run has {name(key)} {ours[key]} that the checkpoint lacks"
        if key not in ours and not partial:
            return f"the checkpoint has {name(key)} {saved[key]} that this run lacks"
        if key in ours and ours[key] != saved[key]:
            return f"{name(key)} has shape {saved[key]} in the checkpoint and {ours[key]} in this run"
    return "its objects differ from this run's (another model?)"
