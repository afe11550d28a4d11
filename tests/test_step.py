"""The replica step's own guarantees: a skipped step changes no state, finiteness is decided on the
unclipped gradients element by element, and dropout masks differ across replicas but not across resumes."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tasks import classification
from tests import helpers


def _batch(trainer, scale=1.0):
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    return {**batch, "image": batch["image"] * scale}


@pytest.mark.slow
def test_skipped_step_keeps_batch_norm_statistics(data_dir, mirrored):
    # float16 ResNet on two replicas, a NaN in replica 1's input: the synchronized statistics would carry
    # the NaN to both replicas if the forward pass assigned them before the finite mask.
    config = helpers.make_config(data_dir, model="resnet", **helpers.NONFINITE_CASE)
    before, after_bad, after_good, bad_out, _ = helpers.nonfinite_scenario(config, mirrored, bad_replica=1)
    assert not bad_out["finite"]
    states = [k for k in before if k.startswith("state/")]
    assert len(states) == 18  # 9 synchronized batch norms x (mean, variance) in ResNet-8
    for k in states:
        for replica in (0, 1):
            np.testing.assert_array_equal(after_bad[k][replica], before[k][replica], err_msg=k)
            assert np.isfinite(after_good[k][replica]).all(), k
    assert any(not np.array_equal(after_good[k][0], before[k][0]) for k in states)  # finite steps still update


def test_checkpoint_refuses_non_finite_statistics(data_dir, one_device, tmp_path):
    from engine.run import build
    from engine.state.checkpoint import CheckpointError, Checkpoints

    trainer = build.run(helpers.make_config(data_dir, model="resnet"), one_device)
    moving = [v for v in trainer.model.non_trainable_variables if "moving_variance" in v.path][0]
    moving.assign(tf.fill(moving.shape, float("nan")))
    with pytest.raises(CheckpointError, match="moving_variance"):
        Checkpoints(trainer.state, str(tmp_path), keep=1).save()


def _process(grads, scale=None, **config):
    from engine.numerics import forward as step

    settings = helpers.make_config("unused", **config)
    out, norm, finite = step.process_gradients([tf.constant(g, tf.float32) for g in grads], scale, settings)
    return [g.numpy() for g in out], float(norm), bool(finite)


def test_clip_value_does_not_hide_an_infinite_gradient():
    _, _, finite = _process([[float("inf"), 0.5], [0.25]], clip_value=1.0)
    assert not finite  # clipping first would have turned inf into 1.0 and applied the step
    grads, norm, finite = _process([[3.0, -0.5], [0.25]], clip_value=1.0)
    assert finite and grads[0].tolist() == [1.0, -0.5] and norm == pytest.approx((1 + 0.25 + 0.0625) ** 0.5)


def test_float16_gradients_are_unscaled_before_clipping():
    grads, norm, finite = _process([[0.3 * 1024, 0.4 * 1024]], scale=tf.constant(1024.0), clip_norm=1.0)
    assert finite and norm == pytest.approx(0.5)  # the true norm, under the clip: nothing clipped
    np.testing.assert_allclose(grads[0], [0.3, 0.4], rtol=1e-6)
    grads, norm, _ = _process([[3.0 * 1024, 4.0 * 1024]], scale=tf.constant(1024.0), clip_norm=1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(grads[0], [0.6, 0.8], rtol=1e-6)


def test_finite_gradients_whose_squares_overflow_are_finite():
    grads, norm, finite = _process([[3e20, 4e20], [0.0]], clip_norm=1.0)
    assert finite and norm == pytest.approx(5e20, rel=1e-6)
    np.testing.assert_allclose(grads[0], [0.6, 0.8], rtol=1e-6)
    assert not _process([[3e20, float("nan")]])[2]
    assert not _process([[float("-inf"), 1.0]])[2]
    assert _process([[0.0, 0.0]])[1:] == (0.0, True)


def test_huge_finite_gradient_is_applied_with_its_true_norm(data_dir, one_device):
    from engine.run import build

    # Inputs of 1e20 give gradient elements near 1e20: each squares to about 1e40, and their float32 sum
    # overflows although every element is finite.
    config = helpers.make_config(
        data_dir, optimizer="sgd", momentum=0.0, learning_rate=0.1, clip_norm=1.0, **helpers.XLA_CASE
    )
    trainer = build.run(config, one_device)
    batch = _batch(trainer, scale=1e20)
    images, labels = batch["image"], batch["label"]
    params = [v.value for v in trainer.model.trainable_variables]
    with tf.GradientTape() as tape:
        logits = trainer.model(images, training=True)
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)) / 64
    grads = [g.numpy().astype(np.float64) for g in tape.gradient(loss, params)]
    expected = np.sqrt(sum(float((g**2).sum()) for g in grads))
    assert np.isfinite(expected) and expected > 1e19  # the case this test is about
    assert not np.isfinite(np.float32(sum(float((g**2).sum()) for g in grads)))
    before = [p.numpy() for p in params]
    out = helpers.one_step(trainer, batch)
    assert out["finite"]
    np.testing.assert_allclose(out["grad_norm"], expected, rtol=1e-5)
    assert trainer.plans[0].optimizer.iterations.numpy() == 1
    assert any(not np.array_equal(p.numpy(), b) for p, b in zip(params, before))


def test_dropout_masks_differ_across_replicas(data_dir, mirrored):
    from engine.numerics import forward as step
    from engine.run import build

    trainer = build.run(helpers.make_config(data_dir, model="transformer", dropout=0.5), mirrored)
    state, seeds = step.split_statistics(trainer.models)
    assert seeds and not state
    images = _batch(trainer)["image"][:8]  # the same batch on both replicas

    @tf.function
    def forward(at_step):
        def replica_fn():
            replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
            return step.stateless_forward(
                trainer.task, trainer.models, {"image": images}, state, [], seeds, at_step, replica
            )[0]

        return mirrored.experimental_local_results(mirrored.run(replica_fn))

    first, second = [o.numpy() for o in forward(tf.constant(7, tf.int64))]
    assert not np.allclose(first, second)
    again = [o.numpy() for o in forward(tf.constant(7, tf.int64))]
    np.testing.assert_array_equal(again[0], first)  # a function of (seed, step, replica) only
    np.testing.assert_array_equal(again[1], second)
    later = forward(tf.constant(8, tf.int64))[0].numpy()
    assert not np.allclose(later, first)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_step_draws_each_replicas_dropout_from_its_id(data_dir, mirrored, accumulate):
    from engine.numerics import forward as step
    from engine.run import build

    settings = dict(model="mlp", dropout=0.5, grad_accum_steps=accumulate, jit_compile="false")
    trainer = build.run(helpers.make_config(data_dir, **settings), mirrored)
    trainer.state.step.assign(7)
    state, seeds = step.split_statistics(trainer.models)
    assert seeds and not state
    batch = _batch(trainer)
    size = len(batch["label"]) // (2 * accumulate)  # a microbatch

    def loss(replica, draws_as):
        """The replica's part of the step's loss, its microbatch k's masks drawn as replica `draws_as`'s."""
        total = 0.0
        for k in range(accumulate):
            start = (replica * accumulate + k) * size
            part = {name: t[start : start + size] for name, t in batch.items()}
            seed = tf.constant(draws_as * accumulate + k, tf.int64)
            outputs = step.stateless_forward(
                trainer.task, trainer.models, part, state, [], seeds, trainer.state.step, seed
            )
            total += float(tf.reduce_sum(trainer.task.loss(outputs[0], part))) / len(batch["label"])
        return total

    want = loss(0, 0) + loss(1, 1)
    assert abs(loss(1, 0) - loss(1, 1)) > 1e-3  # replica 1 drawing replica 0's masks would show
    halves = mirrored.experimental_distribute_values_from_function(
        lambda ctx: {
            k: v[ctx.replica_id_in_sync_group * 32 : (ctx.replica_id_in_sync_group + 1) * 32] for k, v in batch.items()
        }
    )
    out = helpers.one_step(trainer, halves)
    assert float(out["loss"]) == pytest.approx(want, rel=1e-6)


class Normalized(keras.Model):
    """A hidden layer, Keras's own batch norm, a head."""

    def __init__(self, outputs):
        super().__init__(name="normalized")
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(8, name="hidden")
        self.norm = keras.layers.BatchNormalization(momentum=0.5, name="norm")
        self.head = keras.layers.Dense(outputs, name="head")

    def call(self, inputs, training=False):
        return self.head(tf.nn.relu(self.norm(self.hidden(self.flatten(inputs)), training=training)))


