"""A fork's mistakes in its own step are one line each (TaskError: exit 2 from launch.py), naming the task's file,
the update or primitive and the value: misused primitives, an update's settings checked as the flags are, a loss
that breaks the per-example contract, updates that share variables unsaid."""

import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf

from engine.api import DEFAULT, Update
from engine.data import datasets as data_lib
from engine.run import build, loop
from engine.settings import plugins
from engine.settings.errors import ConfigError, TaskError
from tasks import base, classification
from tests import helpers

FILE = "tasks/classification.py"
SGD = dict(optimizer="sgd", momentum=0.0, hidden_sizes=(8,), jit_compile="false")


class Twice(classification.Task):
    def replica_step(self, step, batch):
        gradients = step.gradients(DEFAULT, batch)
        step.apply(DEFAULT, gradients)
        step.apply(DEFAULT, gradients)


class Never(classification.Task):
    def replica_step(self, step, batch):
        step.gradients(DEFAULT, batch)


class Unknown(classification.Task):
    def replica_step(self, step, batch):
        step.apply("trian", step.gradients("trian", batch))


class Crossed(classification.Task):
    def updates(self):
        return (Update("body", trains=r"/dense/"), Update("head", trains=r"/dense_1/"))

    def replica_step(self, step, batch):
        body = step.gradients("body", batch)
        step.apply("head", body)
        step.apply("body", body)


class Shifted(classification.Task):
    def replica_step(self, step, batch):
        first = step.gradients(DEFAULT, batch)
        step.apply(DEFAULT, step.gradients(DEFAULT, batch, shift=first.grads[:1]))


class ShiftedAlike(classification.Task):
    """SAM's ascent with a scalar per variable, its `* g` forgotten: each shift broadcast over its variable."""

    def replica_step(self, step, batch):
        first = step.gradients(DEFAULT, batch)
        scale = 0.05 / (tf.linalg.global_norm(first.grads) + 1e-12)
        step.apply(DEFAULT, step.gradients(DEFAULT, batch, shift=[scale for _ in first.grads]))


class Regrouped(classification.Task):
    """Gradients edited before their apply, one of them dropped: the rest would pair with the wrong variables."""

    def replica_step(self, step, batch):
        gradients = step.gradients(DEFAULT, batch)
        gradients.grads = gradients.grads[1:]
        step.apply(DEFAULT, gradients)


class Unreached(classification.Task):
    def replica_step(self, step, batch):
        gradients = step.gradients(DEFAULT, batch)
        gradients.grads = [None, *gradients.grads[1:]]
        step.apply(DEFAULT, gradients)


class LossOfTwo(classification.Task):
    def replica_step(self, step, batch):
        step.apply(DEFAULT, step.gradients(DEFAULT, batch, loss=lambda models, batch: self.forward(models, batch, 1)))


class Returning(classification.Task):
    def replica_step(self, step, batch):
        first = step.gradients(DEFAULT, batch)
        step.apply(DEFAULT, first)
        return {"sharpness": first.loss}


class Outside(classification.Task):
    def replica_step(self, step, batch):
        self.kept = step
        step.apply(DEFAULT, step.gradients(DEFAULT, batch))

    def probe(self, models, examples):
        self.kept.variables(DEFAULT)  # on the host, at evaluation: outside the step it was handed to
        return {}


class Branched(classification.Task):
    def replica_step(self, step, batch):
        gradients = step.gradients(DEFAULT, batch)
        if step.count % 2 == 0:  # a tensor: autograph makes it a tf.cond, tracing both applies
            step.apply(DEFAULT, gradients)
        else:
            step.apply(DEFAULT, gradients, when=False)


class EveryOther(classification.Task):
    def replica_step(self, step, batch):
        step.apply(DEFAULT, step.gradients(DEFAULT, batch), when=step.count % 2)


class PerExample(classification.Task):
    def replica_step(self, step, batch):
        step.apply(DEFAULT, step.gradients(DEFAULT, batch), when=batch["label"] > 3)


