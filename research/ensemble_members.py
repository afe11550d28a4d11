"""An ensemble's members (research/ensemble.py): a train run's workdir, its models restored from the latest
checkpoint and predicting each split through the engine's evaluation pipeline, or an .npz file of another model's
predictions, aligned to the run members' examples; every member checked against the first run's task, inputs and
examples. And predictions.npz, the ensemble's own predictions written as such a file."""

import dataclasses
import io
import os
import zipfile

import numpy as np
import tensorflow as tf

from engine.cluster import distribute
from engine.numerics import precision
from engine.run import build
from engine.run.inputs import batches
from engine.run.program import unsupported_ops
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from engine.state import checkpoint as checkpoint_lib
from engine.state.files import write_text
from research.ensemble_weights import combine


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
    examples: dict  # split -> {feature: [examples, ...]} (real examples, in order; with `index` and `weight`)
    shapes: dict  # split -> shape of one example's predictions


def _restored(state, workdir, found):
    """Restores `found` into `state`, the newest checkpoint of the member `workdir`, or the newest since: a member
    still training rotates its checkpoints away (--keep_checkpoints) after they were listed. ConfigError for one that
    is damaged. Each try restores through a checkpoint object of its own (engine/run/modes.py _restore_from)."""
    while True:
        try:
            checkpoint_lib.restore(state.evaluated(), found, partial=True)
            return
        except checkpoint_lib.Unreadable as e:
            newer = checkpoint_lib.superseded(found)  # rotated away as it was read, its index first
            if newer is None:  # the newest, unreadable: damaged
                raise ConfigError(f"--members: {found} is unreadable ({e})") from None
            found = newer


def load_run(workdir, member_config, splits, reference):
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
        run = build.run(run_config, distribute.create_strategy(run_config.cluster), "evaluate")
        if reference is not None:
            described = f"{reference.name} ({_data_name(reference.config)})"
            for feature in sorted(reference.spec.keys() | run.data.spec.keys()):
                theirs, ours = reference.spec.get(feature), run.data.spec.get(feature)
                if theirs != ours:
                    raise ConfigError(
                        f"{where} takes {feature} {_spec_text(ours)} but {described} takes {feature} "
                        f"{_spec_text(theirs)}: an ensemble's members must share one input space"
                    )
        _restored(run.state, workdir, found)
        task = run.task
        predict = _predictor(run)
        predictions, examples = {}, {}
        with run.weights.averaged():
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


def _predictor(run):
    """A batch's predictions, compiled with XLA where the member's own evaluation is, so that they score as its run
    reported (in mixed precision, XLA's fusions round otherwise than the plain ops); without XLA where it cannot
    compile them, as that evaluation then falls back (engine/run/evaluator.py)."""
    task = run.task

    def predict(batch):
        return task.predictions(task.forward(run.models, batch, False))

    plain = tf.function(predict)
    compiled = tf.function(predict, jit_compile=True) if run.evaluator.step_jit.compile else None

    def predicted(batch):
        nonlocal compiled
        if compiled is None:
            return plain(batch)
        try:
            return compiled(batch)
        except tf.errors.OpError as e:
            if not (unsupported_ops(e) or "xla" in (e.message or "").lower()):
                raise
            compiled = None
            return plain(batch)

    return predicted


def _predict(predict, batches):
    """(predictions [examples, ...] float64, {feature: [examples, ...]}) of the real examples of `batches`, with
    their `weight` (how much each counts in the scores' means)."""
    outputs, features = [], {}
    for batch in batches:
        real = batch["weight"].numpy() > 0  # padding that completes the last batch has weight 0
        outputs.append(np.asarray(predict(batch), np.float64)[real])
        for name, values in batch.items():
            features.setdefault(name, []).append(values.numpy()[real])
    return np.concatenate(outputs), {name: np.concatenate(values) for name, values in features.items()}


def read_file(path, splits, kind):
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


def align(path, arrays, splits, reference):
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


def write_predictions(path, predictions, weights, reference, config):
    """predictions.npz: the weighted ensemble's predictions in the member file's format (so it can join another
    ensemble), and each member's as `member<i>_<split>`, in the order of --members."""
    arrays = {}
    for split, members in predictions.items():
        arrays[split] = combine(members, weights, config.ensemble_mean)
        arrays[f"{split}_index"] = reference.examples[split]["index"]
        arrays.update({f"member{i}_{split}": p for i, p in enumerate(members)})
    buffer = io.BytesIO()  # zipfile reads back what it writes, which a GFile (any file system) cannot
    np.savez(buffer, **arrays)
    write_text(path, buffer.getvalue())  # never through a link planted at the name


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
    name = config.dataset_name
    if name == "synthetic":
        shape = ",".join(str(d) for d in config.synthetic_shape)
        return f"synthetic {shape} with {config.synthetic_classes} classes"
    return name
