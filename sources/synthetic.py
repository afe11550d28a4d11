"""A learnable random classification problem of any shape, generated with stateless ops.

A learnable random classification problem, generated once with stateless ops: the label is the argmax of a
fixed random projection of the input. --synthetic_shape, --synthetic_classes and --synthetic_examples size it."""

import math

import numpy as np
import tensorflow as tf

from engine.api import ConfigError, Source, in_memory

SETTINGS = {
    "synthetic_shape": ((28, 28, 1), "shape of one input example"),
    # One class would label every example 0: accuracy 1.0 whatever the model learns.
    "synthetic_classes": (10, "number of classes, at least 2", (2, 2_147_483_647)),
    "synthetic_examples": (4096, "examples in the training pool (the eval pool is a quarter)"),
}


def memory(config):
    """Bytes its data holds, for the memory check before it is generated: the training pool and an evaluation pool
    (float32 examples, int64 labels), the labelling projection, and the training pool's logits and their shifted
    copy as its labels are drawn (examples x classes each)."""
    features = math.prod(config.synthetic_shape)
    examples = config.synthetic_examples + max(1, config.synthetic_examples // 4)
    logits = 2 * 4 * config.synthetic_examples * config.synthetic_classes
    return examples * (4 * features + 8) + 4 * features * config.synthetic_classes + logits


def load(config, eval_split):
    """Three pools: train (--synthetic_examples), validation and test (a quarter of that each)."""
    shape = tuple(config.synthetic_shape)
    projection = tf.random.stateless_normal((int(np.prod(shape)), config.synthetic_classes), seed=[config.seed, 7])

    def pool(stream, examples):
        images = tf.random.stateless_uniform((examples, *shape), seed=[config.seed, stream])
        labels = tf.argmax(
            tf.reshape(images, [examples, -1]) @ projection - tf.reduce_mean(projection, 0) * 0.5, axis=-1
        )
        return in_memory({"image": images, "label": labels})

    spec = {"image": tf.TensorSpec(shape, tf.float32), "label": tf.TensorSpec([], tf.int64)}
    held_out = max(1, config.synthetic_examples // 4)
    pools = {"train": (1, config.synthetic_examples), "validation": (3, held_out), "test": (2, held_out)}
    if eval_split not in pools:
        raise ConfigError(f"--eval_split={eval_split}: not a split of synthetic ({', '.join(pools)})")
    info = {"num_classes": config.synthetic_classes}
    return Source(pool(*pools["train"]), pool(*pools[eval_split]), spec, info)
