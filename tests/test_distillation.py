"""--task=distillation: a student learns from a frozen teacher restored from another run's workdir."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from engine.run import build, loop
from engine.run import modes as evaluate
from engine.settings.errors import ConfigError
from engine.state.warm_start import warm_start
from tests.helpers import checkpoint_tensors, launch, make_config

SUFFIX = ".ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture(scope="module")
def teacher(data_dir, tmp_path_factory):
    """A digits MLP (64,) trained for 20 steps."""
    workdir = str(tmp_path_factory.mktemp("teacher"))
    config = make_config(data_dir, workdir, hidden_sizes=(64,))
    loop.train(config, tf.distribute.OneDeviceStrategy("/cpu:0"))
    return workdir


def student_config(data_dir, workdir, teacher, **overrides):
    return make_config(data_dir, workdir, task="distillation", teacher=teacher, hidden_sizes=(16,), **overrides)


@pytest.fixture(scope="module")
def distilled(data_dir, teacher, tmp_path_factory):
    """A student MLP (16,) distilled from the teacher for 10 steps: its workdir and summary."""
    workdir = str(tmp_path_factory.mktemp("student"))
    config = student_config(data_dir, workdir, teacher, train_steps=10)
    return workdir, loop.train(config, tf.distribute.OneDeviceStrategy("/cpu:0"))


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_the_loss_is_hintons_soft_and_hard_targets(data_dir, teacher, one_device):
    config = student_config(data_dir, "unused", teacher, distill_temperature=2.5, distill_weight=0.7)
    trainer = build.run(config, one_device)
    assert list(trainer.models) == ["model", "teacher"] and not trainer.models["teacher"].trainable_variables
    assert [v.path for v in trainer.weights.variables] == [v.path for v in trainer.models["model"].trainable_variables]
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    student = trainer.models["model"](batch["image"]).numpy().astype(np.float64)
    taught = trainer.models["teacher"](batch["image"]).numpy().astype(np.float64)
    labels = batch["label"].numpy()
    soft = np.exp(log_softmax(taught / 2.5))
    kl = (soft * (log_softmax(taught / 2.5) - log_softmax(student / 2.5))).sum(axis=-1)
    hard = -log_softmax(student)[np.arange(len(labels)), labels]
    expected = np.mean(0.7 * 2.5**2 * kl + 0.3 * hard)
    assert abs(expected - hard.mean()) > 0.1  # the soft term counts
    out = trainer.program.run_steps(
        trainer.program.train_iterator(), 1
    )  # the first step's loss, at the weights read above
    assert out["loss"] == pytest.approx(expected, rel=1e-5)


def test_the_teacher_stays_as_trained_and_export_serves_the_student(data_dir, teacher, distilled):
    workdir, summary = distilled
    trained, taught = checkpoint_tensors(workdir)[1], checkpoint_tensors(teacher)[1]
    frozen = {k: v for k, v in trained.items() if k.startswith("models/teacher/")}
    assert len(frozen) == 4  # mlp/dense and mlp/dense_1 (the head), kernel and bias
    for key, value in frozen.items():
        np.testing.assert_array_equal(value, taught[key.replace("models/teacher/", "models/model/")], err_msg=key)
    with open(os.path.join(teacher, "summary.json")) as f:
        teacher_accuracy = json.load(f)["eval"]["accuracy"]
    assert sorted(summary["eval"]) == ["accuracy", "examples", "loss", "teacher_accuracy"]
    assert summary["eval"]["teacher_accuracy"] == pytest.approx(teacher_accuracy, abs=1e-6)

    export_dir = evaluate.export(student_config(data_dir, workdir, teacher, mode="export"))
    served = tf.saved_model.load(export_dir)
    stored = tf.train.load_checkpoint(os.path.join(export_dir, "variables", "variables")).get_variable_to_shape_map()
    # The student's weights alone, and the names of its classes (the export says what it predicts).
    assert sorted(k for k in stored if k.endswith("VARIABLE_VALUE")) == [
        "class_names/.ATTRIBUTES/VARIABLE_VALUE",
        *(
            f"variables_by_path/model/mlp.Sdense{layer}.S{kind}/.ATTRIBUTES/VARIABLE_VALUE"
            for layer in ("", "_1")
            for kind in ("bias", "kernel")
        ),
    ]
    images = np.random.default_rng(0).uniform(size=(3, 8, 8, 1)).astype(np.float32)
    logits = served.signatures["serving_default"](images=images)["logits"].numpy()
    weight = {k.split("/")[2]: v for k, v in trained.items() if k.startswith("models/model/")}
    hidden = np.maximum(images.reshape(3, 64) @ weight["mlp.Sdense.Skernel"] + weight["mlp.Sdense.Sbias"], 0)
    np.testing.assert_allclose(
        logits, hidden @ weight["mlp.Sdense_1.Skernel"] + weight["mlp.Sdense_1.Sbias"], atol=1e-5
    )


def test_export_called_directly_serves_the_student_whatever_the_configs_mode(data_dir, teacher, distilled, tmp_path):
    # A notebook hands export() the run's Config as it trained (--mode=train): the function is the mode, so the
    # SavedModel holds the student alone, as --mode=export's does.
    workdir, _ = distilled
    export_dir = evaluate.export(student_config(data_dir, workdir, teacher, export_dir=str(tmp_path / "served")))
    stored = tf.train.load_checkpoint(os.path.join(export_dir, "variables", "variables")).get_variable_to_shape_map()
    assert [k for k in stored if "teacher" in k] == []
    assert len([k for k in stored if k.startswith("variables_by_path/model/")]) == 4


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            (),
            "--teacher=: --task=distillation needs it (workdir of a trained classification run; its model, frozen, "
            "supplies the soft targets)",
        ),
        (("--teacher=t", "--distill_weight=1.5"), "--distill_weight=1.5: must be in [0.0, 1.0]"),
        (("--teacher=t", "--distill_temperature=0"), "--distill_temperature=0.0: must be a positive number"),
    ],
)
def test_bad_distillation_flags_are_refused(tmp_path, flags, error):
    result = launch("--task=distillation", *flags, f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert result.stderr == f"error: {error}\n"
    assert not os.path.exists(tmp_path / "run")


def test_a_teacher_workdir_that_holds_no_trained_run_is_refused_by_name(data_dir, teacher, tmp_path, one_device):
    empty, untrained, elsewhere = (str(tmp_path / name) for name in ("empty", "untrained", "elsewhere"))
    os.makedirs(empty)
    os.makedirs(untrained)
    shutil.copy(os.path.join(teacher, "config.json"), untrained)
    shutil.copytree(teacher, elsewhere)
    with open(os.path.join(elsewhere, "config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(elsewhere, "config.json"), "w") as f:
        json.dump({**saved, "dataset": "synthetic"}, f)
    for where, why in (
        (empty, "no config.json there; name the workdir of a trained run"),
        (untrained, f"neither a checkpoint (no {untrained}.index) nor a workdir with checkpoints"),
        (elsewhere, "trained on --dataset=synthetic, not this run's digits"),
    ):
        workdir = str(tmp_path / "student")
        with pytest.raises(ConfigError, match=f"^--teacher={where}: {why}$".replace("(", r"\(").replace(")", r"\)")):
            loop.train(student_config(data_dir, workdir, where), one_device)
        assert not os.path.exists(workdir)


def test_a_teacher_trained_on_classes_named_otherwise_is_refused(data_dir, teacher, tmp_path, one_device):
    """A class folder renamed or added since the teacher trained moves the labels: its outputs would teach each label
    as another class. The renamed one was taken silently; the added one blamed the teacher's checkpoint."""
    with open(os.path.join(teacher, "config.json")) as f:
        saved = json.load(f)
    for names, why in (
        (["1", "0", *saved["class_names"][2:]], "label 0 is '0' here, '1' in the run of"),
        ([*saved["class_names"], "10"], "it has 10 classes here, 11 in the run of"),
    ):
        moved = str(tmp_path / f"moved{len(names)}")
        shutil.copytree(teacher, moved)
        with open(os.path.join(moved, "config.json"), "w") as f:
            json.dump({**saved, "class_names": names}, f)
        workdir = str(tmp_path / "student")
        with pytest.raises(ConfigError) as caught:
            loop.train(student_config(data_dir, workdir, moved), one_device)
        assert str(caught.value) == (
            f"--teacher={moved}: {why} {moved} ({moved}/config.json): its outputs would mean other classes than this "
            "run's labels"
        )
        assert not os.path.exists(workdir)


