"""The GAN (tasks/gan.py): two updates of one step (the critic's, --gan_critic_steps times, then the generator's),
each with its own Adam, checked against a plain TensorFlow loop of the same math; the same numbers on one device,
two mirrored replicas and two worker processes; a killed run resumed bit for bit; the recipe's claim, what a run
reports and writes, and the exported generator.

Also the worker of the multi-worker run: TF_CONFIG=... python tests/test_gan.py OUT_DIR DATA_DIR
"""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import helpers  # noqa: E402

TOLERANCE = 1e-5
# Tiny networks; a learning rate high enough that 20 steps move every weight well past the tolerance.
# Without XLA: compiling the three passes' step costs more than the 20 steps (the kill test runs it with XLA).
CASE = dict(
    task="gan",
    hidden_sizes=(16,),
    gan_latent=8,
    gan_critic_steps=2,
    learning_rate=3e-3,
    steps_per_loop=20,
    jit_compile="false",
)


def first_copies(snap):
    return {k: v[0] for k, v in snap.items()}


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)))) for k in a)


@pytest.fixture(scope="module")
def one_device_run(data_dir, one_device):
    return helpers.train_and_snapshot_updates(helpers.make_config(data_dir, **CASE), one_device)


# ---- The reference: the GAN's math as a plain TensorFlow loop --------------------------------------------------


class Adam:
    """Adam as Kingma and Ba write it with Keras's epsilon placement: the step lr * sqrt(1 - b2^t) / (1 - b1^t)
    times m / (sqrt(v) + eps)."""

    def __init__(self, variables, lr, beta_1=0.5, beta_2=0.999, epsilon=1e-7):
        self.variables, self.lr, self.b1, self.b2, self.eps = variables, lr, beta_1, beta_2, epsilon
        self.m = [tf.Variable(tf.zeros_like(v)) for v in variables]
        self.v = [tf.Variable(tf.zeros_like(v)) for v in variables]
        self.t = 0

    def apply(self, grads):
        self.t += 1
        alpha = self.lr * np.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t)
        for p, g, m, v in zip(self.variables, grads, self.m, self.v):
            m.assign(self.b1 * m + (1 - self.b1) * g)
            v.assign(self.b2 * v + (1 - self.b2) * tf.square(g))
            p.assign_sub(alpha * m / (tf.sqrt(v) + self.eps))


def reference_run(task, initial, config):
    """The generator's and discriminator's weights after one critic update per --gan_critic_steps then one generator
    update on each of the run's first config.train_steps batches, from `initial` ({model: [numpy weights in layer
    order]}), with z drawn as the task draws it. Returns ({model: [weights]}, {model: update count})."""
    from engine.api import training_batches
    from tasks import gan

    stream = training_batches(config)
    batches = [next(stream) for _ in range(config.train_steps)]
    weights = {name: [tf.Variable(w) for w in values] for name, values in initial.items()}
    pairs = {name: list(zip(ws[::2], ws[1::2])) for name, ws in weights.items()}
    adams = {name: Adam(ws, config.learning_rate) for name, ws in weights.items()}
    shape = batches[0]["image"].shape[1:]

    def generate(z):
        return tf.reshape(helpers.leaky_mlp(pairs["generator"], z, tf.sigmoid), [-1, *shape])

    def logit(images):
        return helpers.leaky_mlp(pairs["discriminator"], tf.reshape(images, [len(images), -1]), lambda x: x)[:, 0]

    def step(name, loss):
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss()) / config.global_batch_size
        adams[name].apply(tape.gradient(total, weights[name]))

    for batch in batches:
        real = batch["image"]
        for _ in range(config.gan_critic_steps):
            fake = generate(task.noise(batch["index"], gan.CRITIC))
            step("discriminator", lambda: tf.nn.softplus(-logit(real)) + tf.nn.softplus(logit(fake)))
        z = task.noise(batch["index"], gan.GENERATOR)
        step("generator", lambda: tf.nn.softplus(-logit(generate(z))))
    return {n: [w.numpy() for w in ws] for n, ws in weights.items()}, {n: a.t for n, a in adams.items()}


