"""The replica step's own guarantees: a skipped step changes no state, finiteness is decided on the
unclipped gradients element by element, and dropout masks differ across replicas but not across resumes."""

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers


def _batch(trainer, scale=1.0):
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    return {**batch, "image": batch["image"] * scale}


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
    from engine.checkpoint import CheckpointError, Checkpoints
    from engine.loop import Trainer

    trainer = Trainer(helpers.make_config(data_dir, model="resnet"), one_device)
    moving = [v for v in trainer.model.non_trainable_variables if "moving_variance" in v.path][0]
    moving.assign(tf.fill(moving.shape, float("nan")))
    with pytest.raises(CheckpointError, match="moving_variance"):
        Checkpoints(trainer, str(tmp_path), keep=1).save()


def _process(grads, scale=None, **config):
    from engine import step

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
    from engine.loop import Trainer

    # Inputs of 1e20 give gradient elements near 1e20: each squares to about 1e40, and their float32 sum
    # overflows although every element is finite.
    config = helpers.make_config(data_dir, optimizer="sgd", momentum=0.0, learning_rate=0.1, clip_norm=1.0)
    trainer = Trainer(config, one_device)
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
    assert trainer.optimizer.iterations.numpy() == 1
    assert any(not np.array_equal(p.numpy(), b) for p, b in zip(params, before))


def test_dropout_masks_differ_across_replicas(data_dir, mirrored):
    from engine import step
    from engine.loop import Trainer

    trainer = Trainer(helpers.make_config(data_dir, model="transformer", dropout=0.5), mirrored)
    state, seeds = step.split_state(trainer.models)
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


@pytest.mark.slow
def test_dropout_run_resumes_bit_exactly(data_dir, one_device, tmp_path):
    from engine import loop

    settings = dict(model="transformer", dropout=0.2, deterministic=True, checkpoint_every=10, eval_every=0)
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