@pytest.mark.slow
def test_init_checkpoint_starts_the_student_and_leaves_the_teacher_as_trained(data_dir, teacher, tmp_path, one_device):
    """A student of the teacher's shape, warm-started from another run of that shape: the frozen teacher keeps
    its own weights, not that run's."""
    source = str(tmp_path / "source")
    loop.train(make_config(data_dir, source, hidden_sizes=(64,), seed=1, train_steps=10), one_device)
    workdir = str(tmp_path / "student")
    config = student_config(data_dir, workdir, teacher, init_checkpoint=source, train_steps=10)
    loop.train(dataclasses.replace(config, hidden_sizes=(64,)), one_device)
    trained, taught = checkpoint_tensors(workdir)[1], checkpoint_tensors(teacher)[1]
    frozen = {k: v for k, v in trained.items() if k.startswith("models/teacher/")}
    assert len(frozen) == 4
    for key, value in frozen.items():
        np.testing.assert_array_equal(value, taught[key.replace("models/teacher/", "models/model/")], err_msg=key)


def test_init_checkpoint_from_a_distillation_run_takes_its_student(data_dir, distilled, one_device):
    """Its checkpoint holds two models with the same paths (mlp/dense/kernel, ...): a run warm-started from it
    gets the student's weights, whatever order the checkpoint lists them in."""
    workdir, _ = distilled
    trainer = build.run(make_config(data_dir, hidden_sizes=(16,), init_checkpoint=workdir), one_device)
    found = warm_start(trainer.models, workdir)
    assert (found["matched"], found["missing"], found["reshaped"]) == (
        ["mlp/dense/kernel", "mlp/dense/bias", "mlp/dense_1/kernel", "mlp/dense_1/bias"],
        [],
        [],
    )
    student = {k: v for k, v in checkpoint_tensors(workdir)[1].items() if k.startswith("models/model/")}
    for v in trainer.model.variables:
        np.testing.assert_array_equal(v.numpy(), student[f"models/model/{v.path.replace('/', '.S')}/{SUFFIX}"])
