"""Palmer penguins: body mass from a penguin's measurements, species, island and sex (a regression source).

The data (sources/data/README.md: CC0, bundled) has 344 rows; the 11 with a missing value (2 without
any measurement, 9 without a sex) are dropped, leaving 333. `features` is a float32 vector of the three bill and
flipper measurements (mm) and one-hot species, island and sex; `target` the body mass in grams. The study year
is left out: it says when a bird was measured, not what it is.

Rows split by their position in the file, as the digits do: the rows are ordered by species and island, so
every tenth row spreads each split over all of them. `info` holds the mean and standard deviation of each
feature and of the target over the TRAINING split only (--train_split), so nothing of the evaluation rows leaks
into the standardization a task applies.
"""

import csv
import functools
import gzip
import os

import numpy as np
import tensorflow as tf

from engine.api import ConfigError, Source, in_memory

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "penguins.csv.gz")
MEASUREMENTS = ("bill_length_mm", "bill_depth_mm", "flipper_length_mm")
CATEGORIES = {
    "species": ("Adelie", "Chinstrap", "Gentoo"),
    "island": ("Biscoe", "Dream", "Torgersen"),
    "sex": ("female", "male"),
}
FEATURE_NAMES = (*MEASUREMENTS, *(f"{column}={value}" for column, values in CATEGORIES.items() for value in values))
TARGET = "body_mass_g"
MISSING = "NA"
SPLITS = ("train", "validation", "test")
_SPLIT_OF_REMAINDER = {0: "test", 1: "test", 2: "validation"}  # of the row's position in the file, modulo 10


def split_of(row_index):
    return _SPLIT_OF_REMAINDER.get(row_index % 10, "train")


@functools.lru_cache(maxsize=1)
def read(path=PATH):
    """(features float64 [n, 11], target float64 [n], split name of each row [n], rows dropped) of the complete
    rows, in file order."""
    features, target, splits, dropped = [], [], [], 0
    with gzip.open(path, "rt", newline="") as f:
        reader = csv.DictReader(f)
        missing = {*MEASUREMENTS, TARGET, *CATEGORIES} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: no column {', '.join(sorted(missing))}")
        for index, row in enumerate(reader):
            if MISSING in (row[c] for c in (*MEASUREMENTS, TARGET, *CATEGORIES)):
                dropped += 1
                continue
            try:
                one_hot = [float(row[column] == value) for column, values in CATEGORIES.items() for value in values]
                if sum(one_hot) != len(CATEGORIES):
                    raise ValueError("an unknown category")
                features.append([float(row[c]) for c in MEASUREMENTS] + one_hot)
                target.append(float(row[TARGET]))
            except ValueError as e:
                raise ValueError(f"{path}:{reader.line_num}: {e}") from None
            splits.append(split_of(index))
    return np.array(features), np.array(target), np.array(splits), dropped


def load(config, eval_split):
    features, target, splits, dropped = read()
    for flag, split in (("train_split", config.train_split), ("eval_split", eval_split)):
        if split not in SPLITS:
            raise ConfigError(f"--{flag}={split}: not a split of penguins ({', '.join(SPLITS)})")

    def rows(split):
        return features[splits == split], target[splits == split]

    train_features, train_target = rows(config.train_split)
    info = {
        "feature_names": FEATURE_NAMES,
        "feature_mean": train_features.mean(axis=0),
        "feature_std": train_features.std(axis=0),
        "target_name": TARGET,
        "target_mean": float(train_target.mean()),
        "target_std": float(train_target.std()),
        "dropped": dropped,
    }

    def split(name):
        x, y = rows(name)
        return in_memory({"features": tf.constant(x, tf.float32), "target": tf.constant(y, tf.float32)})

    spec = {"features": tf.TensorSpec([len(FEATURE_NAMES)], tf.float32), "target": tf.TensorSpec([], tf.float32)}
    return Source(split(config.train_split), split(eval_split), spec, info)
