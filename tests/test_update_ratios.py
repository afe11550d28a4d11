"""An action that needs the step's updates (engine/run/actions/update_ratios.py): the change each apply made to the
variables, returned by the round's last step, is the weights' change itself (plain SGD: -learning rate x the
gradients it applied), the same on two mirrored replicas as on one device; in a real run the action logs each
variable's ||update|| / ||weights before it|| at every --update_ratio_every steps."""

import os

import numpy as np
import pytest

from engine.data import datasets
from engine.numerics.updates import Update
from engine.run import build, loop
from engine.run.actions.update_ratios import ratios
from tasks import classification
from tests import helpers
from tests.test_updates import SplitAtFrequencies

SGD = dict(optimizer="sgd", momentum=0.0, learning_rate=0.1, hidden_sizes=(8,), jit_compile="false")


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_the_steps_updates_are_the_weights_change_and_minus_the_rate_times_the_gradients(data_dir, strategy, request):
    run = build.run(helpers.make_config(data_dir, **SGD), request.getfixturevalue(strategy))
    iterator = run.program.train_iterator()
    run.program.run_round(iterator, 2)
    before = run.weights.arrays()
    _, extras = run.program.run_round(iterator, 1, {"gradients", "updates"})
    after = run.weights.arrays()
    assert sorted(extras["updates"]) == sorted(run.weights.names)
    for name in run.weights.names:
        update = extras["updates"][name]
        np.testing.assert_allclose(update, after[name] - before[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(update, -0.1 * extras["gradients"][name], rtol=1e-5, atol=1e-7)
        assert np.abs(update).max() > 0, name


def test_mirrored_replicas_return_one_devices_updates(data_dir, one_device, mirrored):
    found = []
    for strategy in (one_device, mirrored):
        run = build.run(helpers.make_config(data_dir, **SGD), strategy)
        _, extras = run.program.run_round(run.program.train_iterator(), 3, {"updates"})
        found.append(extras["updates"])
    for name, update in found[0].items():
        np.testing.assert_allclose(found[1][name], update, rtol=1e-5, atol=1e-7)


def _scalars(workdir):
    """{tag: {step: value}} of the train run's TensorBoard scalars."""
    found = helpers.tensorboard_values(os.path.join(workdir, "train"), lambda v: v.tag.startswith("update_ratio/"))
    return {tag: {step: float(value) for step, value in steps.items()} for tag, steps in found.items()}


def test_update_ratios_logs_each_variables_ratio_at_every_update_ratio_every_steps(data_dir, one_device, tmp_path):
    settings = dict(actions="update_ratios", update_ratio_every=3, train_steps=7, steps_per_loop=10, eval_every=0)
    workdir = str(tmp_path / "run")
    loop.train(helpers.make_config(data_dir, workdir, **SGD, **settings), one_device)
    written = _scalars(workdir)

    reference = build.run(helpers.make_config(data_dir, **SGD, **settings), one_device)
    names = reference.weights.names
    assert sorted(written) == sorted(f"update_ratio/{name}" for name in names)
    assert all(sorted(steps) == [3, 6] for steps in written.values()), {k: sorted(v) for k, v in written.items()}
    iterator = reference.program.train_iterator()
    for step in (3, 6):  # the same run stepped to that step alone: its weights before and after it
        reference.program.run_steps(iterator, 2)
        before = reference.weights.arrays()
        reference.program.run_steps(iterator, 1)
        after = reference.weights.arrays()
        for name in names:
            change = np.linalg.norm(after[name] - before[name])
            expected = change / np.linalg.norm(before[name])
            np.testing.assert_allclose(written[f"update_ratio/{name}"][step], expected, rtol=1e-4)
            assert written[f"update_ratio/{name}"][step] > 0, name


def test_a_variable_that_did_not_move_or_was_zero_has_no_ratio():
    updates = {"w": np.array([3.0, 4.0]), "b": np.array([0.5]), "still": np.zeros(2)}
    assert ratios({"w": np.array([3.0, 4.0]), "b": np.array([0.5]), "still": np.ones(2)}, updates) == {}
    assert ratios({"w": np.array([6.0, 8.0]), "untrained": np.ones(3)}, {"w": np.array([0.6, 0.8])}) == {
        "w": pytest.approx(1 / 9)
    }


class HeadOnly(classification.Task):
    """One update that trains the head alone: the hidden layer's variables are trained by no update."""

    def updates(self):
        return (Update("head", trains=r"/dense_1/"),)


@pytest.mark.parametrize("task", [SplitAtFrequencies, HeadOnly])
def test_each_updates_last_apply_is_returned_and_one_not_applied_moves_nothing(data_dir, one_device, monkeypatch, task):
    # SplitAtFrequencies: the body every 2nd step (counts 0, 2, ...), the head twice a step (repeat).
    monkeypatch.setattr(datasets, "task_class", lambda config: task)
    run = build.run(helpers.make_config(data_dir, **SGD), one_device)
    trained = [name for plan in run.plans for name in plan.names]
    iterator = run.program.train_iterator()
    for count in range(3):
        before = run.weights.arrays()
        _, extras = run.program.run_round(iterator, 1, {"updates"})
        after = run.weights.arrays()
        assert sorted(extras["updates"]) == sorted(trained)
        for name, update in extras["updates"].items():
            moved = after[name] - before[name]
            if "/dense/" in name:  # the body: one apply at an even count, none at an odd one
                np.testing.assert_array_equal(update, moved if count % 2 == 0 else np.zeros_like(moved))
                assert (np.abs(moved).max() > 0) == (count % 2 == 0), (name, count)
            elif task is HeadOnly:  # the head: one apply a step
                np.testing.assert_allclose(update, moved, rtol=1e-6, atol=1e-8)
            else:  # the head, applied twice: the second apply's change alone, less than the step's
                assert 0 < np.linalg.norm(update) < np.linalg.norm(moved) * 1.5, name
                assert not np.allclose(update, moved), name


def test_update_ratios_writes_no_point_where_an_update_did_not_move(data_dir, one_device, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "task_class", lambda config: SplitAtFrequencies)
    settings = dict(actions="update_ratios", update_ratio_every=1, train_steps=4, steps_per_loop=10, eval_every=0)
    workdir = str(tmp_path / "run")
    loop.train(helpers.make_config(data_dir, workdir, **SGD, **settings), one_device)
    written = _scalars(workdir)
    body = [tag for tag in written if "/dense/" in tag]
    head = [tag for tag in written if "/dense_1/" in tag]
    assert len(body) == len(head) == 2
    # Step k runs with count k - 1: the body applies at steps 1 and 3, its bias from all zeros at step 1 (no ratio);
    # the head twice every step, its second apply from weights the first moved.
    steps = {tag: sorted(written[tag]) for tag in written}
    assert steps["update_ratio/model/mlp/dense/kernel"] == [1, 3] and steps["update_ratio/model/mlp/dense/bias"] == [3]
    assert all(steps[tag] == [1, 2, 3, 4] for tag in head), steps


def test_update_ratios_leaves_out_a_variable_no_update_trains(data_dir, one_device, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "task_class", lambda config: HeadOnly)
    settings = dict(actions="update_ratios", update_ratio_every=2, train_steps=4, steps_per_loop=10, eval_every=0)
    workdir = str(tmp_path / "run")
    loop.train(helpers.make_config(data_dir, workdir, **SGD, **settings), one_device)
    steps = {tag: sorted(found) for tag, found in _scalars(workdir).items()}
    assert steps == {"update_ratio/model/mlp/dense_1/kernel": [2, 4], "update_ratio/model/mlp/dense_1/bias": [2, 4]}
