"""What a data source's `load(config, eval_split)` must give, checked before anything is built from it: a Source of
two Splits, its spec {feature: tf.TensorSpec}, its info a mapping, each split's examples the features and dtypes
the spec names (an evaluation example may add a float32 `weight`), and the labels of a split held in memory within
the `num_classes` its info says. A mistake is one line naming the source's file (TaskError); nothing is trained on
data the task would read wrong, or evaluated to a NaN. A split held in memory whose real numbers are not all finite
is refused naming --dataset (ConfigError): the data is wrong, not the source."""

import collections.abc

import numpy as np
import tensorflow as tf

from engine.data.records import ENGINE_FEATURES, Source, Split, SplitError
from engine.settings.errors import ConfigError, TaskError, check_call, counted, described

# Features a split may carry beyond its spec: the file an example came from (named when it cannot be decoded), and
# an evaluation example's weight (how much it counts in the means).
_OWN = {"origin": tf.TensorSpec([], tf.string)}
_WEIGHT = {"weight": tf.TensorSpec([], tf.float32)}
_CHUNK_BYTES = 64 * 2**20  # examples read at a time from a split held in memory, for their labels and real numbers


class NoInfo(ConfigError, KeyError):
    """What the run's task or model reads of the source's info, which the source does not give (a KeyError too)."""

    def __init__(self, dataset, key, given):
        super().__init__(key)
        self.dataset, self.key, self.given = dataset, key, given

    def __str__(self):
        has = f"it gives {', '.join(map(str, self.given))}" if self.given else "it gives none"
        return f"--dataset={self.dataset}: its info has no {self.key!r}, which this run's task or model reads ({has})"


class Info(dict):
    """A source's info, as tasks and models read it: a key the source does not give is NoInfo, in one line."""

    def __init__(self, dataset, info):
        super().__init__(info)
        self.dataset = dataset

    def __missing__(self, key):
        raise NoInfo(self.dataset, key, list(self))


def loaded(load, where, config, eval_split):
    """`load(config, eval_split)` of the source file `where` (sources/NAME.py), its result checked."""
    check_call(load, (config, eval_split), where, "load", "load(config, eval_split): it takes those two")
    try:
        source = load(config, eval_split)
    except SplitError as e:
        raise TaskError(f"{where}: {e}") from None
    return checked(source, where, config.dataset_name)


def checked(source, where, dataset):
    """`source` as a run reads it, its info an Info; TaskError naming `where` for anything it cannot read."""
    if not isinstance(source, Source):
        raise TaskError(
            f"{where}: load returned {described(source)}, not engine.api.Source(train, evals, spec, info): the splits, "
            "the spec of one example and what the source knows of them"
        )
    spec, info = source.spec, source.info
    if not isinstance(spec, collections.abc.Mapping) or not spec:
        raise TaskError(f"{where}: the Source's spec is {described(spec)}: {{feature: tf.TensorSpec}} of one example")
    for feature, one in spec.items():
        if feature in ENGINE_FEATURES:
            raise TaskError(
                f"{where}: the Source's spec names {feature}, a feature the engine sets itself "
                f"({ENGINE_FEATURES[feature]}): name it otherwise"
            )
        if not isinstance(one, tf.TensorSpec):
            raise TaskError(
                f"{where}: the Source's spec of {feature} is {one!r}, not a tf.TensorSpec(shape, dtype) of one example"
            )
    if not isinstance(info, collections.abc.Mapping):
        raise TaskError(
            f"{where}: the Source's info is {described(info)}: a dict of what the source knows ({{}} for none)"
        )
    if source.decode is not None:  # called in the input pipeline, where a wrong signature was a traceback
        if not callable(source.decode):
            raise TaskError(f"{where}: the Source's decode is {described(source.decode)}, not a function")
        check_call(source.decode, (None, None, None), where, "decode", "decode(example, seed, training)")
    for role, split in (("training", source.train), ("evaluation", source.evals)):
        if not isinstance(split, Split):
            raise TaskError(
                f"{where}: the Source's {role} split is {described(split)}, not a Split: "
                "in_memory({feature: tensor}) or sharded(files, parse) makes one"
            )
        if source.decode is None:  # a decoded split's examples are the decode's to shape (photos)
            _check_features(split, role, spec, where)
        else:  # what the decode makes of one, traced (not run): the spec's features, of its dtypes and shapes
            _check_decoded(source.decode, split, role, spec, where)
    for path, _ in source.evals.files:  # the training split's are measured as its pipeline is built (file_bytes)
        file_bytes(path, "evaluation", dataset)
    _check_classes(source, where, dataset)
    _check_finite(source, dataset)
    _check_weights(source.evals, dataset)
    if isinstance(info.get("num_classes"), np.integer):  # a layer's size: Keras refuses numpy's integers
        info = {**info, "num_classes": int(info["num_classes"])}
    return Source(source.train, source.evals, dict(spec), Info(dataset, info), source.decode)


