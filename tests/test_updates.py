"""A step of several updates (engine/numerics/updates.py): each its own loss, variables, optimizer, loss scale,
clipping and
frequency, against a plain TensorFlow loop of the same math; and a checkpoint from before updates existed."""

import dataclasses
import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from engine.data import datasets as data_lib
from engine.numerics.updates import Update
from engine.run import build, loop
from engine.settings.config import load_run_config
from engine.settings.errors import ConfigError
from engine.state.report import Report
from tasks import classification
from tests import helpers

HERE = os.path.dirname(os.path.abspath(__file__))
SGD = dict(optimizer="sgd", momentum=0.0, hidden_sizes=(8,), jit_compile="false")
BODY_RATE, HEAD_RATE = 0.1, 0.05


class Split(classification.Task):
    """The classification task as two updates: the hidden layer's (SGD at BODY_RATE), then the head's (at
    HEAD_RATE), each with the task's loss. (At module level: autograph cannot convert a class made in a function.)"""

    frequency = {}  # {update name: {"every": k, "repeat": n}}

    def updates(self):
        return (
            Update("body", trains=r"/dense/", optimizer={"learning_rate": BODY_RATE}, **self.frequency.get("body", {})),
            Update(
                "head", trains=r"/dense_1/", optimizer={"learning_rate": HEAD_RATE}, **self.frequency.get("head", {})
            ),
        )


class SplitAtFrequencies(Split):
    frequency = {"body": {"every": 2}, "head": {"repeat": 2}}


class Branching(classification.Task):
    """A fork's Python `if` on tensors in its loss and its replica step (graph mode refuses a tensor as a bool
    unless autograph converted the code), each branch taken as the plain task's step would be."""

    def loss(self, outputs, batch):
        per_example = super().loss(outputs, batch)
        if tf.reduce_max(per_example) > 1e9:
            per_example = 0.0 * per_example
        return per_example

    def replica_step(self, step, batch):
        when = tf.constant(True)
        if step.count < 0:
            when = tf.constant(False)
        step.apply("train", step.gradients("train", batch), when=when)


def _split_task(**frequency):
    return SplitAtFrequencies if frequency else Split


def _batches(trainer, n):
    iterator = iter(trainer.data.train_fn(tf.distribute.InputContext()))
    return [next(iterator) for _ in range(n)]


def _reference(initial, batches, body_every=1, head_repeat=1):
    """The two updates written out: relu(x W0 + b0) W1 + b1, softmax cross-entropy over the batch, plain SGD."""
    w0, b0, w1, b1 = (tf.Variable(v) for v in initial)

    def loss(batch):
        x = tf.reshape(batch["image"], [len(batch["label"]), -1])
        logits = tf.nn.relu(x @ w0 + b0) @ w1 + b1
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["label"], logits))

    def sgd(variables, rate, batch):
        with tf.GradientTape() as tape:
            value = loss(batch)
        for v, g in zip(variables, tape.gradient(value, variables)):
            v.assign_sub(rate * g)

    for t, batch in enumerate(batches):
        if t % body_every == 0:
            sgd([w0, b0], BODY_RATE, batch)
        for _ in range(head_repeat):
            sgd([w1, b1], HEAD_RATE, batch)
    return [v.numpy() for v in (w0, b0, w1, b1)]


def _weights(trainer):
    model = trainer.model
    return [v.numpy() for v in (model.hidden[0].kernel, model.hidden[0].bias, model.head.kernel, model.head.bias)]