def test_matches_a_plain_tensorflow_loop_of_its_math(one_device_run):
    _, _, trainer, initial = one_device_run
    expected, counts = reference_run(trainer.task, initial, trainer.config)
    worst, moved = 0.0, np.inf
    for name, model in trainer.models.items():
        for variable, want, start in zip(model.trainable_variables, expected[name], initial[name]):
            worst = max(worst, float(np.max(np.abs(variable.numpy() - want))))
            moved = min(moved, float(np.max(np.abs(want - start))))
    print(f"GAN vs its plain TensorFlow loop after 20 steps: max |difference| {worst:.2e}; least move {moved:.2e}")
    assert worst < TOLERANCE
    assert moved > 100 * TOLERANCE  # every weight array moved: no untouched copy is compared
    iterations = {plan.name: int(plan.optimizer.iterations.numpy()) for plan in trainer.plans}
    assert iterations == counts == {"discriminator": 40, "generator": 20}


# ---- Across strategies -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_worker_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gan_workers")
    results = helpers.run_workers([os.path.abspath(__file__), str(out), data_dir], count=2, timeout=600)
    for code, output in results:
        assert code == 0, output[-3000:]
    return [dict(np.load(out / f"worker{i}.npz")) for i in range(2)]


def test_mirrored_matches_one_device(data_dir, mirrored, one_device_run):
    snap, out, trainer, _ = helpers.train_and_snapshot_updates(helpers.make_config(data_dir, **CASE), mirrored)
    for name, copies in snap.items():  # the two replicas hold identical values
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)
    reference, reference_out, reference_trainer, *_ = one_device_run
    results, reference_results = trainer.evaluator.evaluate(), reference_trainer.evaluator.evaluate()
    assert results["examples"] == reference_results["examples"] == 360
    for name in ("frechet_distance", "discriminator_loss", "generator_loss"):  # evaluation's z: the example's too
        assert results[name] == pytest.approx(reference_results[name], rel=TOLERANCE), name
    difference = max_difference(first_copies(snap), first_copies(reference))
    print(f"GAN mirrored vs one device: max |difference| {difference:.2e} (weights, slots, counts)")
    assert difference < TOLERANCE
    assert snap["discriminator/iterations"][0] == 2 * 20 and snap["generator/iterations"][0] == 20
    for name in ("loss", "discriminator/loss", "generator/loss", "discriminator/grad_norm", "generator/grad_norm"):
        assert out[name] == pytest.approx(reference_out[name], rel=TOLERANCE), name


@pytest.mark.slow
def test_multi_worker_matches_one_device(one_device_run, multi_worker_run):
    workers = multi_worker_run
    assert max_difference(workers[0], workers[1]) == 0.0
    reference, reference_out, *_ = one_device_run
    reference = first_copies(reference)
    difference = max_difference({k: workers[0][k] for k in reference}, reference)
    print(f"GAN two workers vs one device: max |difference| {difference:.2e} (weights, slots, counts)")
    assert difference < TOLERANCE
    assert workers[0]["discriminator/iterations"] == 40 and workers[0]["generator/iterations"] == 20
    for name in ("loss", "discriminator/loss", "generator/loss"):
        assert float(workers[0][f"out/{name}"]) == pytest.approx(reference_out[name], rel=TOLERANCE), name


