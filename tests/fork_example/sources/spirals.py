"""Two interleaved spirals, one per class: a small problem a linear model cannot solve. Generated with NumPy
from fixed seeds, one per split, so every run and every worker sees the same points.

A data source is one file, sources/<name>.py, with `load(config, eval_split) -> engine.api.Source`:
--dataset=spirals finds it (or a task's DATASET = "spirals")."""

import numpy as np
import tensorflow as tf

from engine.api import ConfigError, Source, in_memory

SPLITS = {"train": (1, 2000), "validation": (2, 500), "test": (3, 500)}  # split: (seed, examples)
TURNS = 1.25  # how far each spiral winds
NOISE = 0.04  # standard deviation of the Gaussian noise added to each coordinate


def _split(flag, name):
    if name not in SPLITS:
        raise ConfigError(f"--{flag}={name}: spirals has the splits {', '.join(SPLITS)}")
    seed, examples = SPLITS[name]
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, examples)
    turn = np.sqrt(rng.uniform(0.0, 1.0, examples)) * TURNS * 2 * np.pi  # sqrt: points spread evenly over the area
    angle = turn + np.pi * label  # the second spiral is the first turned by half a circle
    radius = turn / (TURNS * 2 * np.pi)
    point = radius[:, None] * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    point += rng.normal(0.0, NOISE, point.shape)
    return in_memory({"point": tf.constant(point, tf.float32), "label": tf.constant(label, tf.int64)})


def load(config, eval_split):
    spec = {"point": tf.TensorSpec([2], tf.float32), "label": tf.TensorSpec([], tf.int64)}
    train, evals = _split("train_split", config.train_split), _split("eval_split", eval_split)
    return Source(train, evals, spec, {"num_classes": 2})
