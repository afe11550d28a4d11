"""The host loop: exact step counts, one trace, XLA compilation, evaluation that counts every example once,
and reduced precisions that train as well as float32."""

import dataclasses
import json
import threading
import time
import weakref

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from engine.cluster import distribute
from engine.run import build, inputs, loop, program
from engine.run.controller import Controller
from engine.run.evaluator import Evaluator
from engine.run.program import TrainProgram
from engine.settings.errors import ConfigError, Preempted
from engine.state.checkpoint import Checkpoints
from engine.state.report import Report
from tests import helpers


def _run(config, strategy):
    trainer = build.run(config, strategy)
    checkpoints = Checkpoints(trainer.state, config.workdir, config.keep_checkpoints)
    summary = Controller(trainer, Report(config.workdir, True, config.train_steps), checkpoints, 0.0).train()
    return trainer, summary


def test_the_summarys_throughput_leaves_out_every_round_that_traced(data_dir, one_device, tmp_path):
    """A round that traced the step includes its tracing and compilation: a process whose every round traced has no
    throughput to report (a resumed one-round run reported 2,322 examples/s where its rounds run 60,000)."""
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=4, steps_per_loop=4, hidden_sizes=(8,))
    assert loop.train(config, one_device)["examples_per_sec"] is None
    config = dataclasses.replace(config, train_steps=8)
    assert loop.train(config, one_device)["examples_per_sec"] is None  # its one round traced the step again
    summary = loop.train(dataclasses.replace(config, train_steps=16), one_device)  # rounds 9-12 (traced), 13-16
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r["traced"]) for r in records] == [(4, True), (8, True), (12, True), (16, False)]
    assert summary["examples_per_sec"] == pytest.approx(records[-1]["examples_per_sec"])


def test_inner_loop_traced_once_with_exact_step_counts(data_dir, one_device, tmp_path):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10, steps_per_loop=3, eval_every=5)
    trainer, summary = _run(config, one_device)
    logged = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    # Rounds end at multiples of steps_per_loop (3) and of eval_every (5): a function of the step alone,
    # so a resumed run cuts its rounds where an uninterrupted one does.
    assert logged == [3, 5, 6, 9, 10]
    assert [json.loads(line)["step"] for line in open(tmp_path / "eval.jsonl")] == [5, 10]
    assert trainer.program.train_loop.experimental_get_tracing_count() == 1
    assert trainer.evaluator.eval_loop.experimental_get_tracing_count() == 1
    assert int(trainer.state.step.numpy()) == 10 and int(trainer.plans[0].optimizer.iterations.numpy()) == 10
    assert summary["step"] == 10 and summary["skipped_steps"] == 0


def test_finished_iterators_are_deleted_off_the_loops_thread(data_dir, mirrored, tmp_path, monkeypatch):
    """Deleting an autotuned tf.data iterator waits for its tuning thread to wake (TensorFlow 2.21: up to 60 s, 12 s
    measured at a short run's end): the training iterator when the loop ends and every evaluation's are deleted on a
    thread of their own, so neither the final evaluation nor the process's exit waits for them."""
    deleted = []

    def watched(iterator, kind):
        weakref.finalize(iterator, lambda: deleted.append((kind, threading.current_thread().name)))
        return iterator

    class Watched:
        def __init__(self, dataset):
            self.dataset = dataset

        def __iter__(self):
            return watched(iter(self.dataset), "eval")

    train_iterator, eval_dataset = TrainProgram.train_iterator, Evaluator.__dict__["dataset"].func
    monkeypatch.setattr(TrainProgram, "train_iterator", lambda self: watched(train_iterator(self), "train"))
    monkeypatch.setattr(Evaluator, "dataset", property(lambda self: Watched(eval_dataset(self))))
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=4, steps_per_loop=2, eval_every=2)
    summary = loop.train(config, mirrored)
    for thread in threading.enumerate():
        if thread.name == "release_iterators":
            thread.join(timeout=120)
    assert summary["step"] == 4 and len(helpers.logged_steps(str(tmp_path), "eval.jsonl")) == 2
    assert sorted(deleted) == [("eval", "release_iterators")] * 2 + [("train", "release_iterators")]