def _halves(strategy, batch):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: {
            k: v[ctx.replica_id_in_sync_group * 32 : (ctx.replica_id_in_sync_group + 1) * 32] for k, v in batch.items()
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.parametrize(
    "frequency", [{}, {"body": {"every": 2}, "head": {"repeat": 2}}], ids=["each_step", "every_2_and_repeat_2"]
)
def test_updates_apply_in_order_each_with_its_own_optimizer(data_dir, monkeypatch, request, strategy, frequency):
    monkeypatch.setattr(data_lib, "task_class", lambda config: _split_task(**frequency))
    chosen = request.getfixturevalue(strategy)
    trainer = build.run(helpers.make_config(data_dir, **SGD), chosen)
    initial = _weights(trainer)
    batches = _batches(trainer, 5)
    for t, batch in enumerate(batches):
        trainer.state.step.assign(t)
        out = helpers.one_step(trainer, batch if strategy == "one_device" else _halves(chosen, batch))
        trainer.state.step.assign_add(1)
    want = _reference(
        initial, batches, frequency.get("body", {}).get("every", 1), frequency.get("head", {}).get("repeat", 1)
    )
    for got, expected in zip(_weights(trainer), want):
        np.testing.assert_allclose(got, expected, atol=1e-6)
    body, head = trainer.plans
    assert int(body.optimizer.iterations.numpy()) == (3 if frequency else 5)  # applied at steps 0, 2, 4
    assert int(head.optimizer.iterations.numpy()) == (10 if frequency else 5)
    assert float(out["body/learning_rate"]) == pytest.approx(BODY_RATE)
    assert float(out["head/learning_rate"]) == pytest.approx(HEAD_RATE)
    assert float(out["loss"]) == pytest.approx(float(out["body/loss"]) + float(out["head/loss"]), rel=1e-6)
    assert sorted(out) == sorted(
        ["loss", "stop", "finite"]
        + [f"{u}/{m}" for u in ("body", "head") for m in ("loss", "finite", "grad_norm", "loss_scale", "learning_rate")]
    )


def test_a_skipped_float16_update_changes_nothing_of_itself_and_halves_only_its_own_scale(
    data_dir, one_device, monkeypatch
):
    class Poisoned(classification.Task):
        def updates(self):
            def infinite(models, batch, seed):  # every gradient of the head's update overflows
                return self.loss(models["model"](batch["image"], training=True), batch) * float("inf")

            return (Update("body", trains=r"/dense/"), Update("head", trains=r"/dense_1/", loss=infinite))

    monkeypatch.setattr(data_lib, "task_class", lambda config: Poisoned)
    config = helpers.make_config(data_dir, precision="mixed_float16", initial_loss_scale=1024.0, **SGD)
    trainer = build.run(config, one_device)
    body, head = trainer.plans
    before = _weights(trainer)
    for batch in _batches(trainer, 3):
        out = helpers.one_step(trainer, batch)
    after = _weights(trainer)
    assert not bool(out["head/finite"]) and bool(out["body/finite"]) and not bool(out["finite"])
    np.testing.assert_array_equal(after[2], before[2])  # the head: nothing applied
    np.testing.assert_array_equal(after[3], before[3])
    assert np.abs(after[0] - before[0]).max() > 0  # the body trained through it
    assert [int(p.optimizer.iterations.numpy()) for p in (body, head)] == [3, 0]
    assert float(head.loss_scale.scale.numpy()) == 128.0  # halved three times
    assert float(body.loss_scale.scale.numpy()) == 1024.0
    assert [int(p.loss_scale.good_steps.numpy()) for p in (body, head)] == [3, 0]


def test_a_run_of_two_updates_logs_and_checkpoints_each_by_name(data_dir, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(data_lib, "task_class", lambda config: _split_task())
    settings = dict(SGD, train_steps=10, steps_per_loop=5, checkpoint_every=5, eval_every=0)
    whole = loop.train(helpers.make_config(data_dir, str(tmp_path / "whole"), **settings))
    records = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [5, 10]
    for record in records:
        assert record["body/learning_rate"] == pytest.approx(BODY_RATE)
        assert record["head/learning_rate"] == pytest.approx(HEAD_RATE)
        assert record["loss"] is None  # several updates' losses summed mean nothing: each is logged, not the sum
        assert record["body/grad_norm"] > 0 and record["head/grad_norm"] > 0
    assert whole["head/loss"] == pytest.approx(records[-1]["head/loss"])
    assert whole["body/learning_rate"] == pytest.approx(BODY_RATE)
    written = json.load(open(tmp_path / "whole" / "summary.json"))
    assert written["head/loss"] == pytest.approx(records[-1]["head/loss"])
    assert written["body/loss_scale"] is None and written["head/loss_scale"] is None  # float32, as in metrics.jsonl
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("train step=10 "))
    assert line.startswith("train step=10 body/loss=") and " head/loss=" in line and written["train_loss"] is None
    assert " loss=" not in line and "loss_scale" not in line  # no summed loss, no loss scale outside float16
    # What each update trained with, beside the run's settings.
    saved = json.load(open(tmp_path / "whole" / "config.json"))
    for name, rate in (("body", BODY_RATE), ("head", HEAD_RATE)):
        for effective in (saved["updates"][name], written["updates"][name]):
            assert effective["optimizer"] == "sgd" and effective["learning_rate"] == rate and effective["repeat"] == 1
    reader = tf.train.load_checkpoint(str(tmp_path / "whole" / "checkpoints" / "ckpt-10"))
    names = reader.get_variable_to_shape_map()
    assert reader.get_tensor("optimizers/body/iterations/.ATTRIBUTES/VARIABLE_VALUE") == 10
    assert reader.get_tensor("optimizers/head/iterations/.ATTRIBUTES/VARIABLE_VALUE") == 10
    assert "loss_scales/head/scale/.ATTRIBUTES/VARIABLE_VALUE" in names and not any(
        n.startswith("optimizer/") for n in names
    )

    # Stopped at step 5 and run again to 10: the same weights, bit for bit.
    loop.train(helpers.make_config(data_dir, str(tmp_path / "parts"), **{**settings, "train_steps": 5}))
    loop.train(helpers.make_config(data_dir, str(tmp_path / "parts"), **settings))
    resumed = tf.train.load_checkpoint(str(tmp_path / "parts" / "checkpoints" / "ckpt-10"))
    for name in names:
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH" and "save_counter" not in name:
            np.testing.assert_array_equal(resumed.get_tensor(name), reader.get_tensor(name), err_msg=name)


def test_a_checkpoint_written_before_updates_restores_and_trains_on_to_float32_rounding(tmp_path):
    """tests/data/before_updates: a 5-step run (hidden_sizes=8, --ema_decay=0.9) saved by the engine before updates
    existed (optimizer/..., loss_scale/... keys). Trained on to step 10 it matches a fresh 10-step run."""
    old = tmp_path / "old"
    shutil.copytree(os.path.join(HERE, "data", "before_updates"), old)
    saved = load_run_config(str(old))
    settings = dict(train_steps=10)
    summary = loop.train(dataclasses.replace(saved, workdir=str(old), **settings))
    fresh = loop.train(dataclasses.replace(saved, workdir=str(tmp_path / "fresh"), **settings))
    assert summary["step"] == fresh["step"] == 10
    resumed = tf.train.load_checkpoint(str(old / "checkpoints" / "ckpt-10"))
    straight = tf.train.load_checkpoint(str(tmp_path / "fresh" / "checkpoints" / "ckpt-10"))
    names = [n for n in straight.get_variable_to_shape_map() if n.startswith(("models/", "optimizer/", "ema/"))]
    assert "optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE" in names and len(names) == 4 + 1 + 8 + 4
    for name in names:
        # To float32 rounding, not bit for bit: tests/data/before_updates was saved on another CPU, whose steps round
        # otherwise (its step 5 is 1e-7 from this code's on a 2-core AMD EPYC, where the code that saved it gives
        # this code's step 5 bit for bit); docs/numerics.md says so.
        np.testing.assert_allclose(resumed.get_tensor(name), straight.get_tensor(name), rtol=1e-4, atol=1e-8)
    assert summary["eval"] == pytest.approx(fresh["eval"], rel=1e-4)


@pytest.mark.parametrize(
    "updates, message",
    [
        (
            (Update("body", trains=r"^nothing/"),),
            "update 'body' trains='^nothing/' matches no trained variable (e.g. model/mlp/dense/kernel)",
        ),
        # Trained the models named aright before, unsaid: a misspelt name beside them trained nothing of its model.
        (
            (Update("body", trains=("model", "modle")),),
            "update 'body' trains=('model', 'modle'): no trained model 'modle' (the models trained: model)",
        ),
        ((Update("a"), Update("a")), "two updates are named alike (a, a)"),
        ((Update("a", repeat=0),), "update 'a': repeat=0: must be an integer of 1 or more"),
        ((Update("a", optimizer={"learnig_rate": 1.0}),), "update 'a': no setting learnig_rate"),
        ((Update("a b"),), "update name 'a b': use letters, digits, '_', '.' or '-'"),
    ],
    ids=["matches_nothing", "misspelt_model", "same_name", "repeat_0", "typo", "bad_name"],
)
def test_a_wrong_update_is_one_clear_error(data_dir, one_device, monkeypatch, updates, message):
    class Wrong(classification.Task):
        def updates(self):
            return updates

    monkeypatch.setattr(data_lib, "task_class", lambda config: Wrong)
    with pytest.raises(ConfigError) as raised:
        build.run(helpers.make_config(data_dir, **SGD), one_device)
    assert str(raised.value) == f"tasks/classification.py: {message}"


class Fixed(classification.Task):
    def updates(self):
        return (Update("train", optimizer={"optimizer": "adamw", "beta_1": 0.5}),)


def test_a_setting_an_update_fixes_over_a_given_flag_is_said(data_dir, one_device, monkeypatch, capsys):
    monkeypatch.setattr(data_lib, "task_class", lambda config: Fixed)
    build.run(helpers.make_config(data_dir, optimizer="sgd", beta_1=0.5, jit_compile="false"), one_device)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    # beta_1 was given as the update's own value, and the default settings are not "given": one line.
    assert warnings == [
        "warning: tasks/classification.py: update 'train' trains with optimizer=adamw, not --optimizer=sgd"
    ]


def _applied_twice(self, step, batch):
    gradients = step.gradients("train", batch)
    step.apply("train", gradients)
    step.apply("train", gradients)  # the same gradients again


def _applied_stale(self, step, batch):
    stale = step.gradients("train", batch)
    step.apply("train", stale)
    step.gradients("train", batch)
    step.apply("train", stale)  # taken at weights its own apply has moved since


class AppliedTwice(classification.Task):
    replica_step = _applied_twice


class AppliedStale(classification.Task):
    replica_step = _applied_stale


@pytest.mark.parametrize("task", [AppliedTwice, AppliedStale], ids=["twice", "stale"])
def test_gradients_apply_once_and_only_before_their_update_moves(data_dir, one_device, monkeypatch, task):
    monkeypatch.setattr(data_lib, "task_class", lambda config: task)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    with pytest.raises(ValueError) as raised:
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
    assert (
        str(raised.value)
        .strip()
        .splitlines()[-1]
        .endswith(
            "step.apply('train', ...): these gradients were applied already; take new step.gradients('train', ...)"
        )
    )
    assert int(trainer.plans[0].optimizer.iterations.numpy()) == 0


def test_a_forks_if_on_tensors_is_converted_in_its_loss_and_replica_step(data_dir, one_device, monkeypatch):
    """The engine converts none of its own pure functions (engine/numerics/replica.py), but every path to a task's
    code stays
    converted: a fork's loss and replica step branching on tensors train as the plain task does, to the weight."""
    config = helpers.make_config(data_dir, train_steps=3, **SGD)
    plain = build.run(config, one_device)
    plain.program.run_steps(None if plain.program.in_step else plain.program.train_iterator(), 3)
    monkeypatch.setattr(data_lib, "task_class", lambda config: Branching)
    branching = build.run(config, one_device)
    branching.program.run_steps(None if branching.program.in_step else branching.program.train_iterator(), 3)
    assert int(branching.state.step.numpy()) == 3
    for a, b in zip(_weights(plain), _weights(branching)):
        np.testing.assert_array_equal(a, b)


class Scheduled(classification.Task):
    """Two updates at other frequencies: the hidden layer's every 2nd step, the head's 3 times a step."""

    def updates(self):
        return (Update("body", trains=r"/dense/", every=2), Update("head", trains=r"/dense_1/", repeat=3))


def test_every_update_follows_the_runs_schedule_whatever_its_frequency(data_dir, one_device, monkeypatch):
    """A learning-rate schedule is a function of the run's step: warmup and cosine reach every update at the same
    steps, whether it applies every 2nd step or 3 times a step (its own count only serves Adam's bias correction)."""
    from engine.numerics import optim

    monkeypatch.setattr(data_lib, "task_class", lambda config: Scheduled)
    config = helpers.make_config(
        data_dir, hidden_sizes=(8,), jit_compile="false", lr_schedule="cosine", warmup_steps=4, train_steps=12
    )
    trainer = build.run(config, one_device)
    iterator = trainer.program.train_iterator()
    for step in range(12):
        out = trainer.program.run_steps(iterator, 1)
        expected = float(optim.learning_rate(config.optimization, step))
        assert out["body/learning_rate"] == pytest.approx(expected, rel=1e-6), step
        assert out["head/learning_rate"] == pytest.approx(expected, rel=1e-6), step
    body, head = trainer.plans
    assert (int(body.optimizer.iterations.numpy()), int(head.optimizer.iterations.numpy())) == (6, 36)


def test_the_float16_growth_interval_counts_an_updates_finite_applications(data_dir, one_device, monkeypatch):
    """--loss_scale_growth_interval counts each update's own finite applications: the head, applied 3 times a step,
    doubles its scale after 2 steps of a growth interval of 6; the body, applied every 2nd step, after its 6th
    application, at step 11."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: Scheduled)
    config = helpers.make_config(
        data_dir,
        hidden_sizes=(8,),
        jit_compile="false",
        precision="mixed_float16",
        initial_loss_scale=8.0,
        loss_scale_growth_interval=6,
    )
    trainer = build.run(config, one_device)
    iterator = trainer.program.train_iterator()
    scales = []
    for _ in range(12):
        trainer.program.run_steps(iterator, 1)
        scales.append(tuple(float(plan.loss_scale.scale.numpy()) for plan in trainer.plans))
    assert [head for _, head in scales[:4]] == [8.0, 16.0, 16.0, 32.0]  # 6 applications at steps 2 and 4
    assert [body for body, _ in scales] == [8.0] * 10 + [16.0, 16.0]  # applied at steps 1, 3, ..., 11


class Overflowing(Split):
    """Two float16 updates whose skips are routine above the loss scale's floor: the body's loss is 1e30 times the
    task's (past float16's range at any scale) and applies every 2nd step; the head's first of 2 repetitions a step
    is infinite."""

    def body_loss(self, models, batch, seed):
        return 1e30 * self.loss(self.forward(models, batch, True), batch)

    def head_loss(self, models, batch, seed, repetition):
        weight = tf.where(tf.equal(repetition, 0), float("inf"), 1.0)  # the head computes in float32
        return weight * self.loss(self.forward(models, batch, True), batch)

    def updates(self):
        return (
            Update("body", loss=self.body_loss, trains=r"/dense/", every=2),
            Update("head", loss=self.head_loss, trains=r"/dense_1/", repeat=2),
        )


def test_float16_skips_are_divergence_only_where_a_due_update_skipped_at_the_scales_floor(
    data_dir, one_device, monkeypatch
):
    """A step skipped by an update not due there, or by a repetition above the floor whose next one was finite, is
    how the loss scale learns; a run stops for divergence only on a due apply skipped with the scale at 1."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: Overflowing)
    for initial, at_floor, scales in ((2.0**10, 0, [2.0**8, 2.0**6]), (1.0, 4, [1.0, 1.0])):
        config = helpers.make_config(
            data_dir, precision="mixed_float16", initial_loss_scale=initial, loss_scale_growth_interval=10**6, **SGD
        )
        trainer = build.run(config, one_device)
        out = trainer.program.run_steps(trainer.program.train_iterator(), 4)
        assert (out["steps"], out["skipped"], out["floor_skipped"]) == (4, 4, at_floor), initial
        # The body halved at its 2 due steps, the head at each step's first repetition.
        assert [float(plan.loss_scale.scale.numpy()) for plan in trainer.plans] == scales


