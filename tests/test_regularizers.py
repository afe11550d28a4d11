"""Keras model losses reach the step's loss once per step, whatever the replica count, the microbatching, the
precision and XLA: kernel_regularizer, bias_regularizer, activity_regularizer and self.add_loss(...) in a
subclassed model's call. Each case is checked against a plain one-device TensorFlow computation of the same loss
on the whole global batch, the penalties written out by hand: its loss, gradient norm and SGD update."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from engine.data import datasets as data_lib
from engine.run import build
from tasks import classification
from tests import helpers

# Each penalty's strength: large enough that every penalty is above MIN_PENALTY, so a step that drops any one of
# them (or counts it once per replica or microbatch) misses the reference by far more than float16 rounding.
KERNEL, BIAS, ACTIVITY, ADDED = 1e-2, 1e-2, 3e-2, 0.5
MIN_PENALTY = 0.1
LEARNING_RATE = 0.1
WIDTH = 16


class Regularized(keras.Model):
    """One hidden layer carrying every kind of Keras model loss, and a head."""

    def __init__(self, outputs):
        super().__init__(name="regularized")
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(
            WIDTH,
            activation="tanh",
            kernel_regularizer=keras.regularizers.L2(KERNEL),
            bias_regularizer=keras.regularizers.L2(BIAS),
            activity_regularizer=keras.regularizers.L2(ACTIVITY),
            bias_initializer=keras.initializers.RandomNormal(0.0, 1.0, seed=1),  # a bias of zeros has no penalty
            name="hidden",
        )
        self.head = keras.layers.Dense(outputs, name="head")

    def call(self, inputs, training=False):
        hidden = self.hidden(self.flatten(inputs))
        self.add_loss(ADDED * tf.reduce_mean(tf.square(tf.cast(hidden, tf.float32))))
        return self.head(hidden)


class RegularizedTask(classification.Task):
    def models(self, create):
        model = Regularized(self.outputs)
        model(tf.zeros((1, *self.spec["image"].shape)), training=False)
        return {"model": model}


def reference(weights, images, labels):
    """(loss, gradients, penalties) of the model's math on one device, the whole batch at once, in float32."""
    kernel, bias, head_kernel, head_bias = [tf.constant(w, tf.float32) for w in weights]
    with tf.GradientTape() as tape:
        tape.watch([kernel, bias, head_kernel, head_bias])
        hidden = tf.tanh(tf.reshape(images, [len(images), -1]) @ kernel + bias)
        logits = hidden @ head_kernel + head_bias
        cross_entropy = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        penalties = {
            "kernel": KERNEL * tf.reduce_sum(tf.square(kernel)),
            "bias": BIAS * tf.reduce_sum(tf.square(bias)),
            # Keras divides an activity penalty by the batch it saw: here, the whole batch.
            "activity": ACTIVITY * tf.reduce_sum(tf.square(hidden)) / len(images),
            "added": ADDED * tf.reduce_mean(tf.square(hidden)),
        }
        loss = cross_entropy + tf.add_n(list(penalties.values()))
    grads = tape.gradient(loss, [kernel, bias, head_kernel, head_bias])
    return float(loss), [g.numpy() for g in grads], {k: float(v) for k, v in penalties.items()}


def distributed(strategy, batch):
    """The global batch split across the replicas in order, as the input pipeline gives it."""
    size = len(batch["label"]) // strategy.num_replicas_in_sync

    def part(ctx):
        start = ctx.replica_id_in_sync_group * size
        return {k: v[start : start + size] for k, v in batch.items()}

    return strategy.experimental_distribute_values_from_function(part)


# (loss, gradient norm) relative and the weights' absolute tolerance against the float32 reference, by precision:
# float16 computes the forward pass in half precision (measured: 4e-5 of the loss, 7e-6 of a weight).
TOLERANCES = {"float32": (1e-6, 1e-5, 1e-6), "mixed_float16": (1e-3, 1e-3, 1e-4)}

# (strategy, --grad_accum_steps, --precision, --jit_compile)
CASES = [
    ("one_device", 1, "float32", "false"),
    ("mirrored", 1, "float32", "false"),
    ("mirrored", 2, "float32", "false"),
    ("one_device", 2, "float32", "true"),
    ("mirrored", 2, "mixed_float16", "false"),
    ("one_device", 1, "mixed_float16", "true"),
]


def one_step(data_dir, monkeypatch, strategy, **settings):
    """(variables, their values before, the step's outputs, the reference's (loss, gradients, penalties)) of one
    plain SGD step of the regularized model with `settings`, on the first training batch."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: RegularizedTask)
    config = helpers.make_config(data_dir, optimizer="sgd", momentum=0.0, learning_rate=LEARNING_RATE, **settings)
    trainer = build.run(config, strategy)
    assert trainer.program.jit_compile == (config.jit_compile == "true")
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    assert len(batch["label"]) == config.global_batch_size
    variables = trainer.model.trainable_variables
    assert [v.path for v in variables] == [
        "regularized/hidden/kernel",
        "regularized/hidden/bias",
        "regularized/head/kernel",
        "regularized/head/bias",
    ]
    before = [v.numpy() for v in variables]
    want = reference(before, batch["image"], batch["label"])
    assert min(want[2].values()) > MIN_PENALTY, want[2]  # dropping any one would show
    return variables, before, helpers.one_step(trainer, distributed(strategy, batch)), want


@pytest.mark.slow
@pytest.mark.parametrize("strategy,accumulate,precision,jit", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_model_losses_count_once_per_step(data_dir, monkeypatch, request, strategy, accumulate, precision, jit):
    strategy = request.getfixturevalue(strategy)
    variables, before, out, (want_loss, want_grads, _) = one_step(
        data_dir, monkeypatch, strategy, grad_accum_steps=accumulate, precision=precision, jit_compile=jit
    )
    loss_tolerance, norm_tolerance, weight_tolerance = TOLERANCES[precision]
    assert out["finite"]
    assert float(out["loss"]) == pytest.approx(want_loss, rel=loss_tolerance)
    want_norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in want_grads))
    assert float(out["grad_norm"]) == pytest.approx(want_norm, rel=norm_tolerance)
    for v, old, grad in zip(variables, before, want_grads):
        for copy in helpers.local_values(strategy, v):  # every replica applied the same update
            np.testing.assert_allclose(copy, old - LEARNING_RATE * grad, rtol=0, atol=weight_tolerance, err_msg=v.path)


def test_a_frozen_variables_penalty_is_left_out(data_dir, monkeypatch, one_device):
    # --freeze is the engine's trainable=False, whose weights' penalties Keras leaves out of a model's losses: a
    # constant that would only shift the logged loss.
    variables, before, out, (want_loss, want_grads, penalties) = one_step(
        data_dir, monkeypatch, one_device, freeze="hidden/kernel", jit_compile="false"
    )
    assert float(out["loss"]) == pytest.approx(want_loss - penalties["kernel"], rel=1e-6)
    np.testing.assert_array_equal(variables[0].numpy(), before[0])
    for v, old, grad in zip(variables[1:], before[1:], want_grads[1:]):  # the other penalties still reach them
        np.testing.assert_allclose(v.numpy(), old - LEARNING_RATE * grad, rtol=0, atol=1e-6, err_msg=v.path)