# ---- Killed and resumed --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_and_restart_equals_uninterrupted(data_dir, tmp_path, capsys):
    settings = dict(
        data_dir=data_dir,
        task="gan",
        deterministic=True,
        hidden_sizes=(64, 64),
        gan_critic_steps=2,
        learning_rate=1e-3,
        global_batch_size=64,
        train_steps=300,
        steps_per_loop=10,
        checkpoint_every=50,
        jit_compile=False,  # launch.py and this process would each compile the step for longer than they train
    )
    returncode, stopped, resumed, straight, killed = helpers.straight_and_killed(tmp_path, settings, 80, capsys, 240)
    assert returncode == -9 and 80 <= stopped < 300, stopped  # killed mid-run, after a checkpoint
    assert 50 <= resumed <= stopped < 300
    (path_a, a), (path_b, b) = helpers.checkpoint_tensors(straight), helpers.checkpoint_tensors(killed)
    assert path_a.endswith("ckpt-300") and path_b.endswith("ckpt-300") and a.keys() == b.keys()
    slots = [k for k in a if k.startswith("optimizers/") and "/slots_by_path/" in k]
    assert len(slots) == 2 * 2 * 6  # two updates, two Adam slots for each of the six arrays of each network
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert a["optimizers/discriminator/iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 600
    assert a["optimizers/generator/iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 300
    summaries = [json.load(open(d / "summary.json")) for d in (straight, killed)]
    assert summaries[0]["eval"] == summaries[1]["eval"]


def test_a_run_killed_after_its_last_checkpoint_writes_the_summary_with_each_updates_numbers(
    data_dir, one_device, tmp_path
):
    from engine.run import loop

    config = helpers.make_config(data_dir, str(tmp_path), **dict(CASE, train_steps=4, steps_per_loop=2))
    straight = loop.train(config, one_device)
    os.remove(tmp_path / "summary.json")  # killed after its last checkpoint, before the summary
    resumed = loop.train(config, one_device)  # trains nothing: the step is --train_steps
    timing = ("wall_seconds", "examples_per_sec", "input_wait_fraction", "resumed_at")  # this process's
    assert straight["resumed_at"] is None and resumed["resumed_at"] == 4
    assert "generator/loss" in straight and "discriminator/grad_norm" in straight
    assert {k: v for k, v in resumed.items() if k not in timing} == {
        k: v for k, v in straight.items() if k not in timing
    }


# ---- What a run reports, writes and exports ----------------------------------------------------------------------


@pytest.mark.slow
def test_training_beats_one_step_and_reports_each_update(data_dir, one_device, tmp_path):
    from engine.run import build, loop
    from engine.run import modes as evaluate
    from engine.state import checkpoint, held
    from tasks import gan

    settings = dict(CASE, hidden_sizes=(64, 64), gan_latent=16, learning_rate=2e-4, steps_per_loop=100)
    workdir = tmp_path / "run"
    # The 1-step generator's distance, then the same run trained on to 300 steps.
    first = loop.train(helpers.make_config(data_dir, str(workdir), **dict(settings, train_steps=1)), one_device)
    config = helpers.make_config(data_dir, str(workdir), **dict(settings, train_steps=300))
    summary = loop.train(config, one_device)
    distances = first["eval"]["frechet_distance"], summary["eval"]["frechet_distance"]
    print(f"frechet_distance after 1 step {distances[0]:.3f}, after 300 steps {distances[1]:.3f}")
    assert distances[1] < distances[0] / 2
    assert summary["eval"]["examples"] == 360
    assert set(summary["eval"]) == {
        "discriminator_loss",
        "generator_loss",
        "real_accepted",
        "fake_accepted",
        "frechet_distance",
        "examples",
    }
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 100, 200, 300]
    for record in (records[-1], summary):
        for update in ("discriminator", "generator"):
            assert record[f"{update}/learning_rate"] == pytest.approx(2e-4)
            assert record[f"{update}/grad_norm"] > 0 and record[f"{update}/loss"] > 0
    last = records[-1]
    assert last["loss"] is None  # the two updates' losses summed mean nothing: each is logged by its name
    assert summary["discriminator/loss"] == last["discriminator/loss"]
    samples = tf.io.decode_png(open(workdir / "samples.png", "rb").read()).numpy()
    assert samples.shape == (4 * (10 * 9 + 1), 4 * (10 * 9 + 1), 1)
    assert samples.std() > 20  # drawn, not blank
    events = [os.path.join(workdir, "eval", name) for name in os.listdir(workdir / "eval")]
    pictured = [
        (event.step, value.tag)
        for path in events
        for event in tf.compat.v1.train.summary_iterator(path)
        for value in event.summary.value
        if value.tag == "samples"
    ]
    assert sorted(pictured) == [(1, "samples"), (300, "samples")]  # TensorBoard's image at each evaluation

    export_dir = evaluate.export(dataclasses.replace(config, mode="export"))
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    trainer = build.run(config, one_device)
    checkpoint.restore(
        tf.train.Checkpoint(models=held.model_state(trainer.models)),
        checkpoint.latest(str(workdir / "checkpoints")),
        partial=True,
    )
    z = trainer.task.noise(tf.range(5, dtype=tf.int64), gan.SAMPLES)
    images = served(z=z)["images"].numpy()
    assert images.shape == (5, 8, 8, 1) and 0 <= images.min() and images.max() <= 1
    np.testing.assert_allclose(images, trainer.models["generator"](z).numpy(), atol=1e-6)
    np.testing.assert_allclose(images.reshape(5, -1), trainer.task.samples(trainer.models, 5).reshape(5, -1), atol=1e-6)


def test_frechet_distance_of_known_gaussians():
    from tasks.gan import frechet_distance

    rng = np.random.default_rng(0)
    a = rng.normal(size=(20000, 3))
    b = rng.normal(size=(20000, 3)) * np.array([1.0, 2.0, 3.0]) + np.array([1.0, 0.0, 0.0])
    # Diagonal covariances: |mu|^2 + sum((sqrt(s_a) - sqrt(s_b))^2) = 1 + 0 + 1 + 4.
    assert frechet_distance(a, b) == pytest.approx(6.0, rel=0.02)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)
    singular = np.concatenate([a[:100, :2], np.zeros((100, 1))], axis=1)  # a pixel that never inks
    assert np.isfinite(frechet_distance(singular, b[:100]))


