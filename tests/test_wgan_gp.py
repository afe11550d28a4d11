"""The WGAN-GP (tasks/wgan_gp.py), a researcher's own step written as updates of the public API alone: its critic's
update --wgan_critic_steps times on fresh batches, with a gradient penalty taken by a nested tape, then the
generator's, checked against a plain TensorFlow loop of the paper's math with Keras's Adam; the same numbers on one
device and two mirrored replicas; a killed run resumed bit for bit, its data position counting every batch read.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import helpers  # noqa: E402

STEPS = 10
# Tiny networks; a learning rate at which 10 steps move every weight far past the agreement asked for. Without XLA:
# compiling the step (six updates' passes, the penalty's differentiated twice) costs more than its 10 steps.
CASE = dict(
    task="wgan_gp",
    hidden_sizes=(16,),
    wgan_latent=8,
    learning_rate=1e-3,
    train_steps=STEPS,
    steps_per_loop=STEPS,
    jit_compile="false",
)
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def one_device_run(data_dir, one_device):
    return helpers.train_and_snapshot_updates(helpers.make_config(data_dir, **CASE), one_device)


# ---- The reference: WGAN-GP's math as a plain TensorFlow loop -------------------------------------------------


def reference_run(initial, config, steps):
    """The networks' weights after `steps` steps of Algorithm 1 of Gulrajani et al. (2017) from `initial`: per step,
    --wgan_critic_steps critic updates, repetition r of step s on batch s * repeat + r of the run's training stream,
    then one generator update on the step's first batch; z and eps drawn per example as the task says (tasks/base.py).
    Returns ({model: [weights]}, {model: update count})."""
    from engine.api import training_batches
    from tasks import base, gan, wgan_gp

    repeat, lam, seed, latent = config.wgan_critic_steps, config.wgan_penalty, config.seed, config.wgan_latent
    weights = {name: [tf.Variable(w) for w in values] for name, values in initial.items()}
    pairs = {name: list(zip(ws[::2], ws[1::2])) for name, ws in weights.items()}
    adams = {
        name: keras.optimizers.Adam(config.learning_rate, beta_1=0.5, beta_2=0.9, epsilon=config.epsilon)
        for name in weights
    }
    stream = training_batches(config)
    batches = [next(stream) for _ in range(steps * repeat)]

    def generate(z):  # flattened images
        return helpers.leaky_mlp(pairs["generator"], z, tf.sigmoid)

    def critic(x):
        return helpers.leaky_mlp(pairs["critic"], x, lambda y: y)[:, 0]

    def z(index, role, r):
        return base.example_normals(base.example_keys(seed, index, role, r), latent)

    def critic_loss(batch, r):
        real = tf.reshape(batch["image"], [len(batch["index"]), -1])
        fake = generate(z(batch["index"], gan.CRITIC, r))
        eps = base.example_uniforms(base.example_keys(seed, batch["index"], wgan_gp.INTERPOLATION, r), 1)
        x_hat = eps * real + (1.0 - eps) * fake
        with tf.GradientTape() as inner:
            inner.watch(x_hat)
            score = critic(x_hat)
        slope = tf.norm(inner.gradient(score, x_hat), axis=1)
        return critic(fake) - critic(real) + lam * (slope - 1.0) ** 2

    def update(name, loss):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss()) / config.global_batch_size
        adams[name].apply(tape.gradient(total, weights[name]), weights[name])

    for s in range(steps):
        for r in range(repeat):
            update("critic", lambda: critic_loss(batches[s * repeat + r], r))
        first = batches[s * repeat]
        update("generator", lambda: -critic(generate(z(first["index"], gan.GENERATOR, 0))))
    counts = {name: int(adam.iterations.numpy()) for name, adam in adams.items()}
    return {name: [w.numpy() for w in ws] for name, ws in weights.items()}, counts


def test_matches_a_plain_tensorflow_loop_of_its_math(one_device_run):
    _, _, trainer, initial = one_device_run
    repeat = trainer.config.wgan_critic_steps
    assert repeat == 5  # the paper's n_critic, the default
    expected, counts = reference_run(initial, trainer.config, STEPS)
    worst, moves = 0.0, {}
    for name, model in trainer.models.items():
        for variable, want, start in zip(model.trainable_variables, expected[name], initial[name]):
            worst = max(worst, float(np.max(np.abs(variable.numpy() - want))))
            moves[f"{name}/{variable.path}"] = float(np.max(np.abs(want - start)))
    # The critic's output bias adds alike to D(x) and D(G(z)) and not at all to the gradient through the input: no
    # loss of the critic's sees it, and it stays where it began, in both.
    unmoved = moves.pop("critic/critic/score/bias")
    least = min(moves.values())
    print(f"WGAN-GP vs its plain loop after {STEPS} steps: max |difference| {worst:.2e}; least move {least:.2e}")
    assert worst < TOLERANCE
    assert least > 1000 * TOLERANCE and unmoved == 0.0  # every other weight array moved: none compared untouched
    iterations = {plan.name: int(plan.optimizer.iterations.numpy()) for plan in trainer.plans}
    assert iterations == {"critic": repeat * STEPS, "generator": STEPS}
    assert counts == {"critic": repeat * STEPS, "generator": STEPS}
    assert int(trainer.state.batches.numpy()) == repeat * STEPS  # the data position counts every batch read


def test_mirrored_matches_one_device(data_dir, mirrored, one_device_run):
    snap, _, trainer, _ = helpers.train_and_snapshot_updates(helpers.make_config(data_dir, **CASE), mirrored)
    for name, copies in snap.items():  # the two replicas hold identical values
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)
    reference, _, reference_trainer, _ = one_device_run
    assert snap.keys() == reference.keys()
    differences = {k: float(np.max(np.abs(snap[k][0] - reference[k][0]))) for k in snap}
    worst = max(differences, key=differences.get)
    difference = differences[worst]
    paths = {f"{name}/{v.path}" for name, model in trainer.models.items() for v in model.variables}
    weights = max(differences[k] for k in paths)
    print(
        f"WGAN-GP mirrored vs one device after {STEPS} steps: max |difference| {weights:.2e} in the weights, "
        f"{difference:.2e} with the slots ({worst})"
    )
    assert difference < TOLERANCE
    assert snap["critic/iterations"][0] == 5 * STEPS and snap["generator/iterations"][0] == STEPS
    results, reference_results = trainer.evaluator.evaluate(), reference_trainer.evaluator.evaluate()
    assert results["examples"] == reference_results["examples"] == 360
    for name in ("frechet_distance", "wasserstein", "critic_loss", "gradient_norm"):  # evaluation's z and eps too
        assert results[name] == pytest.approx(reference_results[name], rel=1e-5, abs=1e-6), name


# ---- Killed and resumed --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_and_restart_equals_uninterrupted(data_dir, tmp_path, capsys):
    settings = dict(
        data_dir=data_dir,
        task="wgan_gp",
        deterministic=True,
        hidden_sizes=(64, 64),
        learning_rate=1e-3,
        global_batch_size=64,
        train_steps=400,
        steps_per_loop=10,
        checkpoint_every=50,
        jit_compile=False,  # launch.py and this process would each compile the step for longer than they train
    )
    returncode, stopped, resumed, straight, killed = helpers.straight_and_killed(tmp_path, settings, 80, capsys, 120)
    assert returncode == -9 and 80 <= stopped < 400, stopped  # killed mid-run, after a checkpoint
    assert 50 <= resumed <= stopped < 400
    (path_a, a), (path_b, b) = helpers.checkpoint_tensors(straight), helpers.checkpoint_tensors(killed)
    assert path_a.endswith("ckpt-400") and path_b.endswith("ckpt-400") and a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert a["batches/.ATTRIBUTES/VARIABLE_VALUE"] == 5 * 400  # five fresh batches a step
    assert a["optimizers/critic/iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 5 * 400
    assert a["optimizers/generator/iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 400
    summaries = [json.load(open(d / "summary.json")) for d in (straight, killed)]
    assert summaries[0]["eval"] == summaries[1]["eval"]


def test_dropout_and_another_model_are_refused(data_dir):
    from engine.api import ConfigError
    from tasks import wgan_gp

    with pytest.raises(ConfigError, match=r"^--dropout=0.1: --task=wgan_gp's gradient penalty"):
        wgan_gp.Task(helpers.make_config(data_dir, task="wgan_gp", dropout=0.1), {}, {})
    with pytest.raises(ConfigError, match=r"^--model=resnet: --task=wgan_gp builds its own generator and critic"):
        wgan_gp.Task(helpers.make_config(data_dir, task="wgan_gp", model="resnet"), {}, {})