class NormalizedTask(classification.Task):
    def models(self, create):
        model = Normalized(self.outputs)
        model(tf.zeros((1, *self.spec["image"].shape)), training=False)
        return {"model": model}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_grad_accumulation_is_ghost_batch_norm(data_dir, one_device, monkeypatch, capsys, accumulate):
    from engine.data import datasets as data_lib
    from engine.run import build

    monkeypatch.setattr(data_lib, "task_class", lambda config: NormalizedTask)
    capsys.readouterr()
    trainer = build.run(helpers.make_config(data_dir, grad_accum_steps=accumulate, jit_compile="false"), one_device)
    warning = (
        "warning: --grad_accum_steps=2: each of the 2 microbatches runs its own forward pass, which updates "
        "model/normalized/norm/moving_mean and 1 more: batch norm normalizes each microbatch with its own statistics "
        "and moves its moving averages once per microbatch (ghost batch norm), so a step is not the whole batch's "
        "update\n"
    )
    assert capsys.readouterr().out == (warning if accumulate == 2 else "")
    batch = _batch(trainer)
    model = trainer.model
    kernel, bias, head_kernel, head_bias = [
        v.numpy().astype(np.float64) for v in trainer.weights.variables[:2] + trainer.weights.variables[4:]
    ]
    assert [v.path for v in trainer.weights.variables] == [
        "normalized/hidden/kernel",
        "normalized/hidden/bias",
        "normalized/norm/gamma",
        "normalized/norm/beta",
        "normalized/head/kernel",
        "normalized/head/bias",
    ]
    hidden = batch["image"].numpy().reshape(64, -1).astype(np.float64) @ kernel + bias
    labels = batch["label"].numpy()

    def ghost(parts):
        """(loss, moving mean, moving variance) with each of `parts` microbatches normalized by its own statistics
        and the averages moved once per microbatch, in order (gamma 1, beta 0, epsilon 1e-3: the initial layer)."""
        loss, mean, variance = 0.0, np.zeros(8), np.ones(8)
        for z, y in zip(np.split(hidden, parts), np.split(labels, parts)):
            logits = np.maximum((z - z.mean(0)) / np.sqrt(z.var(0) + 1e-3), 0.0) @ head_kernel + head_bias
            logits -= logits.max(1, keepdims=True)
            loss -= float(np.sum(logits[np.arange(len(y)), y] - np.log(np.exp(logits).sum(1)))) / 64
            mean, variance = 0.5 * mean + 0.5 * z.mean(0), 0.5 * variance + 0.5 * z.var(0)
        return loss, mean, variance

    want, whole = ghost(accumulate), ghost(1)
    assert abs(ghost(2)[0] - whole[0]) > 1e-3  # the two are told apart
    out = helpers.one_step(trainer, batch)
    assert float(out["loss"]) == pytest.approx(want[0], rel=1e-5)
    np.testing.assert_allclose(model.norm.moving_mean.numpy(), want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norm.moving_variance.numpy(), want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dropout_run_resumes_bit_exactly(data_dir, one_device, tmp_path):
    from engine.run import loop

    # The smallest transformer that has dropout in attention and MLP: what resumes is the dropout's stream.
    small = dict(transformer_layers=1, transformer_dim=16, transformer_heads=2, transformer_mlp_dim=32)
    settings = dict(
        **helpers.XLA_CASE, model="transformer", dropout=0.2, deterministic=True, checkpoint_every=10, eval_every=0
    )
    settings.update(small)
    straight = helpers.make_config(data_dir, workdir=str(tmp_path / "straight"), train_steps=20, **settings)
    loop.train(straight, one_device)
    resumed = dict(settings, workdir=str(tmp_path / "resumed"))
    loop.train(helpers.make_config(data_dir, train_steps=10, **resumed), one_device)
    loop.train(helpers.make_config(data_dir, train_steps=20, **resumed), one_device)
    _, want = helpers.checkpoint_tensors(str(tmp_path / "straight"))
    _, got = helpers.checkpoint_tensors(str(tmp_path / "resumed"))
    assert want.keys() == got.keys()
    for k in (k for k in want if k.endswith("VARIABLE_VALUE")):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