@pytest.mark.parametrize(
    "task, message",
    [
        (Twice, "replica_step: step.apply('train', ...): these gradients were applied already; take new "),
        (Never, "replica_step: never applies update 'train'; every update is applied once a step at least"),
        (Unknown, "replica_step: step.gradients('trian', ...): no update 'trian'; the task's updates are train"),
        (Crossed, "replica_step: step.apply('head', ...) takes the Gradients of step.gradients('head', ...) of this "),
        (Shifted, "replica_step: step.gradients('train', ..., shift=...): 1 shifts for the 4 variables update"),
        # Trained with rc 0 before, each scalar shifting every weight of its variable alike.
        (
            ShiftedAlike,
            "replica_step: step.gradients('train', ..., shift=...): shift 0 has shape (), where its variable "
            "mlp/dense/kernel has (64, 8): each shift is of its variable's shape",
        ),
        # Trained with rc 0 before (without momentum), the last variable left out unsaid; tracebacks else.
        (Regrouped, "replica_step: step.apply('train', ...): its Gradients' grads: 3 gradients for the 4 variables"),
        (
            Unreached,
            "replica_step: step.apply('train', ...): its Gradients' grads: gradient 0 is None, where its variable "
            "mlp/dense/kernel has (64, 8): each gradient is of its variable's shape",
        ),
        (
            LossOfTwo,
            "replica_step: step.gradients('train', ..., loss=...): loss(models, batch) is called as loss(models, "
            "batch, seed) or loss(models, batch, seed, repetition)",
        ),
        # Dropped unsaid before: nothing logs what a replica_step returns.
        (Returning, "replica_step returned a dict; it returns nothing: nothing would log it"),
        (Branched, "replica_step: step.apply('train', ...) inside an `if` or loop on a tensor (graph mode runs it "),
        (
            EveryOther,
            "replica_step: step.apply('train', ..., when=...) takes a boolean scalar (True, False or a "
            "tf.bool tensor of shape []), whether the update is due on every replica alike, not a tensor "
            "of int64, shape ()",
        ),
        (
            PerExample,
            "replica_step: step.apply('train', ..., when=...) takes a boolean scalar (True, False or a "
            "tf.bool tensor of shape []), whether the update is due on every replica alike, not a tensor "
            "of bool, shape (64,)",
        ),
    ],
    ids=[
        "twice",
        "never",
        "unknown",
        "crossed",
        "shift",
        "shift_shape",
        "grads_length",
        "grads_none",
        "gradients_loss_arity",
        "returns",
        "tensor_if",
        "when_int",
        "when_per_example",
    ],
)
def test_a_misused_primitive_is_one_line(data_dir, one_device, monkeypatch, task, message):
    monkeypatch.setattr(data_lib, "task_class", lambda config: task)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    with pytest.raises(TaskError) as raised:
        trainer.program.run_steps(trainer.program.train_iterator(), 2)
    assert str(raised.value).startswith(f"{FILE}: {message}") and "\n" not in str(raised.value), str(raised.value)


def test_a_primitive_called_outside_its_step_is_one_line(data_dir, one_device, monkeypatch):
    monkeypatch.setattr(data_lib, "task_class", lambda config: Outside)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    trainer.program.run_steps(trainer.program.train_iterator(), 1)
    with pytest.raises(TaskError) as raised:
        trainer.evaluator.evaluate()
    assert str(raised.value) == (
        f"{FILE}: replica_step: step.variables('train', ...) called outside the replica step it was handed to; "
        "call the primitives inside replica_step(step, batch) only"
    )


def _returning(value):
    class Task(classification.Task):
        def updates(self):
            return value

    return Task


def _with_updates(monkeypatch, *updates):
    class Task(classification.Task):
        def updates(self):
            return updates

    monkeypatch.setattr(data_lib, "task_class", lambda config: Task)


