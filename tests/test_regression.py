"""--task=regression on the bundled Palmer penguins: standardization from the training split only, metrics in
grams, a short run against the predict-the-mean baseline, export of raw features to grams, and parity of one
device with two mirrored replicas."""

import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf

from engine.run import build, loop
from engine.run import modes as evaluate
from engine.state import checkpoint, held
from sources import penguins
from tasks import regression
from tests import helpers
from tests.test_parity import TOLERANCE, _max_difference

SETTINGS = dict(task="regression", global_batch_size=32, learning_rate=3e-3, lr_schedule="cosine", weight_decay=0.1)


def _rows(split):
    """(features, target) of a split as numpy, in the source's order."""
    source = penguins.load(helpers.make_config("", **SETTINGS), split)
    fetched = source.evals.fetch(tf.range(source.evals.examples, dtype=tf.int64))
    return fetched["features"].numpy().astype(np.float64), fetched["target"].numpy().astype(np.float64)


def test_statistics_come_from_the_training_split_only():
    source = penguins.load(helpers.make_config("", **SETTINGS), "test")
    info = source.info
    rows = {split: _rows(split) for split in penguins.SPLITS}
    assert {split: len(y) for split, (_, y) in rows.items()} == {"train": 231, "validation": 35, "test": 67}
    assert info["dropped"] == 11 and source.train.examples == 231  # 344 rows in the file
    train_x, train_y = rows["train"]
    # The float32 tensors round the CSV's decimals; the statistics are taken in float64 from the CSV.
    np.testing.assert_allclose(info["feature_mean"], train_x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(info["feature_std"], train_x.std(0), rtol=1e-6)
    assert info["target_mean"] == pytest.approx(train_y.mean(), rel=1e-9)
    assert info["target_std"] == pytest.approx(train_y.std(), rel=1e-9)
    all_x = np.concatenate([x for x, _ in rows.values()])
    all_y = np.concatenate([y for _, y in rows.values()])
    assert np.max(np.abs(info["feature_mean"] - all_x.mean(0)) / all_x.std(0)) > 0.01
    assert abs(info["target_mean"] - all_y.mean()) > 5.0  # grams
    assert abs(info["target_std"] - all_y.std()) > 5.0


def test_standardize_and_unstandardize_round_trip():
    config = helpers.make_config("", **SETTINGS)
    source = penguins.load(config, "test")
    task = regression.Task(config, source.spec, source.info)
    x, y = _rows("train")
    prepared = task.prepare({"features": tf.constant(x, tf.float32), "target": tf.constant(y, tf.float32)})
    standardized, target = prepared["features"].numpy(), prepared["target"].numpy()
    # Training statistics: the training rows come out with mean 0 and standard deviation 1.
    np.testing.assert_allclose(standardized.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(standardized.std(0), 1.0, rtol=1e-5)
    assert abs(target.mean()) < 1e-5 and target.std() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(task.unstandardize(target), y, rtol=1e-6)
    np.testing.assert_allclose(
        standardized * source.info["feature_std"] + source.info["feature_mean"], x, rtol=1e-6, atol=1e-6
    )
    # The test rows use the training statistics too: not centred on themselves.
    test_target = task.prepare({"features": tf.zeros([67, 11]), "target": tf.constant(_rows("test")[1], tf.float32)})
    assert abs(float(tf.reduce_mean(test_target["target"]))) > 0.05


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_device):
    """A short run of the recipe's optimizer on a small MLP: its config and summary."""
    config = helpers.make_config("", str(tmp_path_factory.mktemp("regression")), train_steps=200, **SETTINGS)
    return config, loop.train(config, one_device)


def test_a_short_run_beats_predicting_the_mean(trained):
    _, summary = trained
    _, train_y = _rows("train")
    _, test_y = _rows("test")
    baseline = math.sqrt(np.mean(np.square(test_y - train_y.mean())))  # 756.1 g
    results = summary["eval"]
    assert results["examples"] == 67
    # Measured: 276.8 g (0.37 of the baseline) on a 2-core Intel Xeon; least squares reaches 282.9 g.
    assert results["rmse"] < 0.45 * baseline
    assert results["rmse"] > 0.2 * baseline  # in grams: in standardized units it would be about 0.37
    assert results["mae"] < results["rmse"]
    assert results["rmse"] == math.sqrt(results["mse"])


def test_export_serves_raw_features_to_grams(trained, one_device):
    config, summary = trained
    export_dir = evaluate.export(dataclasses.replace(config, mode="export"))
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    test_x, test_y = _rows("test")
    predictions = served(features=tf.constant(test_x, tf.float32))["predictions"].numpy()
    assert predictions.shape == (67,)

    trainer = build.run(config, one_device)
    checkpoint.restore(
        tf.train.Checkpoint(models=held.model_state(trainer.models)),
        checkpoint.latest(f"{config.workdir}/checkpoints"),
        partial=True,
    )
    info = trainer.data.task.info
    standardized = (test_x - info["feature_mean"]) / info["feature_std"]
    expected = trainer.model(tf.constant(standardized, tf.float32)).numpy()[:, 0] * info["target_std"]
    np.testing.assert_allclose(predictions, expected + info["target_mean"], rtol=1e-5)
    # The served grams give the run's own test metrics.
    assert np.sqrt(np.mean(np.square(predictions - test_y))) == pytest.approx(summary["eval"]["rmse"], rel=1e-5)
    assert np.mean(np.abs(predictions - test_y)) == pytest.approx(summary["eval"]["mae"], rel=1e-5)


def _train(config, strategy):
    trainer = build.run(config, strategy)
    out = trainer.program.run_steps(trainer.program.train_iterator(), config.train_steps)
    return helpers.snapshot(trainer), out, trainer.evaluator.evaluate()


@pytest.mark.slow
def test_mirrored_matches_one_device(one_device, mirrored):
    config = helpers.make_config("", **{**SETTINGS, "clip_norm": 0.5})
    reference, reference_out, reference_eval = _train(config, one_device)
    snap, out, evaluated = _train(config, mirrored)
    for copies in snap.values():
        np.testing.assert_array_equal(copies[0], copies[1])
    assert snap["iterations"][0] == 20
    assert _max_difference({k: v[0] for k, v in snap.items()}, {k: v[0] for k, v in reference.items()}) < TOLERANCE
    assert out["loss"] == pytest.approx(reference_out["loss"], rel=TOLERANCE)
    assert out["grad_norm"] == pytest.approx(reference_out["grad_norm"], rel=TOLERANCE)
    assert reference_out["grad_norm"] > 0.5  # clipping is active
    assert evaluated.keys() == reference_eval.keys() and evaluated["examples"] == 67
    for name in ("loss", "mse", "mae", "rmse"):
        assert evaluated[name] == pytest.approx(reference_eval[name], rel=TOLERANCE)
