"""A small pre-norm Transformer encoder that classifies a sequence of vectors.

An image (H, W, C) is read as a sequence of H tokens, one per row, each the row's W*C values:
the bundled digits become 8 tokens of 8 pixels, MNIST 28 of 28. Inputs of shape (T, D) are
already sequences.
"""

import math

import tensorflow as tf

keras = tf.keras

SETTINGS = {
    "transformer_layers": (2, "number of encoder blocks"),
    "transformer_dim": (64, "model width (token embedding size)"),
    "transformer_heads": (4, "attention heads; must divide transformer_dim"),
    "transformer_mlp_dim": (128, "hidden width of each block's MLP"),
}
READS = ("dropout",)  # the engine's setting: dropout in attention and on each residual branch


class Block(keras.layers.Layer):
    def __init__(self, dim, heads, mlp_dim, dropout, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=dropout)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.mlp_in = keras.layers.Dense(mlp_dim, activation="gelu")
        self.mlp_out = keras.layers.Dense(dim)
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x, training=False):
        y = self.norm1(x)
        x = x + self.dropout(self.attention(y, y, training=training), training=training)
        y = self.mlp_out(self.mlp_in(self.norm2(x)))
        return x + self.dropout(y, training=training)


class Transformer(keras.Model):
    def __init__(self, sequence_length, layers, dim, heads, mlp_dim, num_classes, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(dim)
        self.position = self.add_weight(
            shape=(sequence_length, dim), initializer=keras.initializers.RandomNormal(stddev=0.02), name="position"
        )
        self.blocks = [Block(dim, heads, mlp_dim, dropout) for _ in range(layers)]
        self.norm = keras.layers.LayerNormalization(epsilon=1e-6)
        self.head = keras.layers.Dense(num_classes, dtype="float32")

    def call(self, inputs, training=False):
        features = 1
        for size in inputs.shape[2:]:
            features *= size
        tokens = tf.reshape(inputs, [tf.shape(inputs)[0], inputs.shape[1], features])
        x = self.embed(tokens) + tf.cast(self.position, self.compute_dtype)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(tf.reduce_mean(self.norm(x), axis=1))


def create(config, spec, num_classes, info):
    del info  # the inputs' shape is all it reads of them
    input_shape = tuple(spec.shape)
    if len(input_shape) < 2:
        raise ValueError(f"transformer needs inputs of shape (tokens, features...), got {input_shape}")
    if config.transformer_dim % config.transformer_heads:
        raise ValueError(
            f"--transformer_heads={config.transformer_heads}: must divide --transformer_dim={config.transformer_dim}"
        )
    return Transformer(
        input_shape[0],
        config.transformer_layers,
        config.transformer_dim,
        config.transformer_heads,
        config.transformer_mlp_dim,
        num_classes,
        config.dropout,
        name="transformer",
    )


def size(config, input_shape, num_classes):
    """(parameters, activation floats per example) before the model exists: parameters exact (Keras's
    count_params), activations what a forward pass keeps for the backward one, roughly."""
    tokens, features = input_shape[0], math.prod(input_shape[1:])
    dim, heads, mlp = config.transformer_dim, config.transformer_heads, config.transformer_mlp_dim
    attention = 4 * dim * dim + 3 * dim + dim  # query, key, value, output kernels and their biases
    block = 2 * 2 * dim + attention + dim * mlp + mlp + mlp * dim + dim
    parameters = features * dim + dim + tokens * dim + config.transformer_layers * block
    parameters += 2 * dim + dim * num_classes + num_classes
    # Per block: the norms, query/key/value, attention output, residuals (about 8 x dim per token), the MLP's
    # hidden layer before and after its activation, and every head's token-by-token scores and softmax.
    activations = tokens * features + config.transformer_layers * (tokens * (8 * dim + 2 * mlp) + 2 * heads * tokens**2)
    forward = tokens * features + tokens * (8 * dim + 2 * mlp) + 2 * heads * tokens**2  # one block's at a time
    return parameters, activations + num_classes, forward + num_classes