@pytest.mark.parametrize(
    "update, message",
    [
        (Update("a", clip_norm=-1.0), "update 'a': clip_norm=-1.0: must be zero or positive"),
        (Update("a", clip_value=-0.01), "update 'a': clip_value=-0.01: must be zero or positive"),
        (Update("a", clip_norm=1.0, clip_value=0.1), "update 'a': clip_value=0.1: choose one of --clip_norm and"),
        (Update("a", optimizer={"beta_1": 1.5}), "update 'a': beta_1=1.5: must be in [0, 1)"),
        (Update("a", optimizer={"momentum": 3.0}), "update 'a': momentum=3.0: must be in [0, 1)"),
        (Update("a", optimizer={"epsilon": 0.0}), "update 'a': epsilon=0.0: must be a positive number"),
        (Update("a", optimizer={"beta_2": "0.9"}), "update 'a': beta_2='0.9': must be a number"),
        (Update("a", trains="["), "update 'a': trains='[': not a regular expression (unterminated character set"),
        # Accepted and read by nothing: the moving average is the run's, clipping the update's whole gradient's.
        (
            Update("a", optimizer={"ema_decay": 0.5}),
            "update 'a': ema_decay=0.5: the setting is the run's "
            "(--ema_decay: one moving average of every trained variable); nothing reads it here",
        ),
        (
            Update("a", groups=((r"bias", {"clip_norm": 1.0}),)),
            "update 'a': optimizer group 'bias': clip_norm=1.0: "
            "the setting is an update's (--clip_norm, or Update(clip_norm=...): clipping is of its whole gradient); "
            "nothing reads it here",
        ),
        (Update("a", optimizer="sgd"), "update 'a': optimizer='sgd': a dict of settings, as {'optimizer': 'sgd'}"),
        (
            Update("a", groups=(r"bias", {"learning_rate": 0.1})),
            "update 'a': groups=('bias', {'learning_rate': 0.1}): must be pairs of (regex, {setting: value}), as "
            "((r'^head/', {'learning_rate': 1e-4}),)",
        ),
        (
            Update("a", loss="my_loss"),
            "update 'a': loss='my_loss': must be a function loss(models, batch, seed[, repetition])",
        ),
        (
            Update("a", loss=lambda models, batch: 0.0),
            "update 'a': loss(models, batch) is called as loss(models, batch, seed) or loss(models, batch, seed, "
            "repetition)",
        ),
    ],
    ids=[
        "clip_norm",
        "clip_value",
        "both_clips",
        "beta_1",
        "momentum",
        "epsilon",
        "a_string",
        "regex",
        "ema_decay",
        "group_clip_norm",
        "optimizer_string",
        "groups_unpaired",
        "loss_string",
        "loss_arity",
    ],
)
def test_an_updates_settings_are_checked_as_the_flags_are(data_dir, one_device, monkeypatch, update, message):
    _with_updates(monkeypatch, update)
    with pytest.raises(TaskError) as raised:
        build.run(helpers.make_config(data_dir, **SGD), one_device)
    assert str(raised.value).startswith(f"{FILE}: {message}"), str(raised.value)


def test_updates_sharing_a_variable_are_refused_unless_the_task_says_so(data_dir, one_device, monkeypatch):
    _with_updates(monkeypatch, Update("all"), Update("head", trains=r"/dense_1/"))
    with pytest.raises(TaskError) as raised:
        build.run(helpers.make_config(data_dir, **SGD), one_device)
    assert str(raised.value) == (
        f"{FILE}: updates 'all' and 'head' both train model/mlp/dense_1/kernel and 1 more: each would keep its own "
        "optimizer slots and move its moving average again; say Update('head', ..., shares=True) if that is meant"
    )
    _with_updates(monkeypatch, Update("all"), Update("head", trains=r"/dense_1/", shares=True))
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    out = trainer.program.run_steps(trainer.program.train_iterator(), 2)
    assert out["steps"] == 2 and int(trainer.plans[1].optimizer.iterations.numpy()) == 2


def _loss(value):
    class Task(classification.Task):
        def loss(self, outputs, batch):
            return value(super().loss(outputs, batch), outputs)

    return Task


@pytest.mark.parametrize(
    "loss, message",
    [
        (lambda per_example, outputs: tf.reduce_mean(per_example), "its loss has shape [], not one value per"),
        (lambda per_example, outputs: outputs, "its loss has shape [64, 10], not one value per example of the"),
        (lambda per_example, outputs: tf.cast(per_example > 1, tf.int32), "its loss is int32, not a float: no "),
        (lambda per_example, outputs: tf.ones_like(per_example), "its loss does not depend on the variables it "),
    ],
    ids=["a_mean", "per_class", "integer", "constant"],
)
def test_a_loss_that_breaks_the_per_example_contract_is_one_line(data_dir, one_device, monkeypatch, loss, message):
    monkeypatch.setattr(data_lib, "task_class", lambda config: _loss(loss))
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    with pytest.raises(TaskError) as raised:
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
    assert str(raised.value).startswith(f"{FILE}: update 'train': {message}"), str(raised.value)
    assert isinstance(raised.value, ConfigError) and "\n" not in str(raised.value)


def _fork_with(tmp_path, files):
    """A copy of the checkout with `files` ({path: text}) added, as a researcher's fork holds them."""
    fork = helpers.copy_checkout(tmp_path / "fork")
    for path, text in files.items():
        (fork / path).write_text(text)
    return fork


def _launch_in(fork, *flags):
    import subprocess
    import sys

    # Two steps where it trains: another mode refuses --train_steps, which it never reads.
    steps = [] if any(flag.startswith("--mode=") for flag in flags) else ["--train_steps=2"]
    command = [sys.executable, "launch.py", *flags, *steps, f"--workdir={fork.parent / 'run'}"]
    return subprocess.run(command, cwd=fork, capture_output=True, text=True, timeout=300)


