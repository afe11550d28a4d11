"""A multilayer perceptron over flattened inputs."""

import math

import tensorflow as tf

keras = tf.keras

SETTINGS = {"hidden_sizes": ((512, 512), "widths of the hidden layers")}
READS = ("dropout",)  # the engine's setting: the rate of the dropout after each hidden layer


class MLP(keras.Model):
    def __init__(self, hidden_sizes, num_classes, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.flatten = keras.layers.Flatten()
        self.hidden = [keras.layers.Dense(width, activation="relu") for width in hidden_sizes]
        self.dropout = keras.layers.Dropout(dropout) if dropout else None
        self.head = keras.layers.Dense(num_classes, dtype="float32")

    def call(self, inputs, training=False):
        x = self.flatten(inputs)
        for layer in self.hidden:
            x = layer(x)
            if self.dropout:
                x = self.dropout(x, training=training)
        return self.head(x)


def create(config, spec, num_classes, info):
    del spec, info  # Dense layers infer the input width on the first call
    return MLP(config.hidden_sizes, num_classes, config.dropout, name="mlp")


def size(config, input_shape, num_classes):
    """(parameters, activation floats per example) before the model exists: parameters exact (Keras's
    count_params), activations each layer's output, kept for the backward pass."""
    widths = [math.prod(input_shape), *config.hidden_sizes, num_classes]
    parameters = sum(a * b + b for a, b in zip(widths, widths[1:]))
    return parameters, sum(widths)
