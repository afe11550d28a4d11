"""Your own arrays, no builder: `--dataset=npz:PATH`, a NumPy .npz file (np.savez) holding one array per split and
feature, named `<split>/<feature>`:

    np.savez("digits.npz", **{"train/image": x_train, "train/label": y_train,
                               "test/image": x_test, "test/label": y_test})

Every array of a split has one row per example. An integer `label` gives the task its number of classes (the
largest label + 1 over all splits). The splits are held in memory; a file that cannot be read, a missing split or
arrays of different lengths stop the run naming the file and what is wrong.
"""

import zipfile

import numpy as np
import tensorflow as tf

from engine import data
from engine.config import ConfigError


def load(config, eval_split):
    path = config.dataset.partition(":")[2]
    where = f"--dataset={config.dataset}"
    if not path:
        raise ConfigError(f"{where}: name the file, --dataset=npz:PATH")
    try:
        with tf.io.gfile.GFile(path, "rb") as f, np.load(f, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (tf.errors.OpError, OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ConfigError(f"{where}: cannot read it as a .npz file ({getattr(e, 'message', None) or e})") from None
    splits = {}
    for name, values in arrays.items():
        split, _, feature = name.rpartition("/")
        if not split:
            raise ConfigError(f"{where}: array {name!r} is not named <split>/<feature> (e.g. train/image)")
        splits.setdefault(split, {})[feature] = values
    for split, features in splits.items():
        lengths = {feature: len(values) for feature, values in features.items()}
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"{where}: the arrays of split {split!r} differ in length ({lengths})")
    for flag, split in (("train_split", config.train_split), ("eval_split", eval_split)):
        if split not in splits:
            raise ConfigError(f"--{flag}={split}: not a split of {path} (splits: {', '.join(sorted(splits))})")
    train = splits[config.train_split]
    for split, features in splits.items():
        if {f: (v.dtype, v.shape[1:]) for f, v in features.items()} != {
            f: (v.dtype, v.shape[1:]) for f, v in train.items()
        }:
            raise ConfigError(f"{where}: split {split!r} holds other features or shapes than {config.train_split!r}")
    try:
        spec = {f: tf.TensorSpec(v.shape[1:], tf.as_dtype(v.dtype)) for f, v in train.items()}
    except TypeError as e:
        raise ConfigError(f"{where}: arrays must be numbers or booleans ({e})") from None
    info = {}
    labels = [features["label"] for features in splits.values() if "label" in features]
    if labels and np.issubdtype(labels[0].dtype, np.integer):
        info["num_classes"] = int(max(int(values.max()) for values in labels if len(values))) + 1
    constant = lambda features: data.in_memory({f: tf.constant(v) for f, v in features.items()})  # noqa: E731
    return data.Source(constant(train), constant(splits[eval_split]), spec, info)