def test_a_float16_run_of_two_updates_reports_each_ones_loss_scale_by_name(
    data_dir, one_device, monkeypatch, tmp_path, capsys
):
    """The summary's loss_scale was the first update's, unlabelled, and the skip warning said it alone."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: Overflowing)
    config = helpers.make_config(
        data_dir, str(tmp_path), precision="mixed_float16", initial_loss_scale=2.0**10, train_steps=4,
        steps_per_loop=4, loss_scale_growth_interval=10**6, **SGD,
    )  # fmt: skip
    summary = loop.train(config, one_device)
    assert summary["loss_scale"] is None and (summary["body/loss_scale"], summary["head/loss_scale"]) == (256.0, 64.0)
    with open(tmp_path / "metrics.jsonl") as f:
        logged = json.loads(f.read())
    assert (logged["body/loss_scale"], logged["head/loss_scale"]) == (256.0, 64.0)  # as the round's last step left them
    assert "each update's loss scale halves at each step it skips; they are now body 256, head 64 " in (
        capsys.readouterr().out
    )


def test_two_float16_updates_each_unscale_with_their_own_scale(data_dir, one_device, monkeypatch):
    """Two updates whose loss scales were driven far apart (one high, one at 1): each scales and unscales with its
    own, and both train as in float32."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: Split)
    trained = {}
    for precision in ("float32", "mixed_float16"):
        config = helpers.make_config(
            data_dir, precision=precision, initial_loss_scale=2.0**14, loss_scale_growth_interval=10**6, **SGD
        )
        trainer = build.run(config, one_device)
        if precision == "mixed_float16":
            trainer.plans[1].loss_scale.scale.assign(1.0)  # the head's at its floor, the body's far above
        trainer.program.run_steps(trainer.program.train_iterator(), 10)
        scales = [float(plan.loss_scale.scale.numpy()) for plan in trainer.plans]
        trained[precision] = (_weights(trainer), scales)
    assert trained["mixed_float16"][1] == [2.0**14, 1.0]  # every step finite: neither scale moved
    for got, expected in zip(trained["mixed_float16"][0], trained["float32"][0]):
        np.testing.assert_allclose(got, expected, atol=2e-3)