def test_one_cpu_device_evaluates_from_the_datasets_own_iterator(data_dir, one_device, monkeypatch):
    """On one CPU device the evaluation reads the dataset's own iterator, as its training does: deleting the
    strategy's distributed one blocks (9.6 s after the 6-layer decoder's evaluation, the dataset's own 0.2 s), which
    held the process's exit. The same results as from the distributed iterator."""
    read = []
    releasing = inputs.releasing
    monkeypatch.setattr(inputs, "releasing", lambda held: releasing(read.extend(map(type, held)) or held))
    trainer = build.run(helpers.make_config(data_dir), one_device)
    own = trainer.evaluator.evaluate()
    assert [kind.__name__ for kind in read] == ["OwnedIterator"]
    monkeypatch.setattr(inputs, "one_cpu_device", lambda strategy: False)
    distributed = build.run(helpers.make_config(data_dir), one_device).evaluator.evaluate()
    assert [kind.__name__ for kind in read[1:]] == ["DistributedIterator"]
    assert own["examples"] == distributed["examples"] == 360
    assert own == pytest.approx(distributed, rel=1e-6)


def test_profile_steps_trace_exactly_those_steps(data_dir, one_device, tmp_path):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=9, steps_per_loop=100, profile_steps=(2, 5))
    _run(config, one_device)
    # Rounds are cut at A and B so the trace holds steps 3..5 and nothing else.
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [2, 5, 9]
    traces = list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_a_run_resumed_inside_the_profile_window_says_which_steps_it_traced(data_dir, one_device, tmp_path, capsys):
    loop.train(helpers.make_config(data_dir, str(tmp_path), train_steps=3, steps_per_loop=100), one_device)
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=9, steps_per_loop=100, profile_steps=(2, 5))
    capsys.readouterr()
    loop.train(config, one_device)
    # This process resumed at step 3: its trace holds steps 4..5, not the window's 3..5.
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile of")]
    assert said == [f"profile of steps 4..5 in {tmp_path / 'profile'} (tensorboard --logdir)"]


@pytest.mark.parametrize("steps", [(5, 2), (3,), (2, 10)])
def test_profile_steps_out_of_range_refused(data_dir, steps):
    with pytest.raises(ConfigError, match=rf"--profile_steps={','.join(map(str, steps))}: must be A,B with"):
        helpers.make_config(data_dir, train_steps=9, profile_steps=steps)


def _batch(trainer):
    return next(iter(trainer.data.train_fn(tf.distribute.InputContext())))


@pytest.mark.parametrize("device", ["CPU", "GPU"])
def test_a_stop_ends_the_round_at_its_step_on_cpu_and_at_its_end_on_accelerators(
    data_dir, one_device, tmp_path, monkeypatch, device
):
    if device == "GPU":  # forced through the predicate: the loop no longer reads the flag at every step
        monkeypatch.setattr(program, "stops_each_step", lambda strategy: False)
    assert program.stops_each_step(distribute.placement(one_device, "one_device")) == (device == "CPU")
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, steps_per_loop=5, checkpoint_every=0)
    trainer = build.run(config, one_device)
    checkpoints = Checkpoints(trainer.state, config.workdir, config.keep_checkpoints)
    trainer.program.stop.assign(True)  # as a signal during the first step sets it
    with pytest.raises(Preempted) as stopped:
        Controller(trainer, Report(config.workdir, True, config.train_steps), checkpoints, 0.0).train()
    step = 1 if device == "CPU" else 5  # the signalled step, or the end of its round
    assert str(stopped.value).startswith(f"preempted: stopped by a peer worker's signal at step {step}; checkpoint ")
    assert checkpoints.saved_path.endswith(f"ckpt-{step}") and int(trainer.state.step.numpy()) == step
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [step]


