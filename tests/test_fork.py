"""Forking the engine: a new data source, model, task and custom step are one new file each, and train with no
other edit. The worked example of docs/forking.md is tests/fork_example/, laid out as the files
go in a fork; this test copies the repository, adds those files, and trains them through launch.py."""

import filecmp
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import ROOT, copy_checkout

EXAMPLE = os.path.join(ROOT, "tests", "fork_example")
STEPS = 200  # what docs/forking.md's commands run


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    """A copy of the repository with the example's files added: the repository itself is never touched."""
    path = str(tmp_path_factory.mktemp("fork") / "engine")
    copy_checkout(path)
    added = []
    for directory, _, files in os.walk(EXAMPLE):
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(directory, name), EXAMPLE)
                source, target = os.path.join(EXAMPLE, relative), os.path.join(path, relative)
                # New, or already copied in as docs/forking.md shows: no file of the engine is edited.
                assert not os.path.exists(target) or filecmp.cmp(source, target, shallow=False), relative
                shutil.copy(source, target)
                added.append(relative)
    assert sorted(added) == [
        "models/fourier.py",
        "sources/spirals.py",
        "tasks/binary.py",
        "tasks/binary_mixup.py",
    ]
    return path


def _launch(fork, *args):
    """`python launch.py ARGS` in the fork; returns its standard output."""
    result = subprocess.run([sys.executable, "launch.py", *args], cwd=fork, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _train(fork, task, workdir):
    """Trains --task=TASK with the new model as docs/forking.md shows; returns the run's summary."""
    out = _launch(
        fork,
        f"--task={task}",
        "--model=fourier",
        f"--train_steps={STEPS}",
        "--learning_rate=1e-2",
        f"--workdir={workdir}",
    )
    assert "test accuracy " in out, out[-2000:]  # the task's headline
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def binary(fork, tmp_path_factory):
    return _train(fork, "binary", str(tmp_path_factory.mktemp("binary")))


@pytest.mark.slow
def test_a_forked_task_model_and_source_train_with_no_other_edit(binary):
    assert binary["step"] == STEPS and binary["eval"]["examples"] == 500
    assert binary["eval"]["accuracy"] >= 0.97  # 0.998 measured; an MLP with 64 hidden units reaches 0.90
    assert binary["eval"]["brier"] < 0.03


@pytest.mark.slow
def test_a_custom_step_is_one_more_task_file(fork, binary, tmp_path):
    mixup = _train(fork, "binary_mixup", str(tmp_path / "mixup"))
    assert mixup["eval"]["accuracy"] >= 0.97  # 0.994 measured
    # Mixed labels are soft: their cross-entropy stays far above the plain task's (0.27 against 0.0033 measured).
    assert mixup["train_loss"] > 10 * binary["train_loss"]
    # Export serves the task's signature: the point in, the logit out (mixing happens in training only).
    out = _launch(fork, "--mode=export", f"--workdir={tmp_path / 'mixup'}")
    assert "(serving_default: point float32 [None, 2] -> outputs)" in out, out
    served = tf.saved_model.load(str(tmp_path / "mixup" / "export" / str(STEPS))).signatures["serving_default"]
    logits = served(point=tf.constant([[0.0, 0.0], [0.3, -0.2], [-0.5, 0.5]]))["outputs"].numpy()
    assert logits.shape == (3, 1) and np.isfinite(logits).all()


def test_the_public_face_loads_no_part_of_the_run_that_builds_plugins():
    # Every bundled task and source imports engine.api; the run's composition (engine/run/build.py and what it
    # builds) imports the tasks and sources. The face that plugins import reaches only the wings below the run's
    # composition, so loading a plugin never loads the machinery that loads it.
    code = (
        "import sys, engine.api, tasks.classification, sources.digits; "
        "print(sorted(m for m in sys.modules if m.startswith('engine.run.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # The action interface and a run's inputs (training_batches), nothing that composes or drives a run.
    loaded = out.stdout.strip().splitlines()[-1]
    assert loaded == "['engine.run.actions', 'engine.run.actions.base', 'engine.run.inputs']"


def test_a_reference_script_that_leaves_its_training_batches_open_exits(tmp_path):
    """docs/forking.md's reference reads `engine.api.training_batches(config)` and takes the batches it needs: a
    script that keeps the generator at its top level and ends (or fails) with it open closes it as the interpreter
    finalizes. Closing it started a thread then, which Python 3.11 never runs while Thread.start waits for it: the
    script printed its result and hung forever."""
    script = (
        "import sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from engine.api import training_batches\n"
        "from engine.settings.config import validate\n"
        "from engine.settings.fields import Config\n"
        f"config = validate(Config(train_steps=2, global_batch_size=8, data_dir={str(tmp_path / 'data')!r}))\n"
        "stream = training_batches(config)\n"
        "print('batch', next(stream)['image'].shape, flush=True)\n"
    )
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script hung after it ended: {e.stdout!r}")
    assert result.returncode == 0 and result.stdout.endswith("batch (8, 8, 8, 1)\n"), result.stderr[-2000:]


def test_a_reference_reads_a_runs_config_back_through_the_public_face(data_dir, tmp_path, one_device):
    """A fork's reference needs the run's Config for training_batches; engine.api offered no way to read it back."""
    import dataclasses

    from engine.api import run_config, training_batches
    from engine.run import loop
    from tests import helpers

    config = helpers.make_config(
        data_dir, str(tmp_path / "run"), train_steps=1, global_batch_size=8, jit_compile="false", seed=7
    )
    loop.train(config, one_device)
    read = run_config(config.workdir)
    assert (read.seed, read.global_batch_size, read.train_steps) == (7, 8, 1)
    ours, theirs = next(training_batches(read)), next(training_batches(dataclasses.replace(config)))
    np.testing.assert_array_equal(ours["image"], theirs["image"])
    assert run_config(str(tmp_path / "none")) is None


def test_a_fork_the_tests_make_holds_the_engine_and_not_the_checkouts_environments(tmp_path):
    """.ci/run makes .venv-torch in the checkout (a gigabyte): each fork a test made copied it, and .gpu's packed
    TensorFlow, for a run that reads neither."""
    root = tmp_path / "checkout"
    for path in (
        "launch.py",
        "engine/a.py",
        "sources/data/d.npz",
        ".venv-torch/lib/torch.py",
        ".venv/bin/python",
        ".gpu/tf.00",
        ".git/HEAD",
        "runs/r/metrics.jsonl",
        "tests/test_a.py",
        "engine/__pycache__/a.pyc",
    ):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(path)
    fork = copy_checkout(tmp_path / "fork", root)
    copied = sorted(os.path.relpath(os.path.join(d, n), fork) for d, _, names in os.walk(fork) for n in names)
    assert copied == ["engine/a.py", "launch.py", "sources/data/d.npz"]
