"""What research engines offer, checked exactly: --grad_accum_steps gives the update of the whole batch,
--ema_decay is the numpy moving average (checkpointed, evaluated, exported), --run_eagerly gives the graph's
numbers, a retraced round function is named once, and a task's optimizer groups hold per path."""

import inspect
import json
import linecache
import os
import pathlib
import re
import resource
import signal
import types

import numpy as np
import pytest
import tensorflow as tf

from engine.data import datasets as data_lib
from engine.numerics import forward, replica
from engine.run import build, loop
from engine.run import modes as evaluate
from engine.run.controller import Controller
from engine.settings.errors import ConfigError
from engine.state import checkpoint as checkpoint_lib
from engine.state import report as report_lib
from engine.state.report import Report
from tasks import classification
from tests import helpers

TOLERANCE = 1e-5
# Plain SGD without clipping: the update is proportional to the gradient, so a gradient of the wrong scale (a
# loss divided by the microbatch instead of the global batch) shows in the weights. (Adam would normalize it away.)
SGD = dict(optimizer="sgd", learning_rate=0.1, momentum=0.9, train_steps=4)


def _max_difference(a, b):
    """Largest absolute difference between two snapshots, over every variable and every replica's copy."""
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(copy - b[k][0]))) for k in a for copy in a[k])


def _mutant_forward(old, new):
    """engine/numerics/forward.py with `old` replaced by `new`, as a module: a defect the tests must catch."""
    source = inspect.getsource(forward)
    assert source.count(old) == 1, f"engine/numerics/forward.py no longer holds {old!r}: update this mutant"
    source = source.replace(old, new)
    # Under its own file name, in linecache: autograph reads a function's source again to convert it.
    filename = f"{forward.__file__}.mutant{len(linecache.cache)}"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType("forward_mutant")
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def _poisoned(trainer):
    """The first training batch with a NaN in its first image: a step whose gradients are not finite."""
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    image = tf.tensor_scatter_nd_update(batch["image"], [[0, 0, 0, 0]], [float("nan")])
    return {**batch, "image": image}


def _with_task(monkeypatch, cls):
    """Runs built from now on use `cls` as their task (config.task stays a real name, for validation)."""
    monkeypatch.setattr(data_lib, "task_class", lambda config: cls)


# ---- --grad_accum_steps ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accumulation_reference(data_dir, one_device):
    return helpers.train_and_snapshot(helpers.make_config(data_dir, **SGD), one_device)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
@pytest.mark.parametrize("accumulate", [2, 4])
def test_grad_accumulation_gives_the_whole_batch_update(
    data_dir, accumulation_reference, strategy, accumulate, request
):
    reference, reference_out = accumulation_reference
    config = helpers.make_config(data_dir, grad_accum_steps=accumulate, **SGD)
    snapshot, out = helpers.train_and_snapshot(config, request.getfixturevalue(strategy))
    assert out["loss"] == pytest.approx(reference_out["loss"], rel=TOLERANCE)
    assert out["grad_norm"] == pytest.approx(reference_out["grad_norm"], rel=TOLERANCE)
    assert _max_difference(snapshot, reference) < TOLERANCE


@pytest.mark.parametrize(
    "old, new",
    [
        # The loss of each microbatch divided by its own size: the gradient grows K-fold.
        ("tf.reduce_sum(per_example) / global_batch", "tf.reduce_mean(per_example)"),
        # Only the last microbatch's gradients kept.
        ("grads = part_grads if grads is None else [g + d for g, d in zip(grads, part_grads)]", "grads = part_grads"),
    ],
    ids=["loss_over_the_microbatch", "last_microbatch_only"],
)
def test_grad_accumulation_parity_catches_mutants(data_dir, one_device, accumulation_reference, monkeypatch, old, new):
    reference, _ = accumulation_reference
    monkeypatch.setattr(replica, "forward_backward", _mutant_forward(old, new).forward_backward)
    snapshot, _ = helpers.train_and_snapshot(helpers.make_config(data_dir, grad_accum_steps=2, **SGD), one_device)
    assert _max_difference(snapshot, reference) > 100 * TOLERANCE