def _check_decoded(decode, split, role, spec, where):
    """The examples `decode` makes of the split's (a record file's parsed), traced as the pipeline calls it: the
    spec's features, of its dtypes and shapes. One of another shape or dtype failed as the model read it, or as the
    evaluation padded it (a traceback after training), or trained on silently."""
    if split.files:
        record = tf.TensorSpec([], tf.string)
        raw = tf.function(split.parse).get_concrete_function(record).structured_outputs
        raw = {k: tf.TensorSpec(v.shape, v.dtype) for k, v in raw.items()} if isinstance(raw, dict) else raw
    else:
        raw = split.make().element_spec
    if not isinstance(raw, dict):
        raise TaskError(f"{where}: the {role} split's examples are {raw!r}, not dicts of features")
    raw = {k: v for k, v in raw.items() if k not in (*_OWN, *_WEIGHT)}  # what the pipeline hands the decode
    seed = tf.TensorSpec([2], tf.int64)
    traced = tf.function(lambda example, seed: decode(example, seed, role == "training"))
    decoded = traced.get_concrete_function(raw, seed).structured_outputs
    if not isinstance(decoded, dict):
        raise TaskError(f"{where}: decode returned {described(decoded)} for a {role} example, not a dict of features")
    given = {k: tf.TensorSpec(v.shape, v.dtype) if isinstance(v, tf.Tensor) else v for k, v in decoded.items()}
    _check_example(given, role, spec, where, f"decoded {role} example")


def _check_features(split, role, spec, where):
    """The split's examples hold the spec's features, of its dtypes and shapes (and the split's own: `_OWN`)."""
    given = split.make().element_spec
    if not isinstance(given, dict):
        raise TaskError(f"{where}: the {role} split's examples are {given!r}, not dicts of features")
    _check_example(given, role, spec, where, f"{role} split")


def _check_example(given, role, spec, where, what):
    """`given` ({feature: spec} of an example of the `role` split, which a message calls `what`) holds the spec's
    features, of its dtypes and shapes (and the split's own: `_OWN`)."""
    allowed = {**spec, **_OWN, **(_WEIGHT if role == "evaluation" else {})}
    missing = [f for f in spec if f not in given]
    # A training example may carry more (a task's prepare takes its own features); an evaluation split is padded to
    # the spec's features, which one more would not fit.
    extra = [f for f in given if f not in allowed] if role == "evaluation" else []
    if missing or extra:
        said = [f"lacks {', '.join(missing)}"] * bool(missing) + [f"holds {', '.join(extra)}, not in the spec"] * bool(
            extra
        )
        raise TaskError(f"{where}: the {what} {' and '.join(said)} (the spec names {', '.join(spec)})")
    for feature, one in given.items():
        wanted = allowed.get(feature)
        if wanted is None:  # a training example's own
            continue
        if not isinstance(one, tf.TensorSpec):
            raise TaskError(f"{where}: the {what}'s {feature} is {described(one)}, not a tensor")
        if one.dtype != wanted.dtype or not one.shape.is_compatible_with(wanted.shape):
            raise TaskError(
                f"{where}: the {what}'s {feature} is {one.dtype.name} of shape {one.shape}, where the "
                f"{'spec says' if feature in spec else 'engine reads'} {wanted.dtype.name} of shape {wanted.shape}"
            )


def file_bytes(path, role, dataset):
    """The bytes of a streamed split's record file `path`; ConfigError naming --dataset for one that is not there
    (deleted or moved since its records were counted: its reader would have failed forever) or is a folder."""
    try:
        stat = tf.io.gfile.stat(path)
    except tf.errors.OpError as e:
        reason = "does not exist" if isinstance(e, tf.errors.NotFoundError) else f"cannot be read ({e.message})"
        raise ConfigError(f"--dataset={dataset}: the {role} split's record file {path} {reason}") from None
    if stat.is_directory:
        raise ConfigError(f"--dataset={dataset}: the {role} split's record file {path} is a folder")
    return stat.length