def test_whole_replica_step_compiles_with_xla(data_dir, one_device):
    """The TPU path: all of the replica step, all-reduce and update included, in one XLA computation."""
    config = helpers.make_config(data_dir, optimizer="lamb", clip_norm=0.2, jit_compile=False)
    compiled, plain = build.run(config, one_device), build.run(config, one_device)
    batch = _batch(compiled)
    xla_step = tf.function(compiled.program.train_step, jit_compile=True)
    assert "HloModule" in xla_step.experimental_get_compiler_ir(batch)(stage="hlo")
    for fn in (xla_step, plain.program.train_step):
        step = tf.function(lambda b, fn=fn: one_device.run(fn, args=(b,)))
        for _ in range(3):
            out = step(batch)
        assert bool(out["finite"])
    for a, b in zip(helpers.all_variables(compiled).values(), helpers.all_variables(plain).values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    assert int(compiled.plans[0].optimizer.iterations.numpy()) == 3


@pytest.mark.slow
def test_jit_compile_flag_matches_plain_on_two_replicas(data_dir, mirrored):
    case = helpers.PARITY_CASES["adamw"]
    jit, _ = helpers.train_and_snapshot(helpers.make_config(data_dir, **{**case, "jit_compile": "true"}), mirrored)
    plain, _ = helpers.train_and_snapshot(helpers.make_config(data_dir, **{**case, "jit_compile": "false"}), mirrored)
    for k in plain:
        np.testing.assert_allclose(jit[k][0], plain[k][0], atol=1e-5)
        np.testing.assert_array_equal(jit[k][0], jit[k][1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy_fixture", ["one_device", "mirrored"])
def test_eval_counts_every_example_once(data_dir, strategy_fixture, request):
    strategy = request.getfixturevalue(strategy_fixture)
    # 360 test examples: 5 full batches of 64 and one of 40, split over the replicas.
    config = helpers.make_config(data_dir, eval_batch_size=64)
    trainer = build.run(config, strategy)
    trainer.program.run_steps(trainer.program.train_iterator(), 5)
    results = trainer.evaluator.evaluate()
    assert results["examples"] == 360
    images, labels = tfds.as_numpy(
        tfds.load("digits", split="test", data_dir=data_dir, as_supervised=True, batch_size=-1)
    )
    logits = trainer.model(images.astype(np.float32) / 255.0, training=False).numpy()
    expected = float(np.mean(np.argmax(logits, -1) == labels))
    assert results["accuracy"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow
def test_reduced_precisions_match_float32_accuracy(data_dir, one_device, tmp_path):
    accuracy = {}
    for precision in ("float32", "mixed_float16", "mixed_bfloat16"):
        config = helpers.make_config(
            data_dir,
            str(tmp_path / precision),
            precision=precision,
            train_steps=300,
            steps_per_loop=100,
            hidden_sizes=(128, 128),
        )
        _, summary = _run(config, one_device)
        accuracy[precision] = summary["eval"]["accuracy"]
    assert accuracy["float32"] > 0.95
    for precision in ("mixed_float16", "mixed_bfloat16"):
        assert abs(accuracy[precision] - accuracy["float32"]) <= 0.01, accuracy


def test_a_notebooks_config_is_checked_as_flags_are(data_dir, one_device, tmp_path):
    # A Config built in a notebook and handed to train() or evaluate(), never through launch.py: a bad setting is one
    # ConfigError naming it before anything is written, and an empty --model is the task's own, as on the command line.
    from engine.run import modes
    from engine.settings.fields import Config

    workdir = tmp_path / "run"
    for overrides, message in [
        (dict(optimizer="bogus"), "--optimizer=bogus: must be one of"),
        (dict(freeze="["), "--freeze=[: not a regular expression"),
        (dict(keep_checkpoints=0), "--keep_checkpoints=0: must be a positive number"),
    ]:
        with pytest.raises(ConfigError) as raised:
            loop.train(Config(data_dir=data_dir, workdir=str(workdir), train_steps=2, **overrides), one_device)
        assert str(raised.value).startswith(message) and not workdir.exists()
    trained = loop.train(Config(data_dir=data_dir, workdir=str(workdir), train_steps=2), one_device)
    evaluated = modes.evaluate(Config(data_dir=data_dir, workdir=str(workdir)), one_device)
    assert evaluated["eval"] == trained["eval"]


def test_a_summary_rebuilt_from_the_log_leaves_out_the_rounds_that_traced(tmp_path):
    # A process resumed at the last step times no round: the run's rate comes from metrics.jsonl, whose records say
    # which rounds traced (the first, the first that returned an action's extras at step 30). Leaving out only the
    # first line gave 634 examples/s where the rounds that traced nothing ran 14,782.
    report = Report(str(tmp_path), True, 40)
    for step, rate, traced in ((10, 100.0, True), (20, 1000.0, False), (30, 50.0, True), (40, 3000.0, False)):
        report.train(step, {"loss": 1.0, "learning_rate": 0.1, "grad_norm": 1.0, "loss_scale": None,
                            "examples_per_sec": rate, "skipped_steps": 0}, traced=traced)  # fmt: skip
    assert report.logged_throughput(40) == pytest.approx(20 / (10 / 1000.0 + 10 / 3000.0))
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["traced"] for line in f] == [True, False, True, False]


def test_a_line_without_a_mean_loss_shows_none_everywhere_not_nan(tmp_path, capsys):
    # Every step of the line skipped (float16): its mean loss and gradient norm are over no step. They were "nan" on
    # the console and NaN in TensorBoard, beside null in metrics.jsonl: a routine skip that looked like divergence.
    report = Report(str(tmp_path), True, 10)
    nan = float("nan")
    report.train(5, {"loss": nan, "learning_rate": 0.1, "grad_norm": nan, "loss_scale": 512.0,
                     "examples_per_sec": 50.0, "skipped_steps": 5})  # fmt: skip
    report.summary({"step": 5})  # flushes the writers
    assert "train step=5 loss=- learning_rate=0.1 grad_norm=- loss_scale=512 " in capsys.readouterr().out
    with open(tmp_path / "metrics.jsonl") as f:
        record = json.loads(f.read())
    assert record["loss"] is None and record["grad_norm"] is None and record["loss_scale"] == 512.0
    scalars = helpers.tensorboard_values(str(tmp_path / "train"), lambda value: True)
    assert "loss" not in scalars and "grad_norm" not in scalars and float(scalars["loss_scale"][5]) == 512.0


def test_an_evaluation_that_is_not_finite_is_written_as_json_null(tmp_path):
    # A diverged evaluation's loss, a task's 0/0: Python wrote them bare as NaN and Infinity in eval.jsonl and in
    # summary.json's eval, which is not JSON (JavaScript's and Go's readers refuse it), beside null in metrics.jsonl.
    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    report = Report(str(tmp_path), True, 10)
    results = {"accuracy": float("nan"), "loss": float("inf"), "examples": 360}
    report.eval(10, results)
    report.summary({"step": 10, "train_loss": float("nan"), "eval": results})
    with open(tmp_path / "eval.jsonl") as f:
        assert strict(f.read()) == {"step": 10, "accuracy": None, "loss": None, "examples": 360}
    with open(tmp_path / "summary.json") as f:
        assert strict(f.read()) == {"step": 10, "train_loss": None, "eval": {"accuracy": None, "loss": None,
                                                                             "examples": 360}}  # fmt: skip


def test_the_eta_is_timed_after_the_first_line_whose_round_traced_the_step(tmp_path, monkeypatch):
    # The first round took 10 s (tracing, compiling), each later one 1 s for 10 steps: at step 20 of 100 the time left
    # is 8 s. Timed from the start, the ETA said 44 s there.
    now = [0.0]  # the run starts at 0 s; its first line at 10 s, then one a second
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    stream = helpers.Terminal()
    report = Report(str(tmp_path), True, 100, stream=stream)
    etas = []
    # A rollback to step 20 after step 30 (60 s spent there) times afresh: the undone steps are not the pace.
    for step, at in ((10, 10.0), (20, 11.0), (30, 12.0), ("rewind", 20), (30, 72.0), (40, 73.0)):
        now[0] = at
        if step == "rewind":
            report.rewind(at)
            continue
        report.train(step, {"loss": 1.0, "learning_rate": 0.1, "grad_norm": 1.0, "loss_scale": None,
                            "examples_per_sec": 50.0, "skipped_steps": 0})  # fmt: skip
        etas.append(stream.getvalue().rsplit("ETA ", 1)[1][:8])
    assert etas == ["--:--:--", "00:00:08", "00:00:07", "--:--:--", "00:00:06"]