def test_launch_ends_a_forks_mistake_in_one_line_with_exit_2(tmp_path):
    """The same as a user meets it: a task file whose step applies its gradients twice."""
    twice = (
        "from engine.api import DEFAULT\nfrom tasks import classification\n\n\n"
        "class Task(classification.Task):\n"
        "    def replica_step(self, step, batch):\n"
        "        gradients = step.gradients(DEFAULT, batch)\n"
        "        step.apply(DEFAULT, gradients)\n"
        "        step.apply(DEFAULT, gradients)\n"
    )
    result = _launch_in(_fork_with(tmp_path, {"tasks/twice.py": twice}), "--task=twice")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: tasks/twice.py: replica_step: step.apply('train', ...): these gradients were applied already; "
        "take new step.gradients('train', ...)"
    ], result.stderr


# A fork's code that raises an error of its own: a traceback of 90 lines and exit 1 before. In the traced step (a
# setting no file declares, read in the loss), and in an action between rounds.
OWN_ERRORS = [
    (
        "tasks/weighted.py",
        "from tasks import classification\n\n\n"
        "class Task(classification.Task):\n"
        "    def loss(self, outputs, batch):\n"
        "        return super().loss(outputs, batch) * self.config.my_weight\n",
        "--task=weighted",
        "error: tasks/weighted.py:6 in loss: AttributeError: no setting my_weight: the engine declares none, nor "
        "does any file of this checkout; a model, task, source or action declares its own in its file's SETTINGS "
        "(docs/forking.md)",
    ),
    (
        "engine/run/actions/broken.py",
        "from engine.run.actions import base\n\n\n"
        "class Action(base.Action):\n"
        "    def __call__(self, round, context):\n"
        "        raise RuntimeError(f'my action broke at step {round.end}')\n",
        "--actions=broken",
        "error: engine/run/actions/broken.py:6 in __call__: RuntimeError: my action broke at step 2",
    ),
    # A setting another file declares, read without naming it in READS: it read sam's default, silently, and
    # --sam_rho typed was refused as read by no part of the run.
    (
        "tasks/sharp.py",
        "from tasks import classification\n\n\n"
        "class Task(classification.Task):\n"
        "    def loss(self, outputs, batch):\n"
        "        return super().loss(outputs, batch) * self.config.sam_rho\n",
        "--task=sharp",
        "error: tasks/sharp.py:6 in loss: AttributeError: tasks/sharp.py reads the setting sam_rho, which tasks/sam.py "
        "declares: name it in tasks/sharp.py's READS (READS = ('sam_rho',)), so a run of tasks/sharp.py depends on it "
        "and takes --sam_rho",
    ),
    # A feature the batch lacks, the commonest slip in a loss: autograph wraps the KeyError in its StagingError (of
    # TensorFlow's module), which kept the engine's traceback and exit 1 before.
    (
        "tasks/misnamed.py",
        "from tasks import classification\n\n\n"
        "class Task(classification.Task):\n"
        "    def loss(self, outputs, batch):\n"
        "        return super().loss(outputs, {**batch, 'label': batch['lbl']})\n",
        "--task=misnamed",
        "error: tasks/misnamed.py:6 in loss: KeyError: 'lbl'",
    ),
    # An assertion of a fork's that fails as its step runs (not under XLA, which drops assertions): TensorFlow's
    # InvalidArgumentError, a traceback and exit 1 before.
    (
        "tasks/asserting.py",
        "import tensorflow as tf\nfrom tasks import classification\n\n\n"
        "class Task(classification.Task):\n"
        "    def loss(self, outputs, batch):\n"
        "        tf.debugging.Assert(tf.reduce_all(batch['label'] < 0), ['labels must be negative'])\n"
        "        return super().loss(outputs, batch)\n",
        "--task=asserting --jit_compile=false",
        "error: tasks/asserting.py:7 in loss: InvalidArgumentError: assertion failed: [labels must be negative]",
    ),
    # A model the run does not have, named in a loss written inside replica_step: autograph lists the loss's own
    # frame unmapped (its parent's generated file), which kept the engine's traceback and exit 1 before.
    (
        "tasks/nested.py",
        "from engine.api import DEFAULT\nfrom tasks import classification\n\n\n"
        "class Task(classification.Task):\n"
        "    def replica_step(self, step, batch):\n"
        "        def loss(models, batch, seed):\n"
        "            return self.loss(models['generator'](batch['image']), batch)\n\n"
        "        step.apply(DEFAULT, step.gradients(DEFAULT, batch, loss=loss))\n",
        "--task=nested --jit_compile=false",
        "error: tasks/nested.py:8 in loss: KeyError: 'generator'",
    ),
    # The same in a source's decode, which tf.data traces: autograph's MultilineMessageKeyError.
    (
        "sources/decoded.py",
        "import tensorflow as tf\nfrom engine.api import Source, in_memory\n\n\n"
        "def load(config, eval_split):\n"
        "    split = in_memory({'image': tf.zeros([256, 4]), 'label': tf.zeros([256], tf.int64)})\n"
        "    spec = {'image': tf.TensorSpec([4], tf.float32), 'label': tf.TensorSpec([], tf.int64)}\n"
        "    return Source(split, split, spec, {'num_classes': 2}, decode=decode)\n\n\n"
        "def decode(example, seed, training):\n"
        "    return {'image': example['img'], 'label': example['label']}\n",
        "--dataset=decoded",
        "error: sources/decoded.py:12 in decode: KeyError: 'img'",
    ),
    # TensorFlow's own error of a file a source's load reads (not there): kept TensorFlow's traceback, exit 1.
    (
        "sources/missing.py",
        "import tensorflow as tf\n\n\n"
        "def load(config, eval_split):\n"
        "    with tf.io.gfile.GFile('/nonexistent/examples.bin', 'rb') as f:\n"
        "        return f.read()\n",
        "--dataset=missing",
        "error: sources/missing.py:6 in load: NotFoundError: /nonexistent/examples.bin; No such file or directory",
    ),
]