def _check_classes(source, where, dataset):
    """A label's `num_classes`: a whole number of at least 2, and every label of a split held in memory below it (one
    label an example, as the source gives it: a decode's labels are its own to make); a warning for the labels its
    evaluation split holds and its training split does not."""
    if "num_classes" not in source.info:
        return
    classes = source.info["num_classes"]
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or classes < 2:
        raise TaskError(
            f"{where}: the Source's info says num_classes={classes!r}: the number of classes of its label, a whole "
            "number of at least 2 (one class leaves nothing to learn)"
        )
    if checked_classes(source) is None or source.decode is not None:
        return
    labels = {}
    for role, split in (("training", source.train), ("evaluation", source.evals)):
        if split.fetch is None or not split.examples:  # streamed: read in the steps, not twice
            continue
        labels[role] = _labels(split)
        low, high = int(labels[role][0]), int(labels[role][-1])
        if low < 0 or high >= classes:
            bad = low if low < 0 else high
            raise TaskError(f"{where}: the {role} split {outside(bad, classes)}")
    if len(labels) == 2:
        _warn_of_unlearned(np.setdiff1d(labels["evaluation"], labels["training"]), dataset)


def _warn_of_unlearned(labels, dataset):
    """A warning naming the `labels` the evaluation split holds and the training split has no example of: the model
    never learns them, which a split numbered from 1 beside one numbered from 0 made silently (a test accuracy of
    0.31, exit 0)."""
    if labels.size:
        shown = ", ".join(str(label) for label in labels[:5]) + (", ..." if labels.size > 5 else "")
        print(
            f"warning: --dataset={dataset}: its evaluation split holds {counted(labels.size, 'label')} that its "
            f"training split has no example of ({shown}): the model cannot learn them (are the splits' classes "
            "numbered alike, from 0?)",
            flush=True,
        )


def checked_classes(source):
    """The info's num_classes (an int) that each label is checked against, where an example's label is one class (a
    scalar integer); None where there is nothing to check (no num_classes, a label per token)."""
    label, classes = source.spec.get("label"), source.info.get("num_classes")
    if label is None or label.shape.rank != 0 or not label.dtype.is_integer:
        return None
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)):
        return None
    return int(classes)


def outside(label, classes):
    """What a message says of a label outside [0, classes)."""
    return f"holds the label {label}, outside [0, {classes}) of the info's num_classes={classes}"


def _check_finite(source, dataset):
    """Every real number of a split held in memory is finite, where the source has no decode (one that has makes
    what the task reads: a missing value it fills in is its own): a NaN input reads as a run that diverged ("lower
    --learning_rate"). ConfigError naming --dataset. A streamed split's are checked as they are read (the pipeline)."""
    if source.decode is not None:
        return
    for role, split in (("training", source.train), ("evaluation", source.evals)):
        spec = split.make().element_spec if split.fetch is not None and split.examples else {}
        reals = [k for k, s in spec.items() if s.dtype.is_floating and k != "weight"]
        for start, chunk in _chunks(split) if reals else ():
            for feature in reals:
                values = chunk[feature].numpy()
                finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
                if not finite.all():
                    first = start + int(np.argmin(finite))
                    said = f"holds NaN or infinity (example {first} first)"
                    raise ConfigError(f"--dataset={dataset}: the {role} split's {feature} {said}")


def _check_weights(split, dataset):
    """An evaluation split held in memory that says how much each example counts (`weight`) says a finite number of
    at least 0 for each, decode or none (the weight passes around it): a NaN weight made every mean NaN, a negative
    one counted an example against the others. ConfigError naming --dataset."""
    if split.fetch is None or not split.examples or "weight" not in split.make().element_spec:
        return
    total = 0.0
    for start, chunk in _chunks(split):
        weights = chunk["weight"].numpy()
        total += float(weights.sum())
        good = np.isfinite(weights) & (weights >= 0)
        if not good.all():
            first = int(np.argmin(good))
            raise ConfigError(
                f"--dataset={dataset}: the evaluation split's example {start + first} has the weight "
                f"{weights[first]:g}; a weight is how much an example counts in the evaluation's means, a finite "
                "number of at least 0"
            )
    if not total:  # every mean over no weight: NaN, reported as a number with exit 0
        raise ConfigError(
            f"--dataset={dataset}: every example of the evaluation split has the weight 0: its means would count "
            "none of them; a weight is how much an example counts in the evaluation's means"
        )


def _labels(split):
    """The labels a split held in memory holds, sorted, each once."""
    return np.unique(np.concatenate([np.unique(chunk["label"].numpy()) for _, chunk in _chunks(split)]))


def _chunks(split):
    """(first example, {feature: values}) of a split held in memory, about _CHUNK_BYTES at a time."""
    example = split.make().element_spec
    size = sum(
        max(1, s.shape.num_elements() or 1) * (s.dtype.size if s.dtype != tf.string else 64) for s in example.values()
    )
    chunk = max(1, _CHUNK_BYTES // size)
    for start in range(0, split.examples, chunk):
        yield start, split.fetch(tf.range(start, min(start + chunk, split.examples), dtype=tf.int64))
