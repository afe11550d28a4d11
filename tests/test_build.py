"""One place builds a run (engine/run/build.py, in engine/run/program.py's order): the data receives its task, a model
factory receives its input's spec and what the source knows of it, a task asks the engine for another run's trained
model, and what a checkpoint holds is one named State."""

import dataclasses
import os
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import models
from engine.data import datasets as data
from engine.numerics.updates import Update
from engine.run import build, inputs, loop
from engine.settings.errors import ConfigError, TaskError
from engine.state import checkpoint as checkpoint_lib
from engine.state import workdir
from tasks import classification
from tests import helpers

# A model of a fork that sizes its embedding from the source's vocabulary, which the task never hands it: a
# character tagger's shape. It reads one logit per token and class, as tasks/language_model.py's model does.
TAGGER = """
import tensorflow as tf

keras = tf.keras


def create(config, spec, outputs, info):
    del config, spec
    return keras.Sequential(
        [keras.layers.Embedding(len(info["vocabulary"]), 8, name="embed"), keras.layers.Dense(outputs, name="head")],
        name="tagger",
    )
"""

# A factory of the older form: create(config, input_shape, outputs). It records what it was handed.
OLD_FORM = """
import tensorflow as tf

received = []


def create(config, input_shape, outputs):
    received.append(input_shape)
    return tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(outputs)], name="old")
"""


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """write(name, text): models/<name>.py as a fork adds it, found by the engine for this test only."""
    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(folder)])
    written = []

    def write(name, text):
        (folder / f"{name}.py").write_text(text)
        written.append(f"models.{name}")
        return name

    yield write
    for module in written:
        sys.modules.pop(module, None)


def _language_model(model):
    # Validated with a bundled model, then given the fork's: --model accepts the files of models/ only.
    config = helpers.make_config(
        "", task="language_model", model="gpt", sequence_length=16, global_batch_size=16, eval_batch_size=64
    )
    return dataclasses.replace(config, model=model, learning_rate=1e-2)


def test_a_model_file_sizes_its_embedding_from_the_sources_vocabulary(model_file, one_device):
    trainer = build.run(_language_model(model_file("tagger", TAGGER)), one_device)
    vocabulary = trainer.task.info["vocabulary"]
    assert len(vocabulary) == 65
    embed = trainer.model.get_layer("embed")
    assert tuple(embed.embeddings.shape) == (65, 8)  # from info, not from the task: it hands the model outputs only
    before = embed.embeddings.numpy()
    first = trainer.program.run_steps(trainer.program.train_iterator(), 1)
    later = trainer.program.run_steps(trainer.program.train_iterator(), 20)
    assert first["loss"] == pytest.approx(np.log(65), abs=0.05)  # a fresh head guesses every character alike
    assert later["loss"] < first["loss"] - 0.1  # it trains
    assert not np.array_equal(before, embed.embeddings.numpy())


def test_a_factory_of_the_older_form_gets_the_shape_as_a_tuple(model_file, data_dir, one_device):
    config = dataclasses.replace(helpers.make_config(data_dir), model=model_file("old", OLD_FORM))
    trainer = build.run(config, one_device)
    assert sys.modules["models.old"].received == [(8, 8, 1)]
    assert trainer.model.name == "old" and trainer.program.run_steps(trainer.program.train_iterator(), 1)["steps"] == 1


SCALED = """
class Scaled(keras.Model):
    def __init__(self):
        super().__init__(name="scaled")
        self.flatten, self.head = keras.layers.Flatten(), keras.layers.Dense(10, name="head")
        self.temperature = tf.Variable(1.0)

    def call(self, x, training=False):
        return self.head(self.flatten(x)) / self.temperature


"""

TWICE = """
class Twice(keras.Model):
    def __init__(self):
        super().__init__(name="twice")
        self.flatten, self.head = keras.layers.Flatten(), keras.layers.Dense(10, name="dense")
        self.tail = keras.layers.Dense(10, name="dense")

    def call(self, x, training=False):
        return self.tail(self.head(self.flatten(x)))


"""

NAMED = """
class Named(keras.Model):
    def __init__(self):
        super().__init__(name="named")
        self.flatten, self.head = keras.layers.Flatten(), keras.layers.Dense(10, name="head")

    def call(self, x, training=False):
        return {"logits": self.head(self.flatten(x))}


"""

# Batch norm (Keras's, not synchronized) and dropout; NOISY, a layer called only in training (a noise branch),
# whose variables were made inside the traced step: never trained nor checkpointed, drawn afresh by every process.
NORMED = """
import tensorflow as tf

keras = tf.keras

class Normed(keras.Model):
    def __init__(self, outputs):
        super().__init__(name="normed")
        self.flatten, self.norm = keras.layers.Flatten(), keras.layers.BatchNormalization(name="norm")
        self.noise, self.drop = keras.layers.Dense(64, name="noise"), keras.layers.Dropout(0.5, name="drop")
        self.head = keras.layers.Dense(outputs, dtype="float32", name="head")

    def call(self, x, training=False):
        x = self.drop(self.norm(self.flatten(x), training=training), training=training)
        return self.head(x + self.noise(x) if training and NOISY else x)


def create(config, spec, outputs, info):
    return Normed(outputs)
"""


