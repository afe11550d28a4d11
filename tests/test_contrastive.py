"""Contrastive learning (tasks/contrastive.py): views that are a function of (seed, index, view) alone; the
NT-Xent loss over the GLOBAL batch, with the same loss, weights and evaluation on one device, two mirrored
replicas and two worker processes; a local-negatives mutant that this parity check catches; and a linear probe
of the trained encoder that beats one on the raw pixels.

Also the worker of the multi-worker run: TF_CONFIG=... python tests/test_contrastive.py OUT_DIR DATA_DIR
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import helpers  # noqa: E402

TOLERANCE = 1e-5
# Unclipped, so a gradient of the wrong scale shows in the weights; weight decay and warmup exercise the update.
CASE = dict(task="contrastive", optimizer="adamw", learning_rate=3e-3, weight_decay=1e-2, warmup_steps=5)


def snapshot(trainer):
    """{name: [replica copies]}: every model's variables by path, the optimizer's slots and update count."""
    named = {v.path: v.value for model in trainer.models.values() for v in model.variables}
    named.update(
        {f"slot/{i}": s for i, s in enumerate(s for per_param in trainer.plans[0].optimizer.slots for s in per_param)}
    )
    named["iterations"] = trainer.plans[0].optimizer.iterations
    return {name: helpers.local_values(trainer.strategy, v) for name, v in named.items()}


def train_and_evaluate(config, strategy):
    """(snapshot, the round's outputs, the evaluation) after config.train_steps steps."""
    from engine.run import build

    trainer = build.run(config, strategy)
    out = trainer.program.run_steps(trainer.program.train_iterator(), config.train_steps)
    return snapshot(trainer), out, trainer.evaluator.evaluate()


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)))) for k in a)


def first_copies(snap):
    return {k: v[0] for k, v in snap.items()}


@pytest.fixture(scope="module")
def one_device_run(data_dir, one_device):
    return train_and_evaluate(helpers.make_config(data_dir, **CASE), one_device)


@pytest.fixture(scope="module")
def multi_worker_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("contrastive_workers")
    results = helpers.run_workers([os.path.abspath(__file__), str(out), data_dir], count=2, timeout=600)
    for code, output in results:
        assert code == 0, output[-3000:]
    return [dict(np.load(out / f"worker{i}.npz")) for i in range(2)]


def test_views_are_a_function_of_seed_index_and_view(data_dir, one_device, mirrored):
    import tensorflow as tf

    from engine.run import build
    from tasks.base import example_keys as view_keys
    from tasks.base import example_uniforms as uniforms
    from tasks.contrastive import augment

    config = helpers.make_config(data_dir, task="contrastive")
    view = tf.function(lambda images, index, v: augment(images, view_keys(config.seed, index, v)))

    def views(strategy, start):
        """Both views of global batch `start` as the replicas see them, in global order: [2, batch, ...]."""
        trainer = build.run(config, strategy)
        trainer.state.batches.assign(start)
        # The pipeline's batches (a step that gathers its own takes the same ones).
        trainer.program.input = trainer.program.input_path(in_step=False)
        batch = next(trainer.program.train_iterator())

        def per_replica(batch):
            return tf.stack([view(batch["image"], batch["index"], v) for v in (1, 2)])

        out = strategy.run(per_replica, args=(batch,))
        indices = tf.concat(strategy.experimental_local_results(batch["index"]), 0)
        return tf.concat(strategy.experimental_local_results(out), 1).numpy(), indices.numpy()

    single, indices = views(one_device, 3)
    split, split_indices = views(mirrored, 3)
    np.testing.assert_array_equal(split_indices, indices)
    np.testing.assert_array_equal(split, single)  # the same example, the same views, on one replica or two
    assert split[0].shape == (64, 8, 8, 1)
    # The resumed position draws the views an uninterrupted run draws at that step.
    trainer = build.run(config, one_device)
    trainer.program.input = trainer.program.input_path(in_step=False)
    iterator = trainer.program.train_iterator()
    fourth = [next(iterator) for _ in range(4)][3]
    np.testing.assert_array_equal(fourth["index"].numpy(), indices)
    again = view(fourth["image"], fourth["index"], 1).numpy()
    np.testing.assert_array_equal(again, single[0])

    def smallest_change(a, b):  # per example, the mean absolute pixel difference; the smallest over the batch
        return float(np.min(np.mean(np.abs(a - b), axis=(1, 2, 3))))

    assert smallest_change(single[0], single[1]) > 0.02  # the two views of every example differ
    image = np.repeat(fourth["image"].numpy()[:1], 64, axis=0)  # one image at 64 positions of the stream
    at = augment(tf.constant(image), view_keys(config.seed, tf.range(64, dtype=tf.int64), 1)).numpy()
    assert min(smallest_change(at[i : i + 1], np.delete(at, i, axis=0)) for i in range(64)) > 0.01
    other_seed = augment(fourth["image"], view_keys(config.seed + 1, fourth["index"], 1)).numpy()
    assert smallest_change(other_seed, single[0]) > 0.02
    u = uniforms(view_keys(0, tf.range(100, dtype=tf.int64), 1), 1000).numpy()
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and len(np.unique(u)) > 99_000


