"""Dtype policy, the engine-owned dynamic loss scale for float16, and a float32 sum that keeps its digits."""

import keras
import tensorflow as tf

FLOOR = 1.0  # the loss scale halves on a non-finite step down to this, and no lower


def set_policy(precision):
    """Sets Keras's global dtype policy. The policy is thread-local: call it in the main thread,
    before any layer is created (MirroredStrategy runs replica functions in other threads)."""
    keras.mixed_precision.set_global_policy(precision)


def pairwise_sum(values):
    """The sum of a vector, added in pairs: XLA adds a tensor's elements in order, and a running float32 sum of n
    numbers gathers n roundings (128 weights of 0.3: 38.399952 where they sum to 38.4), a pairwise one log2(n). A
    vector of unknown length is summed as TensorFlow sums it."""
    count = values.shape[0]
    if count is None:
        return tf.reduce_sum(values)
    while count > 1:
        if count % 2:
            values = tf.concat([values, tf.zeros_like(values[:1])], 0)
            count += 1
        values = values[0::2] + values[1::2]
        count //= 2
    return tf.reduce_sum(values)  # of one value, or of none


class LossScale(tf.Module):
    """Dynamic loss scale: halves on a non-finite step, doubles after `growth_interval` finite steps, but never past
    float32's largest number: a scale of inf would halve to inf, every later step skipped above the floor.

    Updated from the all-reduced finite flag, so every replica computes the same new state.
    """

    def __init__(self, initial_scale, growth_interval):
        super().__init__(name="loss_scale")
        self.growth_interval = growth_interval
        self.scale = tf.Variable(float(initial_scale), dtype=tf.float32, trainable=False, name="scale")
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps")

    def next_state(self, finite):
        """(scale, good_steps) after a step whose gradients were all finite or not."""
        good = self.good_steps + 1
        grow = good >= self.growth_interval
        # Where all of a step's gradients stay in float32 (a trained head over a frozen float16 body), nothing
        # overflows to stop the growth: doubled past float32's largest number the scale is inf, which halves to inf.
        grown = self.scale * 2.0
        grown = tf.where(tf.math.is_finite(grown), grown, self.scale)
        scale = tf.where(finite, tf.where(grow, grown, self.scale), tf.maximum(self.scale / 2.0, FLOOR))
        good = tf.where(finite & ~grow, good, tf.zeros_like(good))
        return scale, good