def _family(body, signature="config, spec, outputs, info"):
    return f"import tensorflow as tf\nkeras = tf.keras\n\n\ndef create({signature}):\n    {body}\n"


MODEL_MISTAKES = {
    # Each was a traceback from deep in the engine, or a run: a width of 7 for 10 classes trained, exit 0.
    "a function": (_family("return lambda x: x"), "create returned a function, not a keras.Model"),
    "None": (_family("return None"), "create returned None, not a keras.Model"),
    "two parameters": (
        _family("return None", "config, outputs"),
        "create(config, outputs) is called as create(config, spec, outputs, info)",
    ),
    "a wrong width": (
        _family("return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(7, dtype='float32')])"),
        "its model's output for a batch of 1 is of shape (1, 7); the task reads 10 values per example",
    ),
    "no batch dimension of its own": (
        _family(
            "return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(10), keras.layers.Reshape((10, 1))])"
        ),
        "its model's output for a batch of 1 is of shape (1, 10, 1); the task reads 10 values per example",
    ),
    # A TypeError in tasks/classification.py's loss, which blamed the task's line ("Expected any non-tensor type").
    "a dict of outputs": (
        _family("return Named()").replace("def create", NAMED + "def create"),
        "its model returns a dict; --task=classification reads one tensor of outputs per example",
    ),
    # These two trained, exit 0: the tf.Variable neither trained nor checkpointed, one layer's weights saved over
    # the other's (a message that named --model=twice, a flag value nobody typed).
    "a tf.Variable of its own": (
        _family("return Scaled()").replace("def create", SCALED + "def create"),
        "its layer 'scaled' holds a tf.Variable in self.temperature, which a Keras 3 model does not track",
    ),
    "two layers of one name": (
        _family("return Twice()").replace("def create", TWICE + "def create"),
        "2 of its model's variables have the path twice/dense/kernel; give its layers names of their own",
    ),
}


@pytest.mark.parametrize("mistake", MODEL_MISTAKES)
def test_a_model_file_the_engine_cannot_train_is_one_line_naming_it(model_file, data_dir, one_device, mistake):
    text, why = MODEL_MISTAKES[mistake]
    config = dataclasses.replace(helpers.make_config(data_dir), model=model_file("mine", text))
    with pytest.raises(TaskError) as refused:
        build.run(config, one_device)
    assert str(refused.value).startswith(f"models/mine.py: {why}"), str(refused.value)


def test_a_model_of_a_dict_of_outputs_is_one_line_naming_it_under_the_contrastive_task(
    model_file, data_dir, one_device
):
    # Was a ValueError blamed on tasks/contrastive.py's forward line, where the head called on the dict failed.
    text = _family("return Named()").replace("def create", NAMED + "def create")
    config = dataclasses.replace(helpers.make_config(data_dir), task="contrastive", model=model_file("mine", text))
    with pytest.raises(TaskError) as refused:
        build.run(config, one_device)
    assert str(refused.value).startswith(
        "models/mine.py: its model returns a dict; --task=contrastive reads one tensor of outputs per example"
    ), str(refused.value)


def test_a_layer_called_only_in_training_is_one_line_naming_its_file(model_file, data_dir, one_device):
    config = dataclasses.replace(
        helpers.make_config(data_dir), model=model_file("normed", NORMED.replace("NOISY", "True"))
    )
    trainer = build.run(config, one_device)
    with pytest.raises(TaskError) as refused:
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
    assert str(refused.value).startswith(
        "models/normed.py: its model made variables as the step was traced (normed/noise/kernel and 1 more): a layer "
        "called only when training"
    ), str(refused.value)


def test_batch_norm_that_is_not_synchronized_stays_alike_on_every_replica(model_file, data_dir, mirrored):
    # Keras's BatchNormalization (not synchronized) moved each replica's statistics by its own examples: the
    # replicas drifted apart, evaluated unlike one another and checkpointed only the first's.
    config = dataclasses.replace(
        helpers.make_config(data_dir, train_steps=5), model=model_file("normed", NORMED.replace("NOISY", "False"))
    )
    snap, _ = helpers.train_and_snapshot(config, mirrored)
    statistics = [copies for name, copies in snap.items() if name.startswith("state/") and copies[0].dtype.kind == "f"]
    assert len(statistics) == 2 and np.any(statistics[0][0] != 0)  # the moving mean moved
    for name, copies in snap.items():
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)


def test_a_model_without_trainable_variables_and_a_half_precision_output_are_said(
    model_file, data_dir, one_device, capsys
):
    # Nothing to train blamed --freeze, which nobody gave; a last layer in bfloat16 trained without a word.
    still = _family("return keras.Sequential([keras.layers.Flatten(), keras.layers.Lambda(lambda x: x[:, :10])])")
    config = dataclasses.replace(helpers.make_config(data_dir), model=model_file("still", still))
    with pytest.raises(
        ConfigError, match=r"^the run's models \(model\) have no trainable variables: nothing to train$"
    ):
        build.run(config, one_device)
    half = _family("return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(10)])")
    config = dataclasses.replace(
        helpers.make_config(data_dir, precision="mixed_bfloat16"), model=model_file("half", half)
    )
    build.run(config, one_device)
    assert "warning: models/half.py: its output is bfloat16 under --precision=mixed_bfloat16" in capsys.readouterr().out