class Fresh(classification.Task):
    """The head, 2 times a step, each repetition on a batch of its own and told which (its loss weighed by 1 +
    repetition); the hidden layer once, on the step's first batch."""

    def head_loss(self, models, batch, seed, repetition):
        return (1.0 + tf.cast(repetition, tf.float32)) * self.loss(self.forward(models, batch, True), batch)

    def updates(self):
        return (
            Update("body", trains=r"/dense/", optimizer={"learning_rate": BODY_RATE}),
            Update("head", loss=self.head_loss, trains=r"/dense_1/", optimizer={"learning_rate": HEAD_RATE},
                   repeat=2, fresh=True),
        )  # fmt: skip


def test_a_repetition_reads_a_fresh_batch_of_its_own_and_knows_which(data_dir, one_device, monkeypatch):
    from engine.api import training_batches

    monkeypatch.setattr(data_lib, "task_class", lambda config: Fresh)
    config = helpers.make_config(data_dir, **SGD)
    trainer = build.run(config, one_device)
    initial = _weights(trainer)
    out = trainer.program.run_steps(trainer.program.train_iterator(), 3)
    assert out["steps"] == 3 and int(trainer.state.batches.numpy()) == 6  # the data position counts every batch read
    # Written out: step t's body on batch 2t, its head's repetition r on batch 2t + r, weighed by 1 + r.
    w0, b0, w1, b1 = (tf.Variable(v) for v in initial)
    stream = training_batches(config)
    read = [next(stream) for _ in range(6)]

    def loss(batch, weight):
        x = tf.reshape(batch["image"], [len(batch["label"]), -1])
        logits = tf.nn.relu(x @ w0 + b0) @ w1 + b1
        return weight * tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["label"], logits))

    def sgd(variables, rate, batch, weight=1.0):
        with tf.GradientTape() as tape:
            value = loss(batch, weight)
        for v, g in zip(variables, tape.gradient(value, variables)):
            v.assign_sub(rate * g)

    for t in range(3):
        sgd([w0, b0], BODY_RATE, read[2 * t])
        for r in range(2):
            sgd([w1, b1], HEAD_RATE, read[2 * t + r], 1.0 + r)
    for got, expected in zip(_weights(trainer), (w0, b0, w1, b1)):
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-6)


