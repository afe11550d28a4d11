"""A learnable random classification problem, generated once with stateless ops: the label is the argmax of a
fixed random projection of the input. --synthetic_shape, --synthetic_classes and --synthetic_examples size it."""

import numpy as np
import tensorflow as tf

from engine import data

SETTINGS = {
    "synthetic_shape": ((28, 28, 1), "shape of one input example"),
    "synthetic_classes": (10, "number of classes"),
    "synthetic_examples": (4096, "examples in the training pool (the eval pool is a quarter)"),
}


def load(config, eval_split):
    del eval_split  # one pool for training, another (a quarter of its size) for every evaluation
    shape = tuple(config.synthetic_shape)
    projection = tf.random.stateless_normal((int(np.prod(shape)), config.synthetic_classes), seed=[config.seed, 7])

    def pool(stream, examples):
        images = tf.random.stateless_uniform((examples, *shape), seed=[config.seed, stream])
        labels = tf.argmax(
            tf.reshape(images, [examples, -1]) @ projection - tf.reduce_mean(projection, 0) * 0.5, axis=-1
        )
        return data.in_memory({"image": images, "label": labels})

    spec = {"image": tf.TensorSpec(shape, tf.float32), "label": tf.TensorSpec([], tf.int64)}
    evals = pool(2, max(1, config.synthetic_examples // 4))
    return data.Source(pool(1, config.synthetic_examples), evals, spec, {"num_classes": config.synthetic_classes})
