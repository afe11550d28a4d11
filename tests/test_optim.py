"""Engine optimizers match Keras's optimizers of the same name step by step; the schedule's numbers."""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from engine.data import datasets as data_lib
from engine.numerics import optim
from engine.run import build, loop
from engine.settings.errors import TaskError
from engine.settings.fields import Config
from tasks import classification
from tests import helpers

SHAPES = [(6, 4), (4,), (4, 3)]

CASES = [
    ("sgd", dict(momentum=0.0), lambda lr, wd: keras.optimizers.SGD(lr, momentum=0.0, weight_decay=wd)),
    ("sgd", dict(momentum=0.9), lambda lr, wd: keras.optimizers.SGD(lr, momentum=0.9, weight_decay=wd)),
    (
        "sgd",
        dict(momentum=0.9, nesterov=True),
        lambda lr, wd: keras.optimizers.SGD(lr, momentum=0.9, nesterov=True, weight_decay=wd),
    ),
    (
        "adamw",
        dict(beta_1=0.8, beta_2=0.99, epsilon=1e-7),
        lambda lr, wd: keras.optimizers.AdamW(lr, weight_decay=wd, beta_1=0.8, beta_2=0.99, epsilon=1e-7),
    ),
    ("lamb", dict(epsilon=1e-6), lambda lr, wd: keras.optimizers.Lamb(lr, epsilon=1e-6, weight_decay=wd)),
]


@pytest.mark.parametrize("name,hyper,make_keras", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_matches_keras_step_by_step(name, hyper, make_keras, weight_decay):
    rng = np.random.default_rng(0)
    start = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    ours = [tf.Variable(x) for x in start]
    theirs = [keras.Variable(x) for x in start]
    config = Config(optimizer=name, learning_rate=0.05, weight_decay=weight_decay, **hyper)
    optimizer = optim.Optimizer(config, ours, [f"p{i}" for i in range(len(ours))])
    reference = make_keras(0.05, weight_decay)
    reference.build(theirs)
    # The engine decays kernels only; tell Keras the same.
    reference.exclude_from_weight_decay(var_list=[v for v in theirs if len(v.shape) < 2])
    for step in range(12):
        grads = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in SHAPES]
        new_params, new_slots, _ = optimizer.updates(
            [v.value() for v in ours],
            [[s.value() for s in ss] for ss in optimizer.slots],
            optimizer.iterations.value(),
            grads,
        )
        for var, value in zip(ours, new_params):
            var.assign(value)
        for slots, values in zip(optimizer.slots, new_slots):
            for slot, value in zip(slots, values):
                slot.assign(value)
        optimizer.iterations.assign_add(1)
        reference.apply_gradients(zip(grads, theirs))
        for mine, keras_var in zip(ours, theirs):
            np.testing.assert_allclose(mine.numpy(), keras_var.numpy(), rtol=2e-6, atol=2e-7, err_msg=f"step {step}")
    moved = max(float(np.max(np.abs(v.numpy() - s))) for v, s in zip(ours, start))
    assert moved > 0.05  # the comparison is not between two untouched copies


def _lr(step, **overrides):
    return float(optim.learning_rate(Config(**overrides), step))


def test_warmup_then_cosine_to_zero():
    kw = dict(learning_rate=0.4, warmup_steps=10, lr_schedule="cosine", train_steps=110)
    assert _lr(0, **kw) == pytest.approx(0.04)
    assert _lr(4, **kw) == pytest.approx(0.2)
    assert _lr(9, **kw) == pytest.approx(0.4)
    assert _lr(60, **kw) == pytest.approx(0.2)
    assert _lr(35, **kw) == pytest.approx(0.2 * (1 + math.cos(math.pi / 4)))
    assert _lr(110, **kw) == pytest.approx(0.0, abs=1e-9)


