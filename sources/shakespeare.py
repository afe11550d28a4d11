"""Tiny Shakespeare, character by character (sources/data/README.md: public domain, bundled).

The vocabulary is the sorted set of the whole text's characters (65); a token is a character's index in it.
The first 90% of the text trains and the last 10% validates, as nanoGPT's `shakespeare_char` splits it. The
corpus has no separate test text: --eval_split=test names the validation text too, so the engine's default
split works (a tuner's --validation_split and --eval_split then both read it).

Training examples are the windows of --sequence_length + 1 characters that start at every offset of the
training text (the model reads the first T, predicts the last T), gathered on demand: the engine's index
shuffle draws from all of them without a copy per window. Evaluation predicts every validation character
exactly once: consecutive windows whose first character is the one before the targets (the last training
character for the first window); the last window is padded, and each window's `weight` is how many of its
targets are real, so the engine's weighted means are per character.
"""

import functools
import gzip
import os

import numpy as np
import tensorflow as tf

from engine.api import ConfigError, Source, Split, in_memory

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt.gz")
TRAIN_FRACTION = 0.9  # nanoGPT's split: the first 90% of the text trains, the rest validates
EVAL_SPLITS = ("validation", "test")  # the same text: the corpus has no other held-out part
READS = ("sequence_length",)  # language_model's setting: the windows' length, whatever task trains on them


@functools.lru_cache(maxsize=1)
def text():
    """The whole corpus as a string."""
    with gzip.open(PATH, "rt", encoding="utf-8") as f:
        return f.read()


def vocabulary():
    """The sorted characters of the corpus, as one string."""
    return "".join(sorted(set(text())))


def encode(string, chars):
    """Token ids of `string` in the vocabulary `chars`; every character must be in it."""
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in string], np.int32)


def boundary():
    """Where validation starts: the index of its first character."""
    return int(len(text()) * TRAIN_FRACTION)


def load(config, eval_split):
    if config.train_split != "train":
        raise ConfigError(f"--train_split={config.train_split}: shakespeare trains on its train split only")
    if eval_split not in EVAL_SPLITS:
        raise ConfigError(
            f"--eval_split={eval_split}: not a split of shakespeare (validation, the last 10% of the text; "
            "test is the same text)"
        )
    chars = vocabulary()
    tokens = encode(text(), chars)
    window = config.sequence_length + 1
    split_at = boundary()
    if split_at < window or len(tokens) - split_at < 1:
        raise ConfigError(f"--sequence_length={config.sequence_length}: longer than shakespeare's training text")

    train_tokens = tf.constant(tokens[:split_at])
    offsets = tf.range(window, dtype=tf.int64)

    def fetch(indices):
        return {"tokens": tf.gather(train_tokens, indices[:, None] + offsets)}

    starts = split_at - window + 1
    train = Split(
        starts,
        lambda: tf.data.Dataset.range(starts).batch(1024).map(fetch).unbatch(),
        fetch,
    )

    # The targets are the validation characters; each window's first token is the character before its targets.
    targets = len(tokens) - split_at
    per_window = config.sequence_length
    count = -(-targets // per_window)
    padded = np.zeros(count * per_window + 1, np.int32)
    padded[: targets + 1] = tokens[split_at - 1 :]
    rows = np.arange(count)[:, None] * per_window + np.arange(window)
    weights = np.minimum(per_window, targets - np.arange(count) * per_window).astype(np.float32)
    evals = in_memory({"tokens": tf.constant(padded[rows]), "weight": tf.constant(weights)})

    spec = {"tokens": tf.TensorSpec([window], tf.int32)}
    # "weight_counts_targets": an evaluation window's weight is its number of real targets (the first ones).
    info = {"vocabulary": chars, "characters": targets, "weight_counts_targets": True}
    return Source(train, evals, spec, info)
