"""Your own arrays (--dataset=npz:PATH): a NumPy .npz of <split>/<feature> arrays.

Your own arrays, no builder: `--dataset=npz:PATH`, a NumPy .npz file (np.savez) holding one array per split and
feature, named `<split>/<feature>`:

    np.savez("digits.npz", **{"train/image": x_train, "train/label": y_train,
                               "test/image": x_test, "test/label": y_test})

Every array of a split has one row per example, of real numbers or booleans. A `label` is a class, an integer
0 .. N-1, one per example; the task's number of classes is the largest label + 1 over all splits (a label may name
classes no example has, up to MANY_CLASSES of them, or as many as the file has examples). The splits are held in
memory; a file that cannot be read, a missing or empty split, arrays of different lengths, an array of another kind,
a label outside these bounds, or NaN or infinity in a split the run reads stop the run naming the file, the array
and what is wrong.
"""

import zipfile

import numpy as np
import tensorflow as tf

from engine.api import ENGINE_FEATURES, ConfigError, Source, in_memory

# What follows the source's name in --dataset, and what it names: --help says so.
ARGUMENT = ("PATH", "a NumPy .npz of <split>/<feature> arrays")
MANY_CLASSES = 1 << 16  # classes a label may imply beyond the file's examples (a subset of a large label set)
_CLASS = "a label is a class, an integer 0 .. N-1"
# How the files numpy reads begin: a zip archive (a .npz; an empty one begins with its end record), a .npy array.
ZIP, NPY = (b"PK\x03\x04", b"PK\x05\x06"), b"\x93NUMPY"


def memory(config):
    """Bytes its data holds at its peak, for the memory check before it is read, from the archive's directory alone:
    every array numpy reads (each member's size unpacked: its header and values), and the TensorFlow copies of the
    training and evaluation splits made beside them. 0 for a file it cannot read: load says what is wrong."""
    path = config.dataset.partition(":")[2]
    try:
        opened = tf.io.gfile.GFile(path, "rb") if "://" in path else open(path, "rb")
        with opened as f, zipfile.ZipFile(f) as archive:
            members = [m for m in archive.infolist() if m.filename.endswith(".npy")]
    except (tf.errors.OpError, OSError, ValueError, zipfile.BadZipFile, EOFError):
        return 0
    held = {config.train_split, config.eval_split}
    copies = sum(m.file_size for m in members if m.filename[: -len(".npy")].rpartition("/")[0] in held)
    return sum(m.file_size for m in members) + copies


def load(config, eval_split):
    path = config.dataset.partition(":")[2]
    where = f"--dataset={config.dataset}"
    if not path:
        raise ConfigError(f"{where}: name the file, --dataset=npz:PATH")
    try:
        # A local file through Python's own open: its name may be any bytes (one not UTF-8 comes as surrogate
        # escapes, which TensorFlow's file system refuses).
        opened = tf.io.gfile.GFile(path, "rb") if "://" in path else open(path, "rb")
        with opened as f:
            begins = f.read(6)
            f.seek(0)
            if not begins.startswith((*ZIP, NPY)):  # numpy takes anything else for pickled data, which it refuses
                what = "is empty" if not begins else f"begins with {begins!r}, not a zip archive's {ZIP[0]!r}"
                raise ConfigError(f"{where}: not a .npz archive (it {what})")
            archive = np.load(f, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):  # a .npy file: one array, no names
                raise ConfigError(f"{where}: a single array (a .npy file), not a .npz archive of named arrays")
            with archive:
                arrays = {name: _member(where, archive, name) for name in archive.files}
    except ConfigError:
        raise
    except (tf.errors.OpError, OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ConfigError(f"{where}: cannot read it as a .npz file ({getattr(e, 'message', None) or e})") from None
    splits = {}
    for name, values in arrays.items():
        split, _, feature = name.rpartition("/")
        if not split:
            raise ConfigError(f"{where}: array {name!r} is not named <split>/<feature> (e.g. train/image)")
        _check_array(where, name, values)
        splits.setdefault(split, {})[feature] = values
    for split, features in splits.items():
        lengths = {feature: len(values) for feature, values in features.items()}
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"{where}: the arrays of split {split!r} differ in length ({lengths})")
    for flag, split in (("train_split", config.train_split), ("eval_split", eval_split)):
        if split not in splits:
            raise ConfigError(f"--{flag}={split}: not a split of {path} (splits: {', '.join(sorted(splits))})")
        if not len(next(iter(splits[split].values()))):
            raise ConfigError(f"{where}: split {split!r} (--{flag}={split}) holds no examples")
    for split in dict.fromkeys((config.train_split, eval_split)):  # those the run reads: a step reading one is NaN
        for feature, values in splits[split].items():
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                at = int(np.argwhere(~np.isfinite(values.reshape(len(values), -1)))[0][0])
                raise ConfigError(f"{where}: {split}/{feature} holds NaN or infinity (example {at} first)")
    train = splits[config.train_split]
    for split, features in splits.items():
        if {f: (v.dtype, v.shape[1:]) for f, v in features.items()} != {
            f: (v.dtype, v.shape[1:]) for f, v in train.items()
        }:
            raise ConfigError(f"{where}: split {split!r} holds other features or shapes than {config.train_split!r}")
    spec = {f: tf.TensorSpec(v.shape[1:], tf.as_dtype(v.dtype)) for f, v in train.items()}
    info = {}
    if "label" in train:
        info["num_classes"] = _classes(where, splits)
    constant = lambda features: in_memory({f: tf.constant(v) for f, v in features.items()})  # noqa: E731
    return Source(constant(train), constant(splits[eval_split]), spec, info)