def test_cosines_last_rates_are_right_to_float32s_precision():
    # 0.5 (1 + cos(pi progress)) in float32 lost the rates near the end to 1 + cos's cancellation: at 100,000 steps
    # the last step's was 0 (2.47e-10 x the peak) and the thousandth from last was 2.4e-4 off.
    train_steps = 100_000
    for step in (99_000, 99_990, 99_999):
        expected = 0.5 * (1 + math.cos(math.pi * step / train_steps))
        assert _lr(step, learning_rate=1.0, lr_schedule="cosine", train_steps=train_steps) == pytest.approx(
            expected, rel=1e-6
        ), step


def test_constant_and_linear_scaling():
    assert _lr(500, learning_rate=0.1) == pytest.approx(0.1)
    assert _lr(0, learning_rate=0.1, lr_scaling="linear", global_batch_size=1024, base_batch_size=256) == (
        pytest.approx(0.4)
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        # A warmup past the run's end: under cosine every step's rate was 0, the run trained nothing, silently.
        ({"warmup_steps": 40, "lr_schedule": "cosine"}, "warmup_steps=40: must be less than --train_steps=20"),
        ({"warmup_steps": 20}, "warmup_steps=20: must be less than --train_steps=20"),
        # A schedule the engine does not have was a KeyError traceback as the step traced; a scaling, none at all.
        ({"lr_schedule": "linear"}, "lr_schedule=linear: must be one of constant, cosine"),
        ({"lr_scaling": "sqrt"}, "lr_scaling=sqrt: must be one of none, linear"),
        # Each trained as if it were not there, silently, where the flag is refused: the rule does not read it, or
        # the scaling does not.
        ({"momentum": 0.5}, "momentum=0.5: nothing here reads it (read by --optimizer=sgd)"),
        (
            {"optimizer": "sgd", "beta_1": 0.5},
            "beta_1=0.5: nothing here reads it (read by --optimizer=adamw and --optimizer=lamb)",
        ),
        ({"base_batch_size": 32}, "base_batch_size=32: nothing here reads it (read by --lr_scaling=linear)"),
        (
            {"optimizer": "sgd", "momentum": 0.0, "nesterov": True},
            "nesterov=true: needs --momentum above 0: with --momentum=0 it would train as plain SGD",
        ),
        # Run-wide: the run trains the flags' batch and steps whatever a group says; its rate alone may read them.
        (
            {"global_batch_size": 1024},
            "global_batch_size=1024: nothing here reads it (its learning rate does, with --lr_scaling=linear; the "
            "run's is --global_batch_size=128)",
        ),
        (
            {"train_steps": 5},
            "train_steps=5: nothing here reads it (its learning rate does, with --lr_schedule=cosine; the run's is "
            "--train_steps=20)",
        ),
    ],
    ids=[
        *("warmup_cosine", "warmup_constant", "schedule", "scaling", "momentum", "beta_1", "base_batch_size"),
        *("nesterov", "global_batch_size", "train_steps"),
    ],
)
@pytest.mark.parametrize("group", [False, True])
def test_an_updates_and_a_groups_settings_are_checked_as_the_flags_are(settings, message, group):
    with pytest.raises(TaskError) as refused:
        optim.checked_settings(Config(train_steps=20).optimization, settings, "update 'a'", group=group)
    assert str(refused.value) == f"update 'a': {message}"


@pytest.mark.parametrize(
    "settings",
    [
        {"optimizer": "sgd", "momentum": 0.5, "nesterov": True},
        {"lr_scaling": "linear", "base_batch_size": 32},
        {"lr_scaling": "linear", "global_batch_size": 1024},  # its rate as if its batch were 1024
        {"lr_schedule": "cosine", "train_steps": 10},  # its rate decays to 0 at step 10
        {"momentum": 0.9, "beta_1": 0.9, "global_batch_size": 128},  # the run's own values: no change
    ],
)
def test_a_setting_read_there_or_the_runs_own_is_taken(settings):
    checked = optim.checked_settings(Config(train_steps=20).optimization, settings, "update 'a'", group=True)
    assert {name: getattr(checked, name) for name in settings} == settings


