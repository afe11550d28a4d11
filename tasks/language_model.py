"""Language modelling: predict every next token of a window of text (nanoGPT's one loss line).

A batch holds `tokens`, windows of --sequence_length + 1 token ids: the model reads the first T and is scored
on the last T, each position predicting the token after it. The loss is the mean next-token cross-entropy over
a window's positions (nats per token; a character-level source makes it nats per character). Evaluation
windows may be partly padding: their `weight` says how many of their targets are real (the first ones), so
the reported means are per token over the evaluation text. --mode=sample generates text (`sample`).
"""

import numpy as np
import tensorflow as tf

from engine.api import ConfigError
from tasks import base

DATASET = "shakespeare"  # the default --dataset
MODEL = "gpt"  # the default --model: a causal decoder, one prediction per position
SETTINGS = {
    "sequence_length": (64, "tokens of context per example"),
    # --mode=sample: how a trained run's text is drawn (the run's identity is its training, not these).
    # At most a million: each token's distribution is drawn in memory (a hundred billion asked for 373 GiB).
    "sample_length": (500, "--mode=sample: how many tokens (characters) to generate", (1, 1_000_000)),
    "sample_prompt": ("\n", "--mode=sample: the text the generated text continues"),
    # Bounded where float32 logits divided by it stay finite (divided by 1e-45 they overflowed, and became NaN).
    "sample_temperature": (
        0.8,
        "--mode=sample: divides the logits before sampling; lower is more conservative",
        (1e-6, 1e6),
    ),
    "sample_top_k": (0, "--mode=sample: draw from the k likeliest tokens only; 0 = from all", (0, 2_147_483_647)),
}


