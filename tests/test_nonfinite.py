"""A non-finite gradient on ONE replica makes every replica skip the update; the loss scale halves,
then doubles after growth_interval finite steps. A run that skips most of a round's steps says so; one that skips
steps with the scale at its floor stops (exit 3)."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from engine.numerics import precision
from engine.run import loop
from tests import helpers

GROWTH = helpers.NONFINITE_CASE["loss_scale_growth_interval"]


@pytest.fixture(scope="module")
def config(data_dir):
    return helpers.make_config(data_dir, **helpers.NONFINITE_CASE)


def _first_replica(snapshot):
    return {k: v[0] for k, v in snapshot.items()}


def _check(before, after_bad, after_good, bad_out, good_finite, num_params):
    assert not bad_out["finite"]
    scale_index, good_index, iterations_index = "scale", "good_steps", "iterations"
    # Nothing moved on the bad step: weights, batch statistics, slots, update counter.
    for k in before:
        if k not in (scale_index, good_index):
            np.testing.assert_array_equal(after_bad[k], before[k], err_msg=f"variable {k} changed")
    assert after_bad[iterations_index] == 0
    assert after_bad[scale_index] == before[scale_index] / 2
    assert after_bad[good_index] == 0
    # GROWTH finite steps later the updates went through and the scale doubled back.
    assert all(good_finite)
    assert after_good[iterations_index] == GROWTH
    assert after_good[scale_index] == before[scale_index]
    assert any(not np.array_equal(after_good[f"weight/{i}"], before[f"weight/{i}"]) for i in range(num_params))


def test_mirrored_one_bad_replica_skips_everywhere(config, mirrored):
    before, after_bad, after_good, bad_out, good_outs = helpers.nonfinite_scenario(config, mirrored, bad_replica=1)
    for snap in (before, after_bad, after_good):
        for copies in snap.values():
            np.testing.assert_array_equal(copies[0], copies[1])  # replicas still identical
    _check(
        _first_replica(before),
        _first_replica(after_bad),
        _first_replica(after_good),
        bad_out,
        [o["finite"] for o in good_outs],
        num_params=2,
    )


@pytest.mark.slow
def test_multi_worker_one_bad_worker_skips_everywhere(multi_worker_dir):
    snaps = {}
    for name in ("before", "after_bad", "after_good"):
        workers = [dict(np.load(os.path.join(multi_worker_dir, f"nonfinite_{name}_worker{i}.npz"))) for i in (0, 1)]
        for k in workers[0]:
            np.testing.assert_array_equal(workers[0][k], workers[1][k])  # the two workers agree
        snaps[name] = workers[0]
    outs = dict(np.load(os.path.join(multi_worker_dir, "nonfinite_outs_worker0.npz")))
    _check(
        snaps["before"],
        snaps["after_bad"],
        snaps["after_good"],
        {"finite": outs["bad_finite"]},
        list(outs["good_finite"]),
        num_params=2,
    )


# ---- A float16 run that skips its steps ------------------------------------------------------------------------


def test_a_float16_run_skipping_most_of_its_steps_says_so_each_round(data_dir, one_device, tmp_path, capsys):
    # A scale of 1e30 overflows float16 at every step: it halves at each one, far from a scale that fits.
    config = helpers.make_config(
        data_dir,
        str(tmp_path),
        precision="mixed_float16",
        initial_loss_scale=1e30,
        train_steps=4,
        steps_per_loop=2,
        hidden_sizes=(8,),
        jit_compile=False,
    )
    summary = loop.train(config, one_device)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: mixed_float16: {steps} were skipped (non-finite gradients: nothing trained); the loss scale "
        f"halves at each skipped step and is now {scale:g} (--initial_loss_scale=1e+30)"
        for steps, scale in (("2 of the 2 steps 1-2", 2.5e29), ("2 of the 2 steps 3-4", 6.25e28))
    ]
    assert summary["skipped_steps"] == 4 and summary["loss_scale"] == pytest.approx(6.25e28, rel=1e-6)
    # Each line's loss scale is the one its last step left, as the warning and the summary say it.
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        logged = [json.loads(line)["loss_scale"] for line in f]
    assert logged == [pytest.approx(2.5e29, rel=1e-6), pytest.approx(6.25e28, rel=1e-6)]


@pytest.mark.slow
def test_a_float16_run_skipping_steps_at_the_scale_floor_stops_with_exit_3(data_dir, tmp_path):
    # A learning rate of 1e30 sends the weights past float16's range after the first step: from then on every
    # gradient is non-finite at any scale, and at a scale of 1 it can halve no further.
    result = helpers.launch(
        f"--workdir={tmp_path}",
        f"--data_dir={data_dir}",
        "--precision=mixed_float16",
        "--initial_loss_scale=1",
        "--learning_rate=1e30",
        "--hidden_sizes=8",
        "--jit_compile=false",
        "--train_steps=6",
        "--steps_per_loop=3",
        "--checkpoint_every=3",
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 3, result.stderr[-2000:]
    assert lines == [
        "error: training stopped: 2 of the 3 steps 1-3 had non-finite gradients with the loss scale at its floor "
        "(1), which no loss scale can fix (mixed_float16); last good checkpoint: none; lower --learning_rate or "
        "set --clip_norm"
    ]
    assert not (tmp_path / "summary.json").exists()


def test_an_update_that_trains_where_another_skips_logs_its_numbers(data_dir, one_device, monkeypatch):
    """float16, two updates: the hidden layer's gradients overflow (float16, a loss scale of 1e12), the float32 head's
    do not, so each step skips the body's update alone and the head trains on its due steps. The head's loss and
    gradient norm were dropped with the body's before (null: "-" on the console), its training unsaid."""
    from engine.api import Update
    from engine.data import datasets as data_lib
    from engine.run import build
    from tasks import classification

    class Task(classification.Task):
        def updates(self):
            return (Update("body", trains=r"/dense/"), Update("head", trains=r"/dense_1/", every=2))

    monkeypatch.setattr(data_lib, "task_class", lambda config: Task)
    config = helpers.make_config(
        data_dir, precision="mixed_float16", initial_loss_scale=1e12, optimizer="sgd", hidden_sizes=(8,)
    )
    trainer = build.run(config, one_device)
    out = trainer.program.run_steps(trainer.program.train_iterator(), 4)
    iterations = {plan.name: int(plan.optimizer.iterations.numpy()) for plan in trainer.plans}
    assert iterations == {"body": 0, "head": 2}  # the head trained at steps 0 and 2, the body never
    assert out["skipped"] == 4
    assert np.isnan(out["body/loss"]) and np.isnan(out["body/grad_norm"])
    assert 2.0 < out["head/loss"] < 3.0 and 0.0 < out["head/grad_norm"] < 10.0, out