def test_weight_decay_skips_biases():
    params = [tf.Variable(np.ones((2, 2), np.float32)), tf.Variable(np.ones(2, np.float32))]
    config = Config(optimizer="sgd", momentum=0.0, learning_rate=0.5, weight_decay=0.1)
    optimizer = optim.Optimizer(config, params, ["kernel", "bias"])
    new, _, _ = optimizer.updates(
        [p.value() for p in params], [[], []], tf.constant(0, tf.int64), [tf.zeros((2, 2)), tf.zeros(2)]
    )
    np.testing.assert_allclose(new[0], 0.95)  # 1 - lr * wd
    np.testing.assert_allclose(new[1], 1.0)


def test_weight_decay_skips_biases_and_norms_of_any_rank():
    # Keras's attention keeps a bias per head, [heads, head_dim], and a norm over two axes a 2-D gamma, beta or
    # scale: none of them is a kernel, whatever its rank. An embedding table is decayed, as a kernel is.
    paths = ["model/t/attention/query/kernel", "model/t/attention/query/bias", "model/t/norm/gamma"]
    paths += ["model/t/norm/beta", "model/t/rms/scale", "model/t/embedding/embeddings"]
    params = [tf.Variable(np.ones((2, 2), np.float32)) for _ in paths]
    config = Config(optimizer="sgd", momentum=0.0, learning_rate=0.5, weight_decay=0.1)
    optimizer = optim.Optimizer(config, params, paths)
    new, _, _ = optimizer.updates(
        [p.value() for p in params], [[] for _ in paths], tf.constant(0, tf.int64), [tf.zeros((2, 2)) for _ in paths]
    )
    assert [float(p[0, 0]) for p in new] == pytest.approx([0.95, 1.0, 1.0, 1.0, 1.0, 0.95])


def _sgd_rates(groups, paths):
    """(rate_names, {name: rate} returned by one update, new parameter values) of plain SGD at the run's 1e-3 with
    `groups`, over parameters of ones with gradients of ones, one per path."""
    params = [tf.Variable(np.ones(2, np.float32)) for _ in paths]
    config = Config(optimizer="sgd", momentum=0.0, learning_rate=1e-3)
    optimizer = optim.Optimizer(config, params, paths, groups)
    new, _, rates = optimizer.updates(
        [p.value() for p in params], [[] for _ in paths], tf.constant(0, tf.int64), [tf.ones(2) for _ in paths]
    )
    return optimizer.rate_names, {k: float(v) for k, v in rates.items()}, [float(p[0]) for p in new]


def test_learning_rates_are_those_the_groups_used():
    # Every variable in a group: the run's own rate trains nothing and is not reported as if it did.
    groups = ((r"^generator/", {"learning_rate": 2e-4}), (r"^discriminator/", {"learning_rate": 4e-4}))
    names, rates, new = _sgd_rates(groups, ["discriminator/kernel", "generator/kernel", "discriminator/bias"])
    assert names == ["learning_rate/^generator/", "learning_rate/^discriminator/"]
    assert rates == {
        "learning_rate/^generator/": pytest.approx(2e-4),
        "learning_rate/^discriminator/": pytest.approx(4e-4),
    }
    assert new == pytest.approx([1 - 4e-4, 1 - 2e-4, 1 - 4e-4])  # each the rate logged for its group
    # Some variables with the run's settings: its rate comes first, under the name a one-group run logs.
    names, rates, new = _sgd_rates(((r"^head/", {"learning_rate": 1e-2}),), ["body/kernel", "head/kernel"])
    assert names == ["learning_rate", "learning_rate/^head/"]
    assert rates == {"learning_rate": pytest.approx(1e-3), "learning_rate/^head/": pytest.approx(1e-2)}
    assert new == pytest.approx([1 - 1e-3, 1 - 1e-2])
    # No groups: one rate, named as always.
    assert _sgd_rates((), ["a", "b"])[:2] == (["learning_rate"], {"learning_rate": pytest.approx(1e-3)})


class EveryVariableGrouped(classification.Task):
    optimizer_groups = ((r"^model/", {"learning_rate": 2e-4}),)


