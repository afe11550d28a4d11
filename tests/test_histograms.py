"""The worked example of a fork's action (engine/run/actions/histograms.py), in a real run: the weights' and their
gradients' histograms in TensorBoard at every --histogram_every steps, whatever the round's length, each of the
weights as they stood at its step."""

import os

import numpy as np

from engine.run import build, loop
from tests import helpers


def _histograms(workdir):
    """{tag: {step: buckets [k, 3] (left edge, right edge, count)}} of the train run's TensorBoard events."""
    return helpers.tensorboard_values(
        os.path.join(workdir, "train"), lambda value: value.metadata.plugin_data.plugin_name == "histograms"
    )


def test_histograms_of_the_weights_and_gradients_at_every_histogram_every_steps(data_dir, one_device, tmp_path):
    settings = dict(actions="histograms", histogram_every=3, train_steps=10, steps_per_loop=10, eval_every=0)
    workdir = str(tmp_path / "run")
    loop.train(helpers.make_config(data_dir, workdir, **settings), one_device)
    written = _histograms(workdir)

    reference = build.run(helpers.make_config(data_dir, **settings), one_device)
    names, variables = reference.weights.names, reference.weights.variables
    assert sorted(written) == sorted([f"weights/{name}" for name in names] + [f"gradients/{name}" for name in names])
    assert all(sorted(steps) == [3, 6, 9] for steps in written.values()), {k: sorted(v) for k, v in written.items()}
    for step in (3, 6, 9):  # the weights as they stood after that step: the same run, trained to it alone
        reference.program.run_steps(reference.program.train_iterator(), 3)
        for name, variable in zip(names, variables):
            buckets, value = written[f"weights/{name}"][step], variable.numpy()
            assert buckets[:, 2].sum() == value.size, name
            np.testing.assert_allclose([buckets[0, 0], buckets[-1, 1]], [value.min(), value.max()], rtol=1e-6)
            assert written[f"gradients/{name}"][step][:, 2].sum() == value.size, name
