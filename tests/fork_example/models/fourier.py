"""Fourier features, then an MLP (Tancik et al., 2020): sines and cosines of learned projections let a small
network fit inputs of a few dimensions (points, coordinates) that a plain MLP fits slowly.

A model family is one file, models/<name>.py, with `create(config, spec, outputs, info) -> keras.Model` (`spec`
the tf.TensorSpec of one example, `info` what the source knows of it: a vocabulary, the number of classes):
--model=fourier finds it. Its SETTINGS become flags (--fourier_width=128) and fields of the run's config."""

import tensorflow as tf

keras = tf.keras

SETTINGS = {
    "fourier_frequencies": (32, "learned projections of the input, each giving a sine and a cosine feature"),
    "fourier_scale": (4.0, "standard deviation of the projections' initial frequencies: higher fits finer detail"),
    "fourier_width": (64, "width of the hidden layer after the features"),
}


class Fourier(keras.Model):
    def __init__(self, frequencies, scale, width, outputs, **kwargs):
        super().__init__(**kwargs)
        self.flatten = keras.layers.Flatten()
        initializer = keras.initializers.RandomNormal(stddev=scale)
        self.project = keras.layers.Dense(frequencies, kernel_initializer=initializer, name="project")
        self.hidden = keras.layers.Dense(width, activation="relu", name="hidden")
        self.head = keras.layers.Dense(outputs, dtype="float32", name="head")  # float32 logits in any precision

    def call(self, inputs, training=False):
        angles = self.project(self.flatten(inputs))
        return self.head(self.hidden(tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)))


def create(config, spec, outputs, info):
    del spec, info  # the layers infer the input width on the first call
    return Fourier(config.fourier_frequencies, config.fourier_scale, config.fourier_width, outputs, name="fourier")