@pytest.mark.slow
def test_mirrored_and_multi_worker_match_one_device(data_dir, mirrored, one_device_run, multi_worker_run):
    reference, reference_out, reference_eval = one_device_run
    snap, out, results = train_and_evaluate(helpers.make_config(data_dir, **CASE), mirrored)
    for copies in snap.values():  # the two replicas hold identical values
        np.testing.assert_array_equal(copies[0], copies[1])
    workers = multi_worker_run
    assert max_difference(workers[0], workers[1]) == 0.0
    reference = first_copies(reference)
    mirrored_difference = max_difference(first_copies(snap), reference)
    worker_difference = max_difference({k: workers[0][k] for k in reference}, reference)
    print(
        f"weights vs one device: mirrored {mirrored_difference:.2e}, multi-worker {worker_difference:.2e}; loss "
        f"{reference_out['loss']!r}, {out['loss']!r}, {float(workers[0]['out/loss'])!r}; eval loss "
        f"{reference_eval['loss']!r}, {results['loss']!r}, {float(workers[0]['eval/loss'])!r}"
    )
    assert mirrored_difference < TOLERANCE and worker_difference < TOLERANCE
    assert snap["iterations"][0] == workers[0]["iterations"] == 20
    for name in ("loss", "grad_norm"):
        assert out[name] == pytest.approx(reference_out[name], rel=TOLERANCE)
        assert float(workers[0][f"out/{name}"]) == pytest.approx(reference_out[name], rel=TOLERANCE)
    # Evaluation gathers too: every replica's batch is a negative, padding is not, on any replica count.
    assert results["examples"] == int(workers[0]["eval/examples"]) == reference_eval["examples"] == 360
    assert results["loss"] == pytest.approx(reference_eval["loss"], rel=TOLERANCE)
    assert float(workers[0]["eval/loss"]) == pytest.approx(reference_eval["loss"], rel=TOLERANCE)
    assert results["probe_accuracy"] == float(workers[0]["eval/probe_accuracy"]) == reference_eval["probe_accuracy"]


@pytest.mark.slow
def test_local_negatives_would_fail_the_parity_check(data_dir, mirrored, one_device_run, monkeypatch):
    from tasks import contrastive

    def local_only(self, rows):  # the mutant: each replica contrasts its own examples only, as without all_gather
        return rows, 0

    monkeypatch.setattr(contrastive.Task, "gather", local_only)
    snap, out, results = train_and_evaluate(helpers.make_config(data_dir, **CASE), mirrored)
    reference, reference_out, reference_eval = one_device_run
    difference = max_difference(first_copies(snap), first_copies(reference))
    print(f"local negatives: weights {difference:.2e} from one device, loss {out['loss']} vs {reference_out['loss']}")
    assert difference > 1000 * TOLERANCE
    assert abs(out["loss"] - reference_out["loss"]) > 0.1  # fewer negatives: an easier task
    assert abs(results["loss"] - reference_eval["loss"]) > 0.1


@pytest.mark.slow
def test_run_eagerly_gathers_like_the_graph(data_dir, one_device, mirrored):
    # Eager mode has no all_gather under MirroredStrategy: the task gathers with an all-reduce there.
    import tensorflow as tf

    from engine.run import build

    runs = []
    try:
        for strategy, eager in ((one_device, False), (mirrored, True)):
            # A warmup shorter than the 3 steps (--warmup_steps must be less than --train_steps).
            case = {**CASE, "warmup_steps": 2}
            trainer = build.run(helpers.make_config(data_dir, **case, train_steps=3, run_eagerly=eager), strategy)
            out = trainer.program.run_steps(trainer.program.train_iterator(), 3)
            runs.append((first_copies(snapshot(trainer)), out))
    finally:
        tf.config.run_functions_eagerly(False)  # a process-wide switch: the tests after this one run graphs
    assert max_difference(runs[1][0], runs[0][0]) < TOLERANCE
    assert runs[1][1]["loss"] == pytest.approx(runs[0][1]["loss"], rel=TOLERANCE)
    assert runs[1][1]["grad_norm"] == pytest.approx(runs[0][1]["grad_norm"], rel=TOLERANCE)


def test_settings_that_would_break_the_global_negatives_are_refused(data_dir):
    from engine.settings.errors import ConfigError
    from tasks import contrastive

    with pytest.raises(ConfigError, match=r"^--grad_accum_steps=2: --task=contrastive draws its negatives from"):
        contrastive.Task(helpers.make_config(data_dir, task="contrastive", grad_accum_steps=2), {}, {})
    with pytest.raises(ConfigError, match=r"^--contrastive_temperature=0.0: must be a positive number"):
        helpers.make_config(data_dir, task="contrastive", contrastive_temperature=0.0)