@pytest.mark.parametrize(
    "path, text, flag, said",
    OWN_ERRORS,
    ids=[
        "in_the_step",
        "in_an_action",
        "another_files_setting",
        "key_error",
        "an_assertion",
        "loss_inside_replica_step",
        "key_error_in_a_decode",
        "tensorflows_error_in_a_load",
    ],
)
def test_launch_ends_an_error_a_forks_code_raises_in_one_line_with_exit_2(tmp_path, path, text, flag, said):
    result = _launch_in(_fork_with(tmp_path, {path: text}), *flag.split())
    assert result.returncode == 2 and result.stderr.splitlines()[-1:] == [said], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


NAMED_OUTPUTS = {
    "models/named.py": "import tensorflow as tf\n\n\n"
    "class Named(tf.keras.Model):\n"
    "    def __init__(self, outputs):\n"
    "        super().__init__(name='named')\n"
    "        self.flatten, self.head = tf.keras.layers.Flatten(), tf.keras.layers.Dense(outputs, name='head')\n\n"
    "    def call(self, x, training=False):\n"
    "        return {'logits': self.head(self.flatten(x))}\n\n\n"
    "def create(config, spec, outputs, info):\n"
    "    return Named(outputs)\n",
    "tasks/named.py": "import tensorflow as tf\nfrom tasks import base\n\n\n"
    "class Task(base.Task):\n"
    "    features, input = ('image', 'label'), 'image'\n\n"
    "    @property\n"
    "    def outputs(self):\n"
    "        return self.info['num_classes']\n\n"
    "    def prepare(self, batch):\n"
    "        return {'image': base.float_image(self, batch), 'label': tf.cast(batch['label'], tf.int64)}\n\n"
    "    def loss(self, outputs, batch):\n"
    "        return tf.nn.sparse_softmax_cross_entropy_with_logits(batch['label'], outputs['logits'])\n",
}


def test_the_export_of_a_task_whose_forward_returns_a_dict_without_a_serve_of_its_own_is_one_line(tmp_path):
    # A model of named outputs trains under a task that reads them; its export was autograph's StagingError
    # traceback from the default serve in tasks/base.py, exit 1.
    fork = _fork_with(tmp_path, NAMED_OUTPUTS)
    trained = _launch_in(fork, "--task=named", "--model=named", "--jit_compile=false")
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = _launch_in(fork, "--mode=export")
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [
            "error: tasks/named.py: its forward returns a dict, and the default serve(models) exports one tensor: "
            "define serve(models) in it, naming what the SavedModel returns (tasks/base.py)"
        ],
    )
    assert not (tmp_path / "run" / "export").exists()


def test_a_setting_another_file_declares_is_read_once_the_file_names_it_in_reads(tmp_path):
    """Named in READS, another file's setting is the reader's: typed, it is taken and read."""
    sharp = (
        "from tasks import classification\n\n"
        "READS = ('sam_rho',)\n\n\n"
        "class Task(classification.Task):\n"
        "    def loss(self, outputs, batch):\n"
        "        return super().loss(outputs, batch) * self.config.sam_rho\n"
    )
    result = _launch_in(_fork_with(tmp_path, {"tasks/sharp.py": sharp}), "--task=sharp", "--sam_rho=0.0")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["loss"] for line in lines if "loss" in line] == [0.0]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["sam_rho"] == 0.0