def test_frechet_distance_counts_each_real_example_by_its_weight(data_dir):
    """A source's fractional weights: the real images' Gaussian counted an example of weight 1e-6 as much as one of
    weight 1 (the metrics beside it weigh each by its weight), here a far cluster that made it nine times what it is."""
    from tasks import gan

    config = helpers.make_config(data_dir, task="gan", hidden_sizes=(16,), gan_latent=8)
    task = gan.Task(config, {"image": tf.TensorSpec([8, 8, 1], tf.float32)}, {})
    models = task.models(None)
    rng = np.random.default_rng(0)
    near = rng.uniform(0.3, 0.7, size=(100, 8, 8, 1)).astype(np.float32)  # the generator's untrained grays
    far = np.ones_like(near)  # weighing next to nothing: it must move the distance next to nothing
    weight = np.concatenate([np.ones(100), np.full(100, 1e-6)]).astype(np.float32)
    batch = {"image": tf.constant(np.concatenate([near, far])), "weight": tf.constant(weight)}
    found = task.probe(models, lambda split: iter([batch]))["frechet_distance"]
    fakes = task.samples(models, 200).reshape(200, -1)
    alone = gan.frechet_distance(near.reshape(100, -1).astype(np.float64), fakes)
    assert found == pytest.approx(alone, rel=1e-3), (found, alone)


def test_another_model_is_refused(data_dir):
    from engine.settings.errors import ConfigError
    from tasks import gan

    with pytest.raises(ConfigError, match=r"^--model=resnet: --task=gan builds its own generator and discriminator"):
        gan.Task(helpers.make_config(data_dir, task="gan", model="resnet"), {}, {})


def worker(out_dir, data_dir):
    """One process of the multi-worker run: trains CASE, saves what the parity test compares."""
    from engine.cluster import distribute

    strategy = distribute.create_strategy(helpers.make_config(data_dir, strategy="multi_worker").cluster)
    snap, out, _, _ = helpers.train_and_snapshot_updates(helpers.make_config(data_dir, **CASE), strategy)
    arrays = {**first_copies(snap), **{f"out/{k}": out[k] for k in ("loss", "discriminator/loss", "generator/loss")}}
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), **arrays)


def test_images_samples_png_cannot_draw_are_refused_and_grayscale_ones_drawn(data_dir):
    """samples.png is drawn at the first evaluation, after the training: an image it could not draw ended the run
    there (a traceback's line from grid, exit 2, and again at each evaluation of a resumed run). An npz's MNIST-like
    (height, width) images are drawn with one channel; other shapes are refused before the run starts."""
    from engine.settings.errors import ConfigError
    from tasks import gan

    for task in ("gan", "wgan_gp"):
        config = helpers.make_config(data_dir, task=task)
        for shape in ([16], [8, 8, 5], [2, 8, 8, 1]):
            with pytest.raises(ConfigError) as refused:
                gan.Task(config, {"image": tf.TensorSpec(shape, tf.float32)}, {})
            assert str(refused.value).startswith(
                f"--dataset=digits: its image has shape {tuple(shape)}, which --task={task} cannot draw into "
                "samples.png"
            )
    task = gan.Task(helpers.make_config(data_dir, task="gan"), {"image": tf.TensorSpec([8, 8], tf.uint8)}, {})
    task.spec = {"image": tf.TensorSpec([8, 8], tf.float32)}  # the prepared example's, as the engine sets it
    picture = task.pictures(task.models(None))["samples"]
    side = (gan.GRID * 9 + 1) * gan.ZOOM  # GRID images of 8 pixels and their frames
    assert picture.shape == (side, side, 1) and picture.dtype == np.uint8
    assert len(tf.io.encode_png(picture).numpy()) > 0


if __name__ == "__main__":
    worker(*sys.argv[1:])