def test_grad_accumulation_refuses_an_indivisible_replica_batch(data_dir, mirrored, tmp_path):
    with pytest.raises(ConfigError) as raised:
        build.run(helpers.make_config(data_dir, grad_accum_steps=3), mirrored)
    assert str(raised.value) == (
        "--grad_accum_steps=3: must divide each replica's batch (32 = --global_batch_size=64 over 2 replicas)"
    )
    result = helpers.launch(
        f"--workdir={tmp_path}/work", f"--data_dir={data_dir}", "--global_batch_size=64", "--grad_accum_steps=5"
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: --grad_accum_steps=5: must divide each replica's batch (64 ")
    assert not (tmp_path / "work").exists()


# ---- --ema_decay -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_ema_is_the_numpy_moving_average_and_skips_what_the_step_skips(data_dir, strategy, request):
    decay = 0.8
    strategy = request.getfixturevalue(strategy)
    # float16, where a non-finite step is skipped (in float32 the loop stops or rolls back at the round's end).
    config = helpers.make_config(data_dir, ema_decay=decay, **SGD, **helpers.NONFINITE_CASE)
    trainer = build.run(config, strategy)
    average = [v.numpy().astype(np.float64) for v in trainer.weights.variables]  # starts at the initial weights
    lagging = list(average)  # the average of the weights BEFORE each step: a defect the check must tell apart
    fixed = list(average)  # the average with the fixed decay from the first update: biased toward the start
    iterator = trainer.program.train_iterator()
    for t in range(1, 5):
        before = [v.numpy() for v in trainer.weights.variables]
        trainer.program.run_steps(iterator, 1)
        after = [v.numpy() for v in trainer.weights.variables]
        warmed = min(decay, (1 + t) / (10 + t))  # after t updates, as TensorFlow's ExponentialMovingAverage
        average = [warmed * a + (1 - warmed) * w for a, w in zip(average, after)]
        lagging = [warmed * a + (1 - warmed) * w for a, w in zip(lagging, before)]
        fixed = [decay * a + (1 - decay) * w for a, w in zip(fixed, after)]
    got = [e.numpy() for e in trainer.weights.averages]
    assert max(float(np.max(np.abs(g - a))) for g, a in zip(got, average)) < 1e-6
    assert max(float(np.max(np.abs(g - a))) for g, a in zip(got, lagging)) > 1e-3
    assert max(float(np.max(np.abs(g - a))) for g, a in zip(got, fixed)) > 1e-3
    assert max(float(np.max(np.abs(g - w))) for g, w in zip(got, after)) > 1e-3  # not simply the weights
    for e in trainer.weights.averages:
        copies = helpers.local_values(strategy, e)
        assert all(np.array_equal(c, copies[0]) for c in copies)  # every replica holds the same average

    out = helpers.one_step(trainer, _poisoned(trainer))
    assert not out["finite"]
    for e, g in zip(trainer.weights.averages, got):
        np.testing.assert_array_equal(e.numpy(), g)
    for v, w in zip(trainer.weights.variables, after):
        np.testing.assert_array_equal(v.numpy(), w)


@pytest.fixture(scope="module")
def ema_run(data_dir, one_device, tmp_path_factory):
    """A run with --ema_decay trained to step 6 in one go; (config, summary)."""
    workdir = str(tmp_path_factory.mktemp("ema_run"))
    config = helpers.make_config(data_dir, workdir, ema_decay=0.8, **{**SGD, "train_steps": 6}, steps_per_loop=3)
    return config, loop.train(config, one_device)


@pytest.mark.slow
def test_ema_is_checkpointed_and_resumed(data_dir, one_device, ema_run, tmp_path):
    config, _ = ema_run
    resumed = helpers.make_config(data_dir, str(tmp_path), ema_decay=0.8, **{**SGD, "train_steps": 3})
    loop.train(resumed, one_device)
    _, at_3 = helpers.checkpoint_tensors(str(tmp_path))
    ema_keys = sorted(k for k in at_3 if k.startswith("ema/"))
    assert len(ema_keys) == 6  # one per trained variable, keyed by its path
    # The average at step 3 is not the weights: a resume that restarted it from them would end elsewhere.
    gap = max(float(np.max(np.abs(at_3[k] - at_3[k.replace("ema/", "models/", 1)]))) for k in ema_keys)
    assert gap > 1e-3

    loop.train(helpers.make_config(data_dir, str(tmp_path), ema_decay=0.8, **{**SGD, "train_steps": 6}), one_device)
    _, resumed_end = helpers.checkpoint_tensors(str(tmp_path))
    _, uninterrupted_end = helpers.checkpoint_tensors(config.workdir)
    assert resumed_end.keys() == uninterrupted_end.keys()
    for key in ema_keys:
        np.testing.assert_allclose(resumed_end[key], uninterrupted_end[key], rtol=0, atol=1e-6, err_msg=key)


def test_the_average_forgets_the_initial_weights(data_dir, one_device, tmp_path, capsys):
    # A decay of 0.999 fixed from the first update keeps 0.999**30 = 97% of the initial weights after 30 steps:
    # the average evaluated like an untrained model. Warmed up, it averages the last few steps' weights.
    config = helpers.make_config(
        data_dir,
        str(tmp_path),
        ema_decay=0.999,
        learning_rate=0.01,
        train_steps=30,
        steps_per_loop=30,
        jit_compile=False,
    )
    summary = loop.train(config, one_device)
    results = summary["eval"]
    assert results["raw_accuracy"] > 0.6, results
    assert abs(results["accuracy"] - results["raw_accuracy"]) < 0.05, results
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval step=30 ")]
    assert printed == [f"eval step=30 {report_lib.format_metrics(results)}"] and " raw_accuracy=" in printed[0]
    evaluated = [json.loads(line) for line in open(tmp_path / "eval.jsonl")]
    assert evaluated == [{"step": 30, **results}]


def _averaged_model(data_dir, one_device, tensors):
    """A trainer without --ema_decay whose weights are the moving averages in checkpoint `tensors`."""
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    averages = helpers.by_path(tensors, "ema")
    for v in trainer.weights.variables:
        v.assign(averages[v.path])
    return trainer


def test_ema_weights_are_evaluated_and_exported(data_dir, one_device, ema_run, tmp_path):
    config, summary = ema_run
    _, tensors = helpers.checkpoint_tensors(config.workdir)
    trainer = _averaged_model(data_dir, one_device, tensors)
    averaged = trainer.evaluator.evaluate()
    assert summary["eval"]["accuracy"] == averaged["accuracy"]
    assert summary["eval"]["loss"] == pytest.approx(averaged["loss"], rel=1e-6)
    # The weights themselves evaluate to another loss, reported beside the average's.
    weights = helpers.by_path(tensors, "models")
    for v in trainer.weights.variables:
        v.assign(weights[v.path])
    raw = trainer.evaluator.evaluate()
    assert abs(raw["loss"] - averaged["loss"]) > 1e-4
    assert summary["eval"]["raw_loss"] == pytest.approx(raw["loss"], rel=1e-6)
    assert summary["eval"]["raw_accuracy"] == raw["accuracy"]
    assert list(summary["eval"]) == ["accuracy", "loss", "raw_accuracy", "raw_loss", "examples"]

    export_dir = evaluate.export(helpers.make_config(data_dir, config.workdir, mode="export"))
    images = next(iter(trainer.data.eval_fn(tf.distribute.InputContext())))["image"]
    served = tf.saved_model.load(export_dir).signatures["serving_default"](images=images)["logits"].numpy()
    reference = _averaged_model(data_dir, one_device, tensors).model(images, training=False).numpy()
    np.testing.assert_allclose(served, reference, rtol=0, atol=1e-5)
    for taken in (tmp_path / "afile", export_dir):  # a file, a SavedModel already there: refused, untouched
        if taken != export_dir:
            taken.write_text("mine")
        before = sorted(os.walk(taken)) if os.path.isdir(taken) else pathlib.Path(taken).read_text()
        with pytest.raises(ConfigError, match=f"^--export_dir={taken}: exists and is not an empty directory"):
            evaluate.export(helpers.make_config(data_dir, config.workdir, mode="export", export_dir=str(taken)))
        assert before == (sorted(os.walk(taken)) if os.path.isdir(taken) else pathlib.Path(taken).read_text())
    # The same without --export_dir: the message named an --export_dir the user never typed.
    with pytest.raises(ConfigError) as refused:
        evaluate.export(helpers.make_config(data_dir, config.workdir, mode="export"))
    assert str(refused.value) == (
        f"--mode=export: step 6 is exported already, to {export_dir} (not an empty directory); refusing to overwrite "
        "it: give --export_dir to export it elsewhere"
    )
    # A full disk: the line was TensorFlow's own ("{{function_node __wrapped__SaveV2...}} ...; File too large
    # [Op:SaveV2]"), and the half SavedModel was left beside the target.
    full = tmp_path / "full"
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(checkpoint_lib.CheckpointError) as failed:
            evaluate.export(helpers.make_config(data_dir, config.workdir, mode="export", export_dir=str(full)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert str(failed.value) == f"cannot write the SavedModel to {full}: File too large"
    assert not os.path.exists(full) and not os.path.exists(f"{full}.incomplete")


# ---- --run_eagerly ---------------------------------------------------------------------------------------------


class PrintingTask(classification.Task):
    """Classification whose loss prints: what a fork debugging its task would write."""

    def loss(self, outputs, batch):
        print(f"printing-task loss over {batch['label'].shape[0]} examples")
        return super().loss(outputs, batch)


def _printed_steps(capsys, trainer, steps):
    capsys.readouterr()
    out = trainer.program.run_steps(trainer.program.train_iterator(), steps)
    return out, capsys.readouterr().out.count("printing-task loss over 64 examples")


def test_run_eagerly_gives_the_graph_numbers_and_prints(data_dir, one_device, monkeypatch, capsys):
    _with_task(monkeypatch, PrintingTask)
    try:
        graph = build.run(helpers.make_config(data_dir, **SGD), one_device)
        graph_out, graph_prints = _printed_steps(capsys, graph, 3)
        eager = build.run(helpers.make_config(data_dir, run_eagerly=True, **SGD), one_device)
        eager_out, eager_prints = _printed_steps(capsys, eager, 3)
    finally:
        tf.config.run_functions_eagerly(False)
    assert (graph_prints, eager_prints) == (1, 3)  # graph: once, as it traces; eager: every step
    assert eager_out["loss"] == pytest.approx(graph_out["loss"], rel=1e-6)
    assert _max_difference(helpers.snapshot(eager), helpers.snapshot(graph)) < 1e-6


def test_run_eagerly_runs_mirrored(data_dir, mirrored, tmp_path):
    # The whole run: two steps, a checkpoint and the evaluation, without graphs on two replicas.
    config = helpers.make_config(data_dir, str(tmp_path), run_eagerly=True, **{**SGD, "train_steps": 2})
    try:
        trainer = build.run(config, mirrored)
        checkpoints = checkpoint_lib.Checkpoints(trainer.state, config.workdir, keep=1)
        summary = Controller(trainer, Report(config.workdir, True, config.train_steps), checkpoints, 0.0).train()
    finally:
        tf.config.run_functions_eagerly(False)
    assert summary["step"] == 2 and summary["skipped_steps"] == 0 and np.isfinite(summary["train_loss"])
    assert summary["eval"]["examples"] == 360 and int(trainer.plans[0].optimizer.iterations.numpy()) == 2
    for name, copies in helpers.snapshot(trainer).items():
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=name)


# ---- The retrace warning ---------------------------------------------------------------------------------------


class CroppingTask(classification.Task):
    """Trains on the top `rows` rows of each image (padded back for the model): a curriculum that grows its
    inputs between rounds, so each round's batches have another shape."""

    rows = 8

    def prepare(self, batch):
        prepared = super().prepare(batch)
        return {**prepared, "image": prepared["image"][:, : self.rows]}

    def forward(self, models, batch, training):
        image = batch["image"]
        image = tf.pad(image, [[0, 0], [0, 8 - image.shape[1]], [0, 0], [0, 0]])
        return models["model"](image, training=training)


RETRACE = re.compile(r"^warning: (\w+) was traced (\d+) times", re.MULTILINE)


@pytest.mark.slow
def test_a_retraced_round_is_named_once(data_dir, one_device, monkeypatch, capsys):
    _with_task(monkeypatch, CroppingTask)
    trainer = build.run(helpers.make_config(data_dir, **SGD), one_device)
    # batches of a new shape come from the pipeline (a step that gathers traces once)
    trainer.program.input = trainer.program.input_path(in_step=False)
    capsys.readouterr()
    for rows in (8, 6, 4):
        trainer.task.rows = rows
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
    assert RETRACE.findall(capsys.readouterr().out) == [("train_loop", "2")]
    assert trainer.program.train_loop.experimental_get_tracing_count() == 3


def test_a_normal_run_warns_of_no_retrace(data_dir, one_device, tmp_path, capsys):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=6, steps_per_loop=2, eval_every=2)
    loop.train(config, one_device)
    printed = capsys.readouterr().out
    assert "eval step=4" in printed  # several rounds and evaluations ran
    assert not RETRACE.findall(printed)


# ---- Optimizer groups ------------------------------------------------------------------------------------------


class GroupedTask(classification.Task):
    # The first layer frozen by its learning rate; the head updated by plain SGD, which keeps no slot.
    optimizer_groups = (
        (r"^model/mlp/dense/", {"learning_rate": 0.0}),
        (r"^model/mlp/dense_2/", {"optimizer": "sgd", "momentum": 0.0, "learning_rate": 0.05}),
    )


def test_optimizer_groups_hold_per_path(data_dir, one_device, monkeypatch, tmp_path):
    _with_task(monkeypatch, GroupedTask)
    trainer = build.run(helpers.make_config(data_dir, optimizer="adamw", learning_rate=1e-2), one_device)
    before = {v.path: v.numpy() for v in trainer.weights.variables}
    out = trainer.program.run_steps(trainer.program.train_iterator(), 3)
    assert out["learning_rate"] == pytest.approx(1e-2)  # the run's own rate, not a group's
    for v in trainer.weights.variables:
        moved = float(np.max(np.abs(v.numpy() - before[v.path])))
        if v.path.startswith("mlp/dense/"):
            assert moved == 0.0, v.path
        else:
            assert moved > 1e-4, v.path

    path = checkpoint_lib.Checkpoints(trainer.state, str(tmp_path), keep=1).save()
    slots = {k for k in tf.train.load_checkpoint(path).get_variable_to_shape_map() if k.startswith("optimizer/slots")}
    expected = {
        f"optimizer/slots_by_path/model.S{layer}.S{name}/{k}/.ATTRIBUTES/VARIABLE_VALUE"
        for layer in ("mlp.Sdense", "mlp.Sdense_1")
        for name in ("kernel", "bias")
        for k in (0, 1)
    }
    assert slots == expected


class TwinTask(classification.Task):
    """Two models of one family, both trained (a fork's ensemble or GAN): their Keras paths coincide."""

    optimizer_groups = ((r"^second/", {"learning_rate": 0.0}),)

    def models(self, create):
        return {name: create("mlp", self.spec["image"], self.outputs) for name in ("first", "second")}

    def forward(self, models, batch, training):
        image = batch["image"]
        return (models["first"](image, training=training) + models["second"](image, training=training)) / 2


def test_models_of_one_family_keep_their_own_slots_and_averages(data_dir, one_device, monkeypatch, tmp_path):
    _with_task(monkeypatch, TwinTask)
    trainer = build.run(helpers.make_config(data_dir, optimizer="adamw", ema_decay=0.5), one_device)
    assert (
        len(trainer.weights.variables) == 12
        and trainer.weights.variables[0].path == trainer.weights.variables[6].path == "mlp/dense/kernel"
    )
    slots = [s for per_param in trainer.plans[0].optimizer.slots for s in per_param]
    assert len({id(s) for s in slots}) == 24  # two per variable, none shared
    before = [v.numpy() for v in trainer.weights.variables]
    trainer.program.run_steps(trainer.program.train_iterator(), 3)
    for k, (v, old) in enumerate(zip(trainer.weights.variables, before)):
        moved = float(np.max(np.abs(v.numpy() - old)))
        assert (moved == 0.0) if k >= 6 else (moved > 1e-4), (k, v.path)  # the group names the model

    keys = tf.train.load_checkpoint(checkpoint_lib.Checkpoints(trainer.state, str(tmp_path), keep=1).save())
    keys = keys.get_variable_to_shape_map()
    assert len([k for k in keys if k.startswith("optimizer/slots")]) == 24
    assert len([k for k in keys if k.startswith("ema/")]) == 12


def test_an_optimizer_group_that_matches_nothing_is_named(capsys):
    from engine.numerics import optim

    groups = ((r"^mlp/dense/", {"learning_rate": 0.0}), (r"dense/", {"learning_rate": 0.1}))
    optim.Optimizer(helpers.make_config("unused"), [tf.zeros([2])], ["model/mlp/dense/bias"], groups)
    assert capsys.readouterr().out == (
        "warning: optimizer group '^mlp/dense/' matches no trained variable (e.g. model/mlp/dense/bias)\n"
    )


def test_the_evaluation_sums_its_batches_to_float32_precision_however_many_there_are(one_device):
    # Added plainly in float32, 4,000 batches of 0.1 after one of 1e7 summed to 10,000,000 (the 400 lost), and an
    # odd count of examples past 2**24 lost one.
    from engine.run.evaluator import Evaluator

    batches = np.tile(np.array([[0.1, 37.0]], np.float32), (4001, 1))
    batches[0] = [1e7, 2.0**24]
    evaluator = types.SimpleNamespace(metric_names=["loss"], strategy=one_device, eval_step=tf.identity)
    iterator = iter(tf.data.Dataset.from_tensor_slices(batches))
    loop = tf.function(lambda iterator, steps: Evaluator._eval_loop(evaluator, iterator, steps))
    total = loop(iterator, tf.constant(len(batches))).numpy()
    exact = batches.astype(np.float64).sum(axis=0)
    assert total[1] == exact[1] == 2**24 + 4000 * 37  # every example counted
    assert total[0] == np.float32(exact[0])  # 10,000,400 to float32's precision (exactly so here)