def test_the_step_reports_the_rate_its_groups_used(data_dir, one_device, monkeypatch):
    monkeypatch.setattr(data_lib, "task_class", lambda config: EveryVariableGrouped)
    config = helpers.make_config(data_dir, optimizer="sgd", momentum=0.0, learning_rate=1e-3, jit_compile="false")
    trainer = build.run(config, one_device)
    assert trainer.plans[0].optimizer.rate_names == ["learning_rate/^model/"]
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    out = helpers.one_step(trainer, batch)
    assert sorted(out) == ["finite", "grad_norm", "learning_rate/^model/", "loss", "loss_scale", "stop"]
    assert float(out["learning_rate/^model/"]) == pytest.approx(2e-4)


def test_metrics_and_console_carry_the_rate_the_groups_used(data_dir, one_device, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data_lib, "task_class", lambda config: EveryVariableGrouped)
    workdir = str(tmp_path / "run")
    config = helpers.make_config(
        data_dir,
        workdir,
        optimizer="sgd",
        momentum=0.0,
        learning_rate=1e-3,
        jit_compile="false",
        train_steps=2,
        steps_per_loop=2,
        eval_every=0,
    )
    loop.train(config, one_device)
    with open(f"{workdir}/metrics.jsonl") as f:
        record = json.loads(f.readline())
    assert "learning_rate" not in record  # no variable trained at the run's 1e-3
    assert record["learning_rate/^model/"] == pytest.approx(2e-4)
    assert " learning_rate/^model/=0.0002 " in capsys.readouterr().out


def _bfloat16(x):
    return np.asarray(x, np.float32).astype(tf.bfloat16.as_numpy_dtype).astype(np.float32)


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_first_moment_in_bfloat16_is_stored_rounded_and_nothing_else(name):
    rng = np.random.default_rng(1)
    start = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        params = [tf.Variable(x) for x in start]
        config = Config(optimizer=name, learning_rate=0.05, weight_decay=0.05, first_moment_dtype=dtype)
        runs[dtype] = (params, optim.Optimizer(config, params, [f"p{i}" for i in range(len(params))]))
    params, optimizer = runs["bfloat16"]
    assert [[s.dtype for s in slots] for slots in optimizer.slots] == [[tf.bfloat16, tf.float32]] * len(SHAPES)
    assert [[s.dtype for s in slots] for slots in runs["float32"][1].slots] == [[tf.float32] * 2] * len(SHAPES)
    gradients = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(8)]
    for grads in gradients:
        for params, optimizer in runs.values():
            slots_before = [[s.numpy().astype(np.float32) for s in ss] for ss in optimizer.slots]
            new_params, new_slots, _ = optimizer.updates(
                [v.value() for v in params],
                [[s.value() for s in ss] for ss in optimizer.slots],
                optimizer.iterations.value(),
                [tf.constant(g) for g in grads],
            )
            for var, value in zip(params, new_params):
                var.assign(value)
            for slots, values, before, g in zip(optimizer.slots, new_slots, slots_before, grads):
                # The first moment as float32 computes it, then rounded to its stored dtype; the second exact.
                m = before[0] + (g - before[0]) * (1.0 - 0.9)
                stored = _bfloat16(m) if slots[0].dtype == tf.bfloat16 else m
                np.testing.assert_allclose(values[0].numpy().astype(np.float32), stored, rtol=1e-6, atol=1e-9)
                np.testing.assert_allclose(values[1].numpy(), before[1] + (g * g - before[1]) * (1.0 - 0.999))
                for slot, value in zip(slots, values):
                    slot.assign(value)
            optimizer.iterations.assign_add(1)
    narrow, wide = ([v.numpy() for v in runs[d][0]] for d in ("bfloat16", "float32"))
    # Rounding m moves the weights a little, never far: within bfloat16's relative step of the update's size.
    for a, b, s in zip(narrow, wide, start):
        assert not np.array_equal(a, b)
        np.testing.assert_allclose(a, b, atol=0.01 * float(np.max(np.abs(b - s))))