def test_the_data_receives_the_task_built_before_it(data_dir):
    config = helpers.make_config(data_dir)
    source, task = inputs.source_and_task(config)
    assert type(task) is classification.Task and task.info is source.info
    prepared = data.prepare(config.data, source, task)
    assert prepared.task is task and task.spec == prepared.spec
    assert prepared.spec["image"] == tf.TensorSpec([8, 8, 1], tf.float32)  # the task's prepare: scaled floats
    loaded = inputs.run_data(config)  # what evaluation and research read: built the same way
    assert type(loaded.task) is classification.Task and loaded.spec == prepared.spec


def test_a_trained_model_of_another_task_is_refused_naming_the_flag(data_dir, tmp_path):
    other = str(tmp_path / "other")
    os.makedirs(other)
    regression = types.SimpleNamespace(class_names=None)  # a task without classes, as a regression run's
    workdir.write_config(helpers.make_config(data_dir, other, task="regression", dataset="synthetic"), regression)
    create = build.Create(helpers.make_config(data_dir), {})
    with pytest.raises(ConfigError, match=rf"^--teacher={other}: a --task=regression run; the teacher must be a "):
        create.trained(other, tf.TensorSpec([8, 8, 1]), 10, flag="teacher", task="classification")


def test_a_trained_model_is_rebuilt_restored_and_frozen(data_dir, tmp_path, one_device, capsys):
    teacher = str(tmp_path / "teacher")
    config = helpers.make_config(data_dir, teacher, hidden_sizes=(16,), train_steps=10)
    loop.train(config, one_device)
    create = build.Create(helpers.make_config(data_dir, hidden_sizes=(4,)), {})  # this run's own model differs
    capsys.readouterr()
    with one_device.scope():
        model = create.trained(teacher, tf.TensorSpec([8, 8, 1]), 10, flag="teacher", task="classification")
    assert capsys.readouterr().out == f"teacher: 4 variables from {teacher}/checkpoints/ckpt-10\n"
    # A run that restores its own checkpoint takes the teacher frozen there: the line named the teacher's newest.
    for restoring in (dict(mode="eval"), dict(workdir=teacher)):
        again = build.Create(helpers.make_config(data_dir, **{"hidden_sizes": (4,), **restoring}), {})
        with one_device.scope():
            again.trained(teacher, tf.TensorSpec([8, 8, 1]), 10, flag="teacher", task="classification")
        said = capsys.readouterr().out
        assert said == f"teacher: the model of {teacher}, its weights as this run's checkpoint holds them\n", said
    _, saved = helpers.checkpoint_tensors(teacher)
    assert not model.trainable and [tuple(v.shape) for v in model.variables] == [(64, 16), (16,), (16, 10), (10,)]
    for v in model.variables:
        key = f"models/model/{v.path.replace('/', '.S')}/.ATTRIBUTES/VARIABLE_VALUE"
        np.testing.assert_array_equal(v.numpy(), saved[key], err_msg=key)


COUNTS = ("skipped", "step")


class TwoUpdates(classification.Task):
    def updates(self):
        return (Update("body", trains=r"/dense/"), Update("head", trains=r"/dense_1/"))


@pytest.mark.parametrize(
    "task, overrides, keys",
    [
        (None, {}, ["actions", "batches", "input_pipelines", "loss_scale", "models", "optimizer", *COUNTS]),
        (
            None,
            {"ema_decay": 0.9},
            ["actions", "batches", "ema", "input_pipelines", "loss_scale", "models", "optimizer", *COUNTS],
        ),
        (TwoUpdates, {}, ["actions", "batches", "input_pipelines", "loss_scales", "models", "optimizers", *COUNTS]),
    ],
)
def test_a_checkpoint_holds_the_runs_state(data_dir, tmp_path, one_device, monkeypatch, task, overrides, keys):
    if task is not None:
        monkeypatch.setattr(data, "task_class", lambda config: task)
    trainer = build.run(helpers.make_config(data_dir, str(tmp_path), hidden_sizes=(8,), **overrides), one_device)
    state = trainer.state
    assert sorted(state.tracked()) == keys
    assert (state.step, state.batches, state.skipped) == (
        trainer.state.step,
        trainer.state.batches,
        trainer.state.skipped,
    )
    checkpoints = checkpoint_lib.Checkpoints(trainer.state, str(tmp_path), keep=1)
    trainer.state.step.assign(7)
    saved = tf.train.load_checkpoint(checkpoints.save()).get_variable_to_shape_map()
    assert sorted({key.split("/")[0] for key in saved} - {"_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter"}) == sorted(
        state.tracked()
    )
