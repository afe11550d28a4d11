"""A GPT: a causal pre-norm Transformer decoder over integer tokens, as nanoGPT builds it.

Inputs (T,) token ids; outputs (T, vocabulary) logits of the next token at every position. Token and
learned position embeddings; each block adds causal self-attention (one fused query/key/value projection,
a fixed lower-triangular mask) and a 4x MLP to its input; a final norm; the head computes in float32.
(The attention is written out with einsum: cheaper than Keras's MultiHeadAttention on a CPU; measured:
bench/RESULTS.md, section "Attention written out with einsum".)
Weights start as GPT-2's: normal(0.02), the residual projections scaled by 1/sqrt(2 x layers).
"""

import math

import tensorflow as tf

keras = tf.keras

SETTINGS = {
    "gpt_layers": (4, "number of decoder blocks"),
    "gpt_heads": (4, "attention heads; must divide gpt_dim"),
    "gpt_dim": (128, "model width (token embedding size); each block's MLP is 4x wider"),
}
READS = ("dropout",)  # the engine's setting: dropout on the embeddings, attention weights and residual branches


def _normal(stddev=0.02):
    return keras.initializers.RandomNormal(stddev=stddev)


class Block(keras.layers.Layer):
    def __init__(self, dim, heads, layers, dropout, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads
        residual = _normal(0.02 / math.sqrt(2 * layers))
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.qkv = keras.layers.Dense(3 * dim, kernel_initializer=_normal())
        self.proj = keras.layers.Dense(dim, kernel_initializer=residual)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.mlp_in = keras.layers.Dense(4 * dim, activation="gelu", kernel_initializer=_normal())
        self.mlp_out = keras.layers.Dense(dim, kernel_initializer=residual)
        # Layers without a rate create no random state: a dropout-free model's checkpoint holds weights only.
        self.dropouts = [keras.layers.Dropout(dropout) for _ in range(3)] if dropout else None

    def _drop(self, i, x, training):
        return self.dropouts[i](x, training=training) if self.dropouts else x

    def call(self, x, training=False):
        batch, tokens, dim = tf.shape(x)[0], x.shape[1], x.shape[2]
        qkv = tf.reshape(self.qkv(self.norm1(x)), [batch, tokens, 3, self.heads, dim // self.heads])
        q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each [batch, heads, tokens, head_dim]
        scores = tf.einsum("bhqd,bhkd->bhqk", q, k) * tf.cast(1.0 / math.sqrt(dim // self.heads), q.dtype)
        # Position q attends to keys 0..q only: the mask is a constant of the static sequence length.
        causal = tf.linalg.band_part(tf.ones([tokens, tokens], tf.bool), -1, 0)
        scores = tf.where(causal, scores, tf.cast(-1e4 if scores.dtype == tf.float16 else -1e9, scores.dtype))
        weights = self._drop(0, tf.nn.softmax(scores, axis=-1), training)
        attended = tf.reshape(
            tf.transpose(tf.einsum("bhqk,bhkd->bhqd", weights, v), [0, 2, 1, 3]), [batch, tokens, dim]
        )
        x = x + self._drop(1, self.proj(attended), training)
        return x + self._drop(2, self.mlp_out(self.mlp_in(self.norm2(x))), training)


class GPT(keras.Model):
    def __init__(self, sequence_length, vocabulary, layers, heads, dim, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocabulary, dim, embeddings_initializer=_normal())
        self.position = self.add_weight(shape=(sequence_length, dim), initializer=_normal(), name="position")
        self.dropout = keras.layers.Dropout(dropout) if dropout else None
        self.blocks = [Block(dim, heads, layers, dropout) for _ in range(layers)]
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.head = keras.layers.Dense(vocabulary, dtype="float32", kernel_initializer=_normal())

    def call(self, tokens, training=False):
        x = self.embed(tokens) + tf.cast(self.position[: tokens.shape[1]], self.compute_dtype)
        if self.dropout:
            x = self.dropout(x, training=training)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.norm(x))


def create(config, spec, num_outputs, info):
    del info  # the vocabulary arrives as num_outputs, the width of its logits (tasks/language_model.py)
    input_shape = tuple(spec.shape)
    if len(input_shape) != 1:
        raise ValueError(f"gpt reads a sequence of token ids of shape (tokens,), got {input_shape}")
    if not spec.dtype.is_integer:  # real numbers would be truncated to token ids, and the error come from elsewhere
        raise ValueError(f"gpt reads integer token ids, got {spec.dtype.name} values of shape {input_shape}")
    if config.gpt_dim % config.gpt_heads:
        raise ValueError(f"--gpt_heads={config.gpt_heads}: must divide --gpt_dim={config.gpt_dim}")
    return GPT(
        input_shape[0],
        num_outputs,
        config.gpt_layers,
        config.gpt_heads,
        config.gpt_dim,
        config.dropout,
        name="gpt",
    )


def size(config, input_shape, vocabulary):
    """(parameters, activation floats per example, floats per example a forward pass holds at once) before the model
    exists: parameters exact (Keras's count_params), activations what a forward pass keeps for the backward one,
    roughly (bench/memory.py measures them)."""
    tokens, dim, layers = input_shape[0], config.gpt_dim, config.gpt_layers
    # Per block: two norms (4 x dim), query/key/value (3 x dim wide), the output projection, the 4x MLP.
    block = 4 * dim + (dim * 3 * dim + 3 * dim) + (dim * dim + dim) + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)
    parameters = vocabulary * dim + tokens * dim + layers * block + 2 * dim + dim * vocabulary + vocabulary
    # Per token and block: norms, query/key/value, attention output and projection, residuals, the MLP's hidden
    # layer before and after its activation (about 17 x dim); every head's scores and softmax; the logits.
    activations = tokens * (2 * dim + layers * 17 * dim + vocabulary) + layers * 2 * config.gpt_heads * tokens**2
    # A forward pass alone (evaluation) holds one block's at a time, beside the embeddings and the logits.
    forward = tokens * (2 * dim + 17 * dim + vocabulary) + 2 * config.gpt_heads * tokens**2
    return parameters, activations, forward
