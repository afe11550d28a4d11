"""An action that needs the step's updates (engine/run/actions/update_ratios.py): the change each apply made to the
variables, returned by the round's last step, is the weights' change itself (plain SGD: -learning rate x the
gradients it applied), the same on two mirrored replicas as on one device; in a real run the action logs each
variable's ||update|| / ||weights before it|| at every --update_ratio_every steps."""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from engine.run import build, loop
from engine.run.actions.update_ratios import ratios
from tests import helpers

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
    found = {}
    for path in sorted(glob.glob(os.path.join(workdir, "train", "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("update_ratio/"):
                    found.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    return found


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


def test_a_variable_that_was_zero_has_no_ratio():
    found = ratios({"w": np.array([3.0, 4.0]), "b": np.array([0.5])}, {"w": np.array([3.0, 4.0]), "b": [0.5]})
    assert np.isnan(found["w"]) and np.isnan(found["b"])  # both were all zeros before their update
    assert ratios({"w": np.array([6.0, 8.0])}, {"w": np.array([0.6, 0.8])}) == {"w": pytest.approx(1 / 9)}
