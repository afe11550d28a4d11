"""The worked example of a fork's action (engine/run/actions/histograms.py), in a real run: the weights' and their
gradients' histograms in TensorBoard at every --histogram_every steps, whatever the round's length, each of the
weights as they stood at its step."""

import os
from types import SimpleNamespace

import numpy as np

from engine.run import build, loop
from engine.run.actions import base, histograms
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


class _Report:
    chief = True

    def __init__(self):
        self.written, self.lines = {}, []

    def histograms(self, step, values):
        self.written[step] = values

    def line(self, text):
        self.lines.append(text)


def test_a_skipped_float16_steps_gradients_that_are_not_finite_write_no_histogram():
    # Before: a skipped step's gradients (inf, NaN) were written as histograms of no values between NaN edges.
    report = _Report()
    weights = SimpleNamespace(arrays=lambda: {"m/kernel": np.ones(3), "m/bias": np.zeros(2)})
    context = SimpleNamespace(run=SimpleNamespace(weights=weights), report=report)
    gradients = {"m/kernel": np.array([np.inf, 1.0, 2.0]), "m/bias": np.array([np.nan, 0.5]), "m/ok": np.ones(2)}
    done = base.Round(0, 5, 1.0, {}, base.Extras({"gradients": gradients}))
    histograms.Action(SimpleNamespace(histogram_every=5))(done, context)
    assert sorted(report.written[5]) == ["gradients/m/ok", "weights/m/bias", "weights/m/kernel"]
    # And said: nothing was written of them, unsaid, in float32 too.
    assert report.lines == ["histograms: step 5: the gradient of m/kernel and 1 more is not finite: no histogram of it"]