def test_save_initial_writes_step_0_and_weights_reads_it_by_model_and_path(data_dir, one_device, tmp_path):
    from engine.api import weights

    config = helpers.make_config(data_dir, str(tmp_path), save_initial=True, train_steps=2, steps_per_loop=1, **SGD)
    initial = {v.path: v.numpy() for v in build.run(config, one_device).model.variables}  # the same seed's weights
    loop.train(config, one_device)
    assert sorted(os.listdir(tmp_path / "checkpoints"))[:2] == ["checkpoint", "ckpt-0.data-00000-of-00001"]
    saved = weights(str(tmp_path / "checkpoints" / "ckpt-0"))
    assert list(saved) == ["model"] and sorted(saved["model"]) == sorted(initial)
    for path, value in initial.items():
        np.testing.assert_array_equal(saved["model"][path], value)
    assert not np.array_equal(weights(str(tmp_path))["model"]["mlp/dense/kernel"], initial["mlp/dense/kernel"])


def test_an_updates_loss_and_gradient_norm_are_reduced_alike(data_dir, one_device, monkeypatch):
    """Over its repetitions and over the round, an update's gradient norm is a mean as its loss is: a logged line's
    numbers are each the mean over the same applications, not one the mean and the other the last."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: Split)
    config = helpers.make_config(data_dir, **SGD)
    trainer = build.run(config, one_device)
    iterator = trainer.program.train_iterator()
    steps = [trainer.program.run_steps(iterator, 1) for _ in range(4)]
    reference = build.run(config, one_device)
    round_ = reference.program.run_steps(reference.program.train_iterator(), 4)
    for name in ("body/loss", "head/loss", "body/grad_norm", "head/grad_norm"):
        assert round_[name] == pytest.approx(np.mean([s[name] for s in steps]), rel=1e-5), name


def test_the_progress_line_of_a_run_of_two_updates_shows_each_ones_loss(tmp_path):
    stream = helpers.Terminal()
    report = Report(str(tmp_path), True, 20, stream=stream)
    metrics = {"loss": None, "body/loss": 0.25, "body/grad_norm": 1.0, "body/loss_scale": None}
    metrics.update({"body/learning_rate": 0.1, "head/loss": 2.5, "head/grad_norm": 2.0, "head/loss_scale": 8.0})
    report.train(10, {**metrics, "head/learning_rate": 0.2, "examples_per_sec": 50.0, "skipped_steps": 0})
    out = stream.getvalue()
    assert "train step=10 body/loss=0.25 body/learning_rate=0.1 body/grad_norm=1 head/loss=2.5 " in out
    assert "head/grad_norm=2 head/loss_scale=8 examples_per_sec=50.0" in out
    assert "step 10/20 body/loss 0.2500 head/loss 2.5000 50 ex/s" in out


class Tied(classification.Task):
    """Two models sharing their hidden layer: its variables are trained, counted and clipped once, named by the first
    model ("a"), so an update can train them by that name."""

    def models(self, create):
        inputs = keras.Input(tuple(self.spec["image"].shape))
        hidden = keras.layers.Dense(8, activation="relu", name="hidden")  # named: paths not counted by the process
        flat = keras.layers.Flatten()(inputs)
        return {
            name: keras.Model(inputs, keras.layers.Dense(10, name=f"{name}_out")(hidden(flat)), name=name)
            for name in ("a", "b")
        }

    def forward(self, models, batch, training):
        return models["a"](batch["image"], training=training) + models["b"](batch["image"], training=training)


def test_a_variable_two_models_share_is_trained_once(data_dir, one_device, monkeypatch):
    monkeypatch.setattr(data_lib, "task_class", lambda config: Tied)
    trainer = build.run(helpers.make_config(data_dir, **SGD, learning_rate=0.1), one_device)
    assert trainer.weights.names == [
        "a/hidden/kernel", "a/hidden/bias", "a/a_out/kernel", "a/a_out/bias", "b/b_out/kernel", "b/b_out/bias"
    ]  # fmt: skip
    initial = [v.numpy() for v in trainer.weights.variables]
    (batch,) = _batches(trainer, 1)
    with tf.GradientTape() as tape:
        outputs = trainer.task.forward(trainer.models, batch, True)
        loss = tf.reduce_mean(trainer.task.loss(outputs, batch))
    grads = tape.gradient(loss, trainer.weights.variables)
    out = helpers.one_step(trainer, batch)
    assert float(out["grad_norm"]) == pytest.approx(float(tf.linalg.global_norm(grads)), rel=1e-5)
    for v, before, g in zip(trainer.weights.variables, initial, grads):
        np.testing.assert_allclose(v.numpy(), before - 0.1 * g.numpy(), atol=1e-6)  # one step of SGD, not two
