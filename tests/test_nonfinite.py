"""A non-finite gradient on ONE replica makes every replica skip the update; the loss scale halves,
then doubles after growth_interval finite steps."""

import os

import numpy as np
import pytest

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