@pytest.mark.slow
def test_a_bfloat16_first_moment_resumes_exactly(data_dir, one_device, tmp_path):
    settings = dict(first_moment_dtype="bfloat16", jit_compile="false", steps_per_loop=2, checkpoint_every=2)
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    loop.train(helpers.make_config(data_dir, whole, train_steps=4, **settings), one_device)
    loop.train(helpers.make_config(data_dir, halves, train_steps=2, **settings), one_device)
    loop.train(helpers.make_config(data_dir, halves, train_steps=4, **settings), one_device)
    (_, a), (_, b) = helpers.checkpoint_tensors(whole), helpers.checkpoint_tensors(halves)
    slots = [k for k in a if "/slots_by_path/" in k]
    first, second = ([k for k in slots if f"/{i}/.ATTRIBUTES" in k] for i in (0, 1))
    assert len(first) == len(second) == 6  # the MLP's three kernels and three biases
    assert {a[k].dtype for k in first} == {np.dtype(tf.bfloat16.as_numpy_dtype)}
    assert {a[k].dtype for k in second} == {np.dtype(np.float32)}
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class CosineHead(classification.Task):
    """The hidden layer at the run's constant rate, the head's own cosine; or, under a run's cosine, both constant."""

    head_schedule = "cosine"

    def updates(self):
        from engine.api import Update

        return (
            Update("body", trains=r"/dense/", optimizer={"lr_schedule": "constant"}),
            Update("head", trains=r"/dense_1/", optimizer={"lr_schedule": self.head_schedule}),
        )


@pytest.mark.parametrize("run_schedule, head_schedule", [("constant", "cosine"), ("cosine", "constant")])
def test_a_higher_train_steps_says_which_rates_now_decay_to_its_end(
    data_dir, one_device, tmp_path, monkeypatch, capsys, run_schedule, head_schedule
):
    # The line named the run's --lr_schedule alone: an update's own cosine was stretched unsaid, and a run's cosine
    # that every update replaced was said to decay.
    monkeypatch.setattr(CosineHead, "head_schedule", head_schedule)
    monkeypatch.setattr(data_lib, "task_class", lambda config: CosineHead)
    settings = dict(hidden_sizes=(8,), jit_compile="false", lr_schedule=run_schedule, eval_every=0)
    for steps in (2, 4):
        loop.train(helpers.make_config(data_dir, str(tmp_path), train_steps=steps, **settings), one_device)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("--train_steps=4"))
    decays = "; head/learning_rate (lr_schedule=cosine) now decays to 0 at step 4, not 2"
    assert line == "--train_steps=4 (was 2): training on to step 4" + (decays if head_schedule == "cosine" else "")


class ScaledHead(classification.Task):
    def updates(self):
        from engine.api import Update

        head = {"lr_scaling": "linear", "base_batch_size": 32, "lr_schedule": "cosine"}
        return (Update("body", trains=r"/dense/"), Update("head", trains=r"/dense_1/", optimizer=head))


def test_the_summary_records_what_each_updates_rate_reads(data_dir, one_device, tmp_path, monkeypatch):
    # The head's rate is 4x the body's (128 / 32), and it decays to 0 at step 2: summary.json and config.json said
    # lr_scaling=linear and cosine, but neither the base batch nor the batch and steps the rate reads.
    monkeypatch.setattr(data_lib, "task_class", lambda config: ScaledHead)
    settings = dict(hidden_sizes=(8,), jit_compile="false", train_steps=2, global_batch_size=128, learning_rate=0.01)
    config = helpers.make_config(data_dir, str(tmp_path), **settings)
    summary = loop.train(config, one_device)
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)["updates"]
    for effective in (summary["updates"], saved):
        assert effective["head"]["base_batch_size"] == 32
        assert (effective["head"]["global_batch_size"], effective["head"]["train_steps"]) == (128, 2)
        assert not {"base_batch_size", "global_batch_size", "train_steps"} & set(effective["body"])
    assert summary["head/learning_rate"] == pytest.approx(4 * 0.01 * 0.5 * (1 + math.cos(math.pi / 2)))  # step 1