def test_the_loss_scale_never_doubles_past_float32s_largest_number():
    # A scale of inf would halve to inf: every later step skipped, above the floor, the run ending as if it trained.
    largest = precision.LossScale(2.0**127, growth_interval=1)
    scale, good = largest.next_state(tf.constant(True))
    assert float(scale) == 2.0**127 and int(good) == 0
    scale, good = precision.LossScale(2.0**15, growth_interval=1).next_state(tf.constant(True))
    assert float(scale) == 2.0**16 and int(good) == 0  # below it, growth as before


def test_a_float16_run_whose_gradients_stay_in_float32_keeps_a_finite_loss_scale(data_dir, one_device, tmp_path):
    # Only the float32 head trains (the float16 hidden layer frozen): nothing overflows float16 to stop the growth,
    # and a scale doubled at every step reaches float32's largest number within a few steps.
    config = helpers.make_config(
        data_dir,
        str(tmp_path),
        precision="mixed_float16",
        initial_loss_scale=2.0**124,
        loss_scale_growth_interval=1,
        freeze="^model/mlp/dense/",
        train_steps=8,
        steps_per_loop=4,
        hidden_sizes=(8,),
        jit_compile=False,
    )
    summary = loop.train(config, one_device)
    assert summary["skipped_steps"] == 0 and summary["loss_scale"] == 2.0**127
    assert summary["train_loss"] is not None