def _metrics(extra):
    class Task(classification.Task):
        def metrics(self, outputs, batch):
            found = super().metrics(outputs, batch)
            return {**found, **extra(found)}

    return Task


@pytest.mark.parametrize(
    "extra, message",
    [
        (lambda m: {"column": m["accuracy"][:, None]}, "'column' has shape [64, 1], not one value per example of the "),
        (lambda m: {"mean": tf.reduce_mean(m["accuracy"])}, "'mean' has shape [], not one value per example of the "),
        (lambda m: {"examples": m["accuracy"]}, "a metric named 'examples' would replace the engine's count of the "),
    ],
    ids=["per_example_column", "batch_mean", "examples"],
)
def test_a_metric_that_is_not_one_value_per_example_is_one_line(data_dir, one_device, monkeypatch, extra, message):
    # A [batch, 1] metric broadcast against the weights to [batch, batch] (10.9 for an accuracy of 0.09); a batch
    # mean counted the padding examples; "examples" vanished behind the engine's count.
    monkeypatch.setattr(data_lib, "task_class", lambda config: _metrics(extra))
    trainer = build.run(helpers.make_config(data_dir, **SGD, eval_batch_size=64), one_device)
    with pytest.raises(TaskError) as raised:
        trainer.evaluator.evaluate()
    assert str(raised.value).startswith(f"{FILE}: metrics: {message}"), str(raised.value)


class NumpyReport(classification.Task):
    def report(self, means):
        return {**means, "error": np.float32(1.0) - np.float32(means["accuracy"])}

    def probe(self, models, examples):
        return {"kernel_norm": tf.norm(models["model"].trainable_variables[0]), "steps_seen": np.int64(0)}


class ArrayReport(classification.Task):
    def probe(self, models, examples):
        return {"norms": tf.stack([tf.norm(v) for v in models["model"].trainable_variables])}


def test_a_reports_numpy_and_tensor_scalars_are_reported_as_numbers(data_dir, one_device, monkeypatch, tmp_path):
    monkeypatch.setattr(data_lib, "task_class", lambda config: NumpyReport)
    config = helpers.make_config(data_dir, str(tmp_path), **SGD, train_steps=2)
    summary = loop.train(config, one_device)  # it ended in a traceback writing eval.jsonl
    results = summary["eval"]
    assert type(results["error"]) is float and results["error"] == pytest.approx(1.0 - results["accuracy"])
    assert type(results["kernel_norm"]) is float and results["kernel_norm"] > 0 and results["steps_seen"] == 0
    assert json.loads((tmp_path / "summary.json").read_text())["eval"] == results
    monkeypatch.setattr(data_lib, "task_class", lambda config: ArrayReport)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    with pytest.raises(TaskError) as raised:
        trainer.evaluator.evaluate()
    assert str(raised.value) == f"{FILE}: probe: 'norms' is an array of shape [4], not one number"


class Unpaired(classification.Task):
    optimizer_groups = (r"^model/mlp/dense_1/", {"learning_rate": 1e-2})  # the enclosing tuple forgotten


class OneStep(classification.Task):
    def replica_step(self, step):
        pass


class Lossless(base.Task):
    input, outputs = "image", 10


@pytest.mark.parametrize(
    "task, message",
    [
        (_returning(Update("a")), f"{FILE}: updates() returned Update(name='a', "),
        (_returning(None), f"{FILE}: updates() returned None, not a tuple of engine.api.Update"),
        (Unpaired, f"{FILE}: optimizer_groups=('^model/mlp/dense_1/', {{'learning_rate': 0.01}}): must be pairs of "),
        (OneStep, f"{FILE}: replica_step(step) is called as replica_step(step, batch) (the task's own method, with "),
        (Lossless, "tests/test_fork_mistakes.py: defines no loss(outputs, batch), the per-example loss its updates "),
    ],
    ids=["a_bare_update", "none", "groups_unpaired", "replica_step_signature", "no_loss"],
)
def test_a_task_that_breaks_the_protocol_is_one_line(data_dir, one_device, monkeypatch, task, message):
    # Each ended in a Python traceback: "'Update' object is not iterable", "too many values to unpack", a bare
    # NotImplementedError.
    monkeypatch.setattr(data_lib, "task_class", lambda config: task)
    with pytest.raises(TaskError) as raised:
        trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)


class Unreached(classification.Task):
    def models(self, create):
        return {**super().models(create), "head": create(self.config.model, self.spec[self.input], self.outputs)}