def test_images_without_height_width_and_channels_are_refused_before_the_run_starts(data_dir):
    """An npz's MNIST-like (height, width) images: the views' resampling failed as the step was traced, in an einsum's
    line, after the workdir was written."""
    import tensorflow as tf

    from engine.settings.errors import ConfigError
    from tasks import contrastive

    config = helpers.make_config(data_dir, task="contrastive")
    for shape in ([8, 8], [64]):
        with pytest.raises(ConfigError) as refused:
            contrastive.Task(config, {"image": tf.TensorSpec(shape, tf.uint8)}, {})
        assert str(refused.value) == (
            f"--dataset=digits: its image has shape {tuple(shape)}; --task=contrastive draws its views from images of "
            "shape (height, width, channels)"
        )


@pytest.mark.slow
def test_training_beats_a_linear_probe_on_raw_pixels(data_dir, one_device):
    import tensorflow as tf

    from engine.run import build, inputs
    from tasks.contrastive import linear_probe

    # Measured (test split, 360 examples): raw pixels 0.9528; this encoder untrained 0.9611 (random features of a
    # wide MLP already match the pixels), trained 0.9722. A 32-wide MLP went from about 0.72 untrained to 0.93-0.96 at
    # 600-1200 steps, not reliably above the pixels.
    config = helpers.make_config(
        data_dir,
        task="contrastive",
        hidden_sizes=(256, 256),
        global_batch_size=128,
        train_steps=600,
        steps_per_loop=600,
    )

    def pixels(split):
        batches = list(inputs.run_data(config, split).eval_fn(tf.distribute.InputContext()))
        real = np.concatenate([b["weight"].numpy() > 0 for b in batches])
        images = np.concatenate([b["image"].numpy().reshape(len(b["image"]), -1) for b in batches])[real]
        return images.astype(np.float64), np.concatenate([b["label"].numpy() for b in batches])[real]

    raw = linear_probe(*pixels("train"), *pixels("test"), 10)
    trainer = build.run(config, one_device)
    before = trainer.evaluator.evaluate()
    trainer.program.run_steps(trainer.program.train_iterator(), config.train_steps)
    after = trainer.evaluator.evaluate()
    print(
        f"probe accuracy: raw pixels {raw:.4f}, untrained encoder {before['probe_accuracy']:.4f}, trained "
        f"{after['probe_accuracy']:.4f}; eval loss {before['loss']:.3f} -> {after['loss']:.3f}"
    )
    assert raw == pytest.approx(0.9528, abs=1e-4)  # 343 of 360
    assert after["probe_accuracy"] > raw + 0.01 and after["probe_accuracy"] > before["probe_accuracy"]
    assert before["loss"] > 4.5 and after["loss"] < 3.0  # log(2 x 128 - 1) = 5.5 for a loss that knows nothing


def worker(out_dir, data_dir):
    """One process of the multi-worker run: trains CASE, evaluates, saves what the parity test compares."""
    import json

    from engine.cluster import distribute

    strategy = distribute.create_strategy(helpers.make_config(data_dir, strategy="multi_worker").cluster)
    snap, out, results = train_and_evaluate(helpers.make_config(data_dir, **CASE), strategy)
    arrays = {**first_copies(snap), **{f"out/{k}": out[k] for k in ("loss", "grad_norm")}}
    arrays.update({f"eval/{k}": v for k, v in results.items()})
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), **arrays)


def test_the_probe_counts_each_example_by_its_weight(data_dir):
    """A source's fractional weights: the probe counted an example of weight 0.01 as much as one of weight 1, while
    the loss beside it weighed each by its weight. One of weight k counts as k copies, of weight 0 as none."""
    import tensorflow as tf

    from tasks import contrastive

    config = helpers.make_config(data_dir, task="contrastive")
    task = contrastive.Task(config, {"image": tf.TensorSpec([2, 2, 1], tf.float32)}, {"num_classes": 2})
    encoder = {"encoder": tf.keras.Sequential([tf.keras.layers.Flatten()])}  # the probe reads the pixels
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 200, 2, 2, 1)).astype(np.float32)
    labels = (images[..., 0, 0, 0] + rng.normal(size=(2, 200)) > 0).astype(np.int64)  # noisy: accuracy about 0.7
    weights = rng.integers(0, 4, size=(2, 200)).astype(np.float32)
    splits = dict(zip((config.train_split, config.eval_split), range(2)))

    def probed(repeat):
        def examples(split):
            i = splits[split]
            counts = weights[i].astype(int) if repeat else np.ones(200, int)
            image, label = np.repeat(images[i], counts, 0), np.repeat(labels[i], counts)
            weight = np.ones(len(label), np.float32) if repeat else weights[i]
            yield {"image": tf.constant(image), "label": tf.constant(label), "weight": tf.constant(weight)}

        return task.probe(encoder, examples)["probe_accuracy"]

    weighted, copied = probed(False), probed(True)
    assert weighted == pytest.approx(copied, abs=1e-12), (weighted, copied)
    assert 0.6 < copied < 0.9


if __name__ == "__main__":
    worker(*sys.argv[1:])