class Task(base.Task):
    features = ("tokens",)
    input = "tokens"
    objective = ("loss", "min")
    headline = "loss"
    ensemble = None  # averaging next-token distributions of separately trained members is not offered

    @property
    def outputs(self):
        return len(self.info["vocabulary"])

    @property
    def class_names(self):
        """What each logit means: the vocabulary's characters, in token order (an export holds them)."""
        return tuple(self.info["vocabulary"])

    def prepare(self, batch):
        base.read_as_numbers(self, batch, ("tokens",))
        return {"tokens": tf.cast(batch["tokens"], tf.int32)}

    def models(self, create):
        context = tf.TensorSpec([self.spec["tokens"].shape[0] - 1], tf.int32)
        model = create(self.config.model, context, self.outputs)
        shape = base.one_tensor(self, model, context).shape
        if shape.rank != 3:  # one prediction per window, not per position: the loss's shapes would not meet
            raise ConfigError(
                f"--model={self.config.model}: its output for a window of {context.shape[0]} tokens is of shape "
                f"{tuple(shape)}; --task=language_model predicts at every position, [1, {context.shape[0]}, "
                f"{self.outputs}] (a model of one prediction per token: --model=gpt)"
            )
        return {"model": model}

    def forward(self, models, batch, training):
        return models["model"](batch["tokens"][:, :-1], training=training)

    def _losses(self, outputs, batch):
        """[batch, T] next-token cross-entropies, float32."""
        targets = batch["tokens"][:, 1:]
        return tf.nn.sparse_softmax_cross_entropy_with_logits(targets, tf.cast(outputs, tf.float32))

    def loss(self, outputs, batch):
        return tf.reduce_mean(self._losses(outputs, batch), axis=-1)

    def target_weights(self, batch):
        """[batch, T] float32: 1 where a window's target is real, 0 where it is padding."""
        # A source that pads its last window says so (info["weight_counts_targets"]): a window's weight then counts
        # its real targets, the first ones. Otherwise every target of a window is real and its weight is 1 or 0.
        positions = tf.range(batch["tokens"].shape[1] - 1, dtype=tf.float32)[None, :]
        if self.info.get("weight_counts_targets"):
            return tf.cast(positions < batch["weight"][:, None], tf.float32)
        return tf.ones_like(positions) * tf.cast(batch["weight"][:, None] > 0, tf.float32)

    def metrics(self, outputs, batch):
        logits = tf.cast(outputs, tf.float32)
        correct = tf.cast(
            tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), batch["tokens"][:, 1:]), tf.float32
        )
        real = self.target_weights(batch)
        count = tf.reduce_sum(real, axis=-1)
        return {
            "loss": tf.math.divide_no_nan(tf.reduce_sum(real * self._losses(logits, batch), axis=-1), count),
            "accuracy": tf.math.divide_no_nan(tf.reduce_sum(real * correct, axis=-1), count),
        }

    def report(self, means):
        return {**means, "bits_per_character": base.bits(means["loss"])}

    def serve(self, models):
        window = self.spec["tokens"].shape[0] - 1
        vocabulary = self.outputs

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="tokens")])
        def serve(tokens):
            # The logits of the character after the prompts (at least one token each; their last `window` tokens
            # are the context): a shorter context is padded after its end, which causal attention does not see.
            # Refused, not answered: no token (the logits would be those after a window of padding), and an id
            # outside the vocabulary (the embedding reads -1 as the last character's row, and a GPU reads ids past
            # the vocabulary as zeros; on a CPU they ended in a graph error naming a gather node).
            checks = [
                tf.debugging.Assert(
                    tf.shape(tokens)[1] > 0,
                    ["tokens: every prompt needs at least one token; got shape", tf.shape(tokens)],
                ),
                tf.debugging.Assert(
                    tf.reduce_all((tokens >= 0) & (tokens < vocabulary)),
                    [
                        f"tokens: ids must be in [0, {vocabulary}) (the vocabulary); got min and max",
                        tf.reduce_min(tokens),
                        tf.reduce_max(tokens),
                    ],
                ),
            ]
            with tf.control_dependencies(checks):
                tokens = tf.identity(tokens)
            context = tokens[:, -window:]
            n = tf.shape(context)[1]
            padded = tf.pad(context, [[0, 0], [0, window - n]])
            return {"logits": tf.cast(models["model"](padded, training=False)[:, n - 1], tf.float32)}

        return serve

    def sample(self, models, config):
        """config.sample_length tokens continuing config.sample_prompt, drawn at config.sample_temperature from
        the config.sample_top_k likeliest (all when 0), seeded by config.seed; the context is the last
        --sequence_length tokens. Returns the prompt and the generated text."""
        chars = self.info["vocabulary"]
        prompt = config.sample_prompt
        unknown = sorted(set(prompt) - set(chars))
        if unknown:
            raise ConfigError(
                f"--sample_prompt={prompt!r}: characters not in the vocabulary: {' '.join(repr(c) for c in unknown)}"
            )
        if not prompt:
            raise ConfigError("--sample_prompt='': needs at least one character to continue")
        index = {c: i for i, c in enumerate(chars)}
        window = self.spec["tokens"].shape[0] - 1
        model = models["model"]
        length = config.sample_length
        # Prompt and generated text in one buffer, at least a window long so every window slice is in range.
        buffer = np.zeros(max(len(prompt) + length, window), np.int32)
        buffer[: len(prompt)] = [index[c] for c in prompt]
        top_k = min(config.sample_top_k, len(chars)) if config.sample_top_k else 0

        @tf.function
        def generate(buffer):
            def step(i, buffer):
                end = len(prompt) + i  # tokens so far; the next goes here
                start = tf.maximum(end - window, 0)
                # Causal attention: padding after the context does not change the logits at its last position.
                context = buffer[start : start + window][None, :]
                logits = model(context, training=False)[0, end - start - 1] / config.sample_temperature
                if top_k:
                    logits = tf.where(logits < tf.math.top_k(logits, top_k).values[-1], -np.inf, logits)
                seed = tf.stack([tf.constant(config.seed, tf.int64), tf.cast(i, tf.int64)])
                token = tf.random.stateless_categorical(logits[None, :], 1, seed, dtype=tf.int32)[0, 0]
                return i + 1, tf.tensor_scatter_nd_update(buffer, [[end]], [token])

            return tf.while_loop(lambda i, _: i < length, step, (tf.constant(0), buffer))[1]

        tokens = generate(tf.constant(buffer)).numpy()[: len(prompt) + length]
        return "".join(chars[t] for t in tokens)