def test_a_model_no_gradient_reaches_is_named_once(data_dir, one_device, monkeypatch, capsys):
    # Its forward pass never calls "head": it trained with zero gradients, silently.
    monkeypatch.setattr(data_lib, "task_class", lambda config: Unreached)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    head = [v.numpy() for v in trainer.models["head"].trainable_variables]
    for _ in range(2):
        trainer.program.run_steps(trainer.program.train_iterator(), 2)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "no gradient reaches" in line]
    assert warnings == [
        f"warning: {FILE}: update 'train': no gradient reaches head/mlp/dense/kernel and 3 more (its loss does not "
        "depend on them): they train with zero gradients; freeze them (--freeze, model.trainable = False) or leave "
        "them out of the update (Update(trains=...))"
    ]
    for before, v in zip(head, trainer.models["head"].trainable_variables):
        np.testing.assert_array_equal(v.numpy(), before)


class Lenient(classification.Task):
    """What the protocol's checks must still take: updates() as a generator, trains as a set, settings as a read-only
    mapping, a loss with keyword-only or **kwargs parameters (called with three arguments)."""

    def body_loss(self, models, batch, seed, *, weight=1.0):
        return weight * self.loss(self.forward(models, batch, True), batch)

    def head_loss(self, models, batch, seed, **options):
        return self.loss(self.forward(models, batch, True), batch)

    def updates(self):
        settings = types.MappingProxyType({"optimizer": "adamw", "beta_1": 0.5})  # beta_1: adamw's, not the run's sgd's
        yield Update("body", loss=self.body_loss, trains=r"/dense/", optimizer=settings)
        yield Update("head", loss=self.head_loss, trains={"model"}, shares=True)


def test_the_protocol_checks_take_what_the_protocol_allows(data_dir, one_device, monkeypatch):
    monkeypatch.setattr(data_lib, "task_class", lambda config: Lenient)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    out = trainer.program.run_steps(trainer.program.train_iterator(), 2)
    assert out["steps"] == 2 and np.isfinite(out["body/loss"]) and np.isfinite(out["head/loss"])
    assert [plan.settings.beta_1 for plan in trainer.plans] == [0.5, 0.9]


def test_a_metric_of_unknown_rank_is_taken_as_it_is():
    from engine.numerics.replica import checked_metric

    @tf.function
    def metric(x):  # a numpy_function's result has no shape: the engine cannot check it, nor refuse it
        value = tf.numpy_function(lambda a: (a > 0).astype(np.float32), [x], tf.float32)
        return tf.reduce_sum(checked_metric("positive", value, tf.ones_like(x), FILE))

    assert float(metric(tf.constant([1.0, -1.0, 2.0]))) == 2.0


def test_an_update_may_set_the_runs_values_and_its_own_batch_for_the_rate(data_dir):
    from engine.numerics import optim

    config = helpers.make_config(data_dir, lr_scaling="linear", base_batch_size=128, learning_rate=0.1)
    run = config.optimization
    settings = optim.checked_settings(run, {"global_batch_size": 1024, "ema_decay": run.ema_decay}, "update 'a'")
    assert float(optim.learning_rate(settings, 0)) == pytest.approx(0.8)  # 0.1 x 1024 / 128: the rate reads it


def _traced(*frames, said):
    """An error as autograph words one raised in a traced function: the user's frames, then the error."""
    lines = ["in user code:", ""]
    for path, line, name in frames:
        lines += [f'    File "{os.path.join(helpers.ROOT, path)}", line {line}, in {name}  *', "        code"]
    return "\n".join([*lines, "", *("    " + line for line in said.splitlines())])


def _ran(*frames, said):
    """TensorFlow's error of an op that failed as it ran: the lines it was defined at, then what it said."""
    lines = ["Graph execution error:", "", "Detected at node while/Assert defined at (most recent call last):"]
    for path, line, name in frames:
        lines += [f'  File "{os.path.join(helpers.ROOT, path)}", line {line}, in {name}', ""]
    return "\n".join([*lines, said, "\t [[{{node while/Assert}}]] [Op:__inference_train_loop_1191]"])