def _member(where, archive, name):
    """The array `name` of the open archive: what cannot be read of it (an object array, a header that declares more
    than the member holds, an array larger than memory) is named by the array, not by this file's line (a MemoryError
    was `error: sources/npz.py:51 in <dictcomp>: MemoryError: Unable to allocate 291. TiB ...`)."""
    try:
        return archive[name]
    except MemoryError as e:
        raise ConfigError(
            f"{where}: array {name!r} does not fit in memory ({e}): a damaged header, or arrays too large to hold in "
            "memory (write them as TFRecord files, --dataset=tfrecord:, which streams them)"
        ) from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ConfigError(f"{where}: cannot read its array {name!r} ({e})") from None


def _check_array(where, name, values):
    """Refuses an array TensorFlow would misread: strings or complex numbers (cast to float they fail, or lose
    their imaginary part), a single value, examples that hold no values, a label that is not one integer each; a
    member numpy did not write, and a feature the engine sets itself."""
    if not isinstance(values, np.ndarray):  # a member numpy did not write: it gives its bytes
        raise ConfigError(f"{where}: {name!r} is not an array (.npy) but a file of another kind in the archive")
    feature = name.rpartition("/")[2]
    if feature in ENGINE_FEATURES:  # a column of the engine's would be overwritten, or taken for its own
        raise ConfigError(
            f"{where}: array {name!r}: {feature} is a feature the engine sets itself ({ENGINE_FEATURES[feature]}); "
            "name the array otherwise"
        )
    kinds = {"U": "strings", "S": "strings", "c": "complex numbers"}
    if values.dtype.kind not in "biuf":
        what = kinds.get(values.dtype.kind, "values of another kind")
        raise ConfigError(
            f"{where}: array {name!r} holds {what} ({values.dtype}): arrays must hold real numbers or booleans"
        )
    try:
        tf.as_dtype(values.dtype)
    except TypeError:
        raise ConfigError(
            f"{where}: array {name!r} holds {values.dtype} values, which TensorFlow cannot hold"
        ) from None
    if values.ndim == 0:
        raise ConfigError(f"{where}: array {name!r} is a single value: it needs one row per example")
    if values.ndim > 1 and not np.prod(values.shape[1:]):
        raise ConfigError(f"{where}: array {name!r}: its examples, of shape {values.shape[1:]}, hold no values")
    if name.rpartition("/")[2] == "label":
        if values.dtype.kind not in "iu":
            raise ConfigError(f"{where}: array {name!r} holds {values.dtype} values: {_CLASS}")
        if values.ndim != 1:
            raise ConfigError(
                f"{where}: array {name!r} has shape {values.shape}: a label is one class per example, shape (examples,)"
            )


def _classes(where, splits):
    """The number of classes of the splits' labels (the largest + 1), refusing a negative label and one so large
    that most of its classes could have no example."""
    labels = {f"{split}/label": features["label"] for split, features in splits.items() if len(features["label"])}
    for name, values in labels.items():
        if values.min() < 0:
            row = int(np.argmax(values < 0))
            raise ConfigError(f"{where}: array {name!r} holds the label {values[row]} (row {row}): {_CLASS}")
    if not labels:
        return 1
    name = max(labels, key=lambda n: int(labels[n].max()))
    row = int(np.argmax(labels[name]))
    classes = int(labels[name][row]) + 1
    if classes < 2:  # one class: every prediction is right, and the accuracy says nothing
        raise ConfigError(f"{where}: every label is 0 (arrays {', '.join(map(repr, labels))}): one class; {_CLASS}")
    examples = sum(len(next(iter(features.values()))) for features in splits.values())
    if classes > max(examples, MANY_CLASSES):
        raise ConfigError(
            f"{where}: array {name!r} holds the label {labels[name][row]} (row {row}): that makes {classes} classes "
            f"(the largest label + 1) for its {examples} examples; {_CLASS}"
        )
    return classes