def test_a_forks_error_is_its_line_and_the_engines_keeps_its_traceback():
    step = ("engine/numerics/forward.py", 201, "forward_backward")
    mine = ("tasks/mine.py", 7, "loss")
    assert plugins.failure(ValueError(_traced(step, mine, said="ValueError: oops"))) == (
        "tasks/mine.py:7 in loss: ValueError: oops"
    )
    # Keras's error in a layer: its first line names the layer, its second what went wrong.
    keras = (
        'ValueError: Exception encountered when calling Dense.call().\n\n\x1b[1mInput 0 of layer "dense" is '
        "incompatible with the layer: expected axis -1 of input shape to have value 64\x1b[0m\n\nArguments received "
        "by Dense.call():\n  \u2022 inputs=tf.Tensor(shape=(None, 32), dtype=float32)"
    )
    assert plugins.failure(ValueError(_traced(step, mine, ("models/mine.py", 3, "<lambda>"), said=keras))) == (
        "models/mine.py:3 in <lambda>: ValueError: Exception encountered when calling Dense.call(). Input 0 of layer "
        '"dense" is incompatible with the layer: expected axis -1 of input shape to have value 64'
    )
    # Reading a setting is the plugin's own line; an error raised by the engine's code it called is the engine's.
    sections = ("engine/settings/sections.py", 171, "__getattr__")
    assert plugins.failure(AttributeError(_traced(mine, sections, said="AttributeError: no setting x"))) == (
        "tasks/mine.py:7 in loss: AttributeError: no setting x"
    )
    assert plugins.failure(KeyError(_traced(mine, step, said="KeyError: 'a'"))) is None
    # A loss written inside replica_step: autograph lists its frame unmapped, innermost, and its line further out.
    generated = ("/tmp/__autograph_generated_file1a2b.py", 12, "loss")
    assert plugins.failure(ValueError(_traced(mine, step, generated, said="ValueError: oops"))) == (
        "tasks/mine.py:7 in loss: ValueError: oops"
    )
    assert plugins.failure(ValueError(_traced(mine, step, generated[:2] + ("other",), said="ValueError: x"))) is None
    assert plugins.failure(ValueError(_traced(("tasks/base.py", 93, "forward"), said="ValueError: x"))) is None
    # TensorFlow's runtime (a device out of memory, a file that cannot be read) keeps its traceback.
    assert plugins.failure(tf.errors.ResourceExhaustedError(None, None, _traced(mine, said="OOM"))) is None
    assert plugins.failure(tf.errors.ResourceExhaustedError(None, None, _ran(mine, said="OOM when allocating"))) is None
    # Raised from a plugin's eager code (a task's probe, a source's load): a file its load could not read is its line;
    # the machine's errors (out of memory, a device or peer lost) keep their traceback, where they were exit 2 "bad
    # input".
    for error, line in (
        (tf.errors.NotFoundError(None, None, "data.bin; No such file"), "NotFoundError: data.bin; No such file"),
        (tf.errors.ResourceExhaustedError(None, None, "OOM when allocating"), None),
        (tf.errors.InternalError(None, None, "CUDA error"), None),
        (tf.errors.UnavailableError(None, None, "Socket closed"), None),
    ):
        try:
            exec(compile("raise error", os.path.join(helpers.ROOT, "tasks", "mine.py"), "exec"), {"error": error})
        except tf.errors.OpError as raised:
            assert plugins.failure(raised) == (line and f"tasks/mine.py:1 in <module>: {line}"), line
    # An op of a plugin's that failed as it ran (its tf.debugging.assert_*): its line, where it was a traceback, exit 1.
    said = "assertion failed: [labels must be below 5] [x (while/GatherV2_1:0) = ] [0 9 5...]"
    assert plugins.failure(tf.errors.InvalidArgumentError(None, None, _ran(step, mine, said=said))) == (
        f"tasks/mine.py:7 in loss: InvalidArgumentError: {said}"
    )
    assert plugins.failure(tf.errors.InvalidArgumentError(None, None, _ran(mine, step, said=said))) is None
    assert plugins.failure(ValueError("not from a plugin")) is None


class ListedModels(classification.Task):
    def models(self, create):
        return [create(self.config.model, self.spec[self.input], self.outputs)]


class ListedMetrics(classification.Task):
    def metrics(self, outputs, batch):
        return [self.loss(outputs, batch)]


class MisnamedHeadline(classification.Task):
    headline = "f1"


@pytest.mark.parametrize(
    "task, message",
    [
        (ListedModels, f"{FILE}: models(create) returned a list, not a dict of {{name: model}}"),
        (ListedMetrics, f"{FILE}: metrics: returned a list, not a dict of per-example values by name"),
        (MisnamedHeadline, f"{FILE}: headline = 'f1' names no number its evaluation reports (accuracy, loss)"),
    ],
    ids=["models_a_list", "metrics_a_list", "headline_unreported"],
)
def test_a_task_returning_the_wrong_structure_is_one_line(data_dir, one_device, monkeypatch, task, message):
    # Each was a traceback and exit 1 before: "'list' object has no attribute 'items'" in the engine's code, and for
    # the headline a KeyError in launch.py after the whole run had trained and written its summary.
    monkeypatch.setattr(data_lib, "task_class", lambda config: task)
    with pytest.raises(TaskError) as raised:
        trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
        trainer.evaluator.evaluate()
    assert str(raised.value) == message
