"""The outer loop's actions (engine/run/actions/), each on its own: at which steps they fire, what they write, what
they restore. Host logic on stand-ins for the run and the report; the rollback restores a real checkpoint."""

import dataclasses
import datetime
import json
import os
import signal
import sys
import types

import pytest
import tensorflow as tf

from engine.cluster.signals import SIGNALS
from engine.run import actions, controller, loop
from engine.run.actions import base, builtin
from engine.run.actions.base import ROLLED_BACK, Round, Stop
from engine.run.controller import Timing
from engine.settings import plugins
from engine.settings.errors import Preempted, TaskError, TrainingError
from engine.state import checkpoint as checkpoint_lib
from tests import helpers


class Lines:
    """A report that keeps what it was given."""

    def __init__(self):
        self.lines, self.trains, self.evals, self.drawn, self.rewinds = [], [], [], [], []
        self.traced = []

    def line(self, text):
        self.lines.append(text)

    def clear(self):
        self.lines.append("<cleared>")

    def train(self, step, metrics, traced=False):
        self.trains.append((step, metrics))
        self.traced.append(traced)

    def eval(self, step, results):
        self.evals.append((step, results))

    def pictures(self, step, images):
        self.drawn.append((step, images))

    def rewind(self, step):
        self.rewinds.append(step)


def _context(run=None, report=None, checkpoints=None, timing=None):
    """What the controller hands an action beside its round (engine/run/controller.py Context)."""
    return types.SimpleNamespace(run=run, report=report or Lines(), checkpoints=checkpoints, timing=timing, chief=True)


def _cadence(**settings):
    return types.SimpleNamespace(
        **{"steps_per_loop": 10, "eval_every": 0, "checkpoint_every": 0, "profile_steps": (), **settings}
    )


def _round(start, end, seconds=1.0, **out):
    return Round(start, end, seconds, {"skipped": 0.0, "floor_skipped": 0.0, "stop": 0.0, **out})


def _fired(config, stopping_at=None):
    """(round ends, evaluation steps, checkpoint steps) of a run from step 0, as the loop cuts and checks them."""
    ends, evaluated, saved, current = [], [], [], 0
    evaluate = builtin.Evaluate(config.eval_every, config.train_steps)
    checkpoint = builtin.Checkpoint(config.checkpoint_every, config.train_steps)
    while current < config.train_steps:
        current = controller.next_boundary(config, [evaluate, checkpoint], current)
        ends.append(current)
        stopping = current == stopping_at
        if evaluate.due(current, stopping):
            evaluated.append(current)
        if checkpoint.due(current, stopping):
            saved.append(current)
    return ends, evaluated, saved


@pytest.mark.parametrize(
    "settings, expected",
    [
        # The end's evaluation comes after the loop: not in it.
        (dict(train_steps=25, eval_every=10, checkpoint_every=5), ([5, 10, 15, 20, 25], [10, 20], [5, 10, 15, 20, 25])),
        (dict(train_steps=30, eval_every=15, checkpoint_every=0), ([10, 15, 20, 30], [15], [30])),
        (dict(train_steps=12, steps_per_loop=100, eval_every=0, checkpoint_every=4), ([4, 8, 12], [], [4, 8, 12])),
    ],
)
def test_evaluations_and_checkpoints_fire_at_their_steps(settings, expected):
    assert _fired(_cadence(**settings)) == expected


def test_a_stopping_run_saves_and_skips_the_evaluation_due_there():
    config = _cadence(train_steps=30, eval_every=10, checkpoint_every=0)
    assert _fired(config, stopping_at=10) == ([10, 20, 30], [20], [10, 30])


def test_the_input_bound_warning_fires_once_after_its_window_of_timed_steps():
    timing, report = Timing(), Lines()
    warn, context = builtin.InputBoundWarning(), _context(report=report, timing=timing)
    rounds = [_round(0, 10, 5.0, input_wait=5.0)]  # the first round (tracing): outside the window
    rounds += [_round(10 * k, 10 * k + 10, 1.0, input_wait=0.2) for k in range(1, 7)]
    warned_at = []
    for done in rounds:
        timing.add(done)
        before = len(report.lines)
        warn(done, context)
        warned_at += [done.end] * (len(report.lines) - before)
    assert builtin.INPUT_WINDOW_STEPS == 50 and warned_at == [60]  # 50 timed steps: steps 11-60
    assert report.lines == [
        "warning: input-bound: the steps waited for input 20% of the time over steps 11-60; the input pipeline does "
        "not keep up (more workers, --tf_data_service, a smaller --image_size or data held in memory would)"
    ]
    assert timing.summary(64, waits_timed=True) == (60 * 64 / 6.0, pytest.approx(0.2))


def test_a_resumed_runs_input_bound_warning_names_the_steps_it_timed():
    # Resumed at step 100: its first round (101-120) traced the step; the timed steps are 121 on.
    timing, report = Timing(), Lines()
    warn, context = builtin.InputBoundWarning(window=60), _context(report=report, timing=timing)
    for start in range(100, 180, 20):
        done = _round(start, start + 20, 1.0, input_wait=0.5)
        timing.add(done)
        warn(done, context)
    assert [line.split(" of the time ")[1].split(";")[0] for line in report.lines] == ["over steps 121-180"]


def test_waiting_exactly_the_bound_does_not_warn():
    timing, report = Timing(), Lines()
    warn, context = builtin.InputBoundWarning(window=10), _context(report=report, timing=timing)
    for done in [_round(0, 10, input_wait=0.0), _round(10, 20, 2.0, input_wait=0.2)]:
        timing.add(done)
        warn(done, context)
    assert report.lines == []


def test_a_run_whose_every_round_traced_reports_no_throughput():
    # One round's time is mostly tracing and compilation (2,322 examples/s where the rounds after it run 60,000).
    timing = Timing()
    timing.add(_round(0, 20, 4.0, input_wait=1.0))
    assert timing.summary(8, waits_timed=True) == (None, None)
    assert Timing().summary(8, waits_timed=True) == (None, None)
    timing.add(_round(20, 40, 0.5, input_wait=0.1))
    assert timing.summary(8, waits_timed=True) == (20 * 8 / 0.5, pytest.approx(0.2))


def _float16_run(scale=4.0, **more):
    scales = {"train": scale, **more}  # {update: its loss scale}
    return types.SimpleNamespace(
        program=types.SimpleNamespace(float16=True),
        plans=[
            types.SimpleNamespace(name=name, loss_scale=types.SimpleNamespace(scale=tf.constant(s)))
            for name, s in scales.items()
        ],
        config=types.SimpleNamespace(initial_loss_scale=1024.0, precision="mixed_float16"),
    )


def test_the_skip_warning_needs_more_than_half_of_the_rounds_steps_skipped():
    report, warn = Lines(), builtin.SkippedWarning()
    context = _context(_float16_run(), report)
    warn(_round(10, 20, skipped=5.0), context)
    assert report.lines == []
    warn(_round(10, 20, skipped=6.0), context)
    assert report.lines == [
        "warning: mixed_float16: 6 of the 10 steps 11-20 were skipped (non-finite gradients: nothing trained); the "
        "loss scale halves at each skipped step and is now 4 (--initial_loss_scale=1024)"
    ]
    float32 = types.SimpleNamespace(program=types.SimpleNamespace(float16=False))
    warn(_round(10, 20, skipped=10.0), _context(float32, report))
    assert len(report.lines) == 1  # float32: a skipped step is divergence, the NaN policy's


@pytest.mark.parametrize("batches, rate", [(1, 80.0), (3, 240.0)])
def test_the_log_counts_skipped_steps_and_writes_the_train_line(batches, rate):
    # 10 steps of 16 examples in 2 s; a step that reads 3 batches (WGAN-GP's critic) reads 3 times the examples.
    trainer = types.SimpleNamespace(
        state=types.SimpleNamespace(skipped=tf.Variable(2, dtype=tf.int64)),
        program=types.SimpleNamespace(
            metric_names=["learning_rate", "grad_norm", "loss_scale"], float16=False, batches_per_step=batches
        ),
        config=types.SimpleNamespace(global_batch_size=16),
        plans=[None],  # one update: its loss is the run's
        actions=[builtin.Log()],
    )
    report = Lines()
    out = dict(loss=0.5, learning_rate=0.1, grad_norm=2.0, loss_scale=1.0, skipped=3.0)
    # The controller counts the round's skipped steps, then its due actions act: the log writes the line.
    looping = controller.Controller.__new__(controller.Controller)
    looping.run, looping.context = trainer, _context(trainer, report, timing=Timing())
    looping._act(_round(10, 20, 2.0, **out))
    assert int(trainer.state.skipped.numpy()) == 5
    assert report.trains == [
        (
            20,
            dict(loss=0.5, learning_rate=0.1, grad_norm=2.0, loss_scale=None, examples_per_sec=rate, skipped_steps=3.0),
        )
    ]
    assert report.traced == [True]  # the process's first round: its time includes tracing the step


class _Run:
    """The state a rollback touches: the step and data-position counters, saved in a real checkpoint."""

    def __init__(self, tmp_path, on_nan="rollback", checkpoint_every=5):
        self.discarded = []  # the steps the rollbacks discarded the checkpoints after
        self.step = tf.Variable(20, dtype=tf.int64)
        self.batches = tf.Variable(20, dtype=tf.int64)
        self.state = types.SimpleNamespace(step=self.step, batches=self.batches)
        self.program = types.SimpleNamespace(float16=False, batches_per_step=1)
        self.config = types.SimpleNamespace(on_nan=on_nan, precision="float32", checkpoint_every=checkpoint_every)
        self.checkpoint = tf.train.Checkpoint(step=self.step, batches=self.batches)
        self.checkpoints = types.SimpleNamespace(
            checkpoint=self.checkpoint,
            directory=str(tmp_path),
            saved_path=None,
            discard_after=self.discarded.append,
            restore=lambda path: checkpoint_lib.restore(self.checkpoint, path),
        )
        self.save()

    def save(self):
        """Saves the counters as ckpt-<step>, as the run's checkpoints are named; the checkpoint saved last."""
        path = str(self.checkpoints.directory + f"/ckpt-{int(self.step.numpy())}")
        self.checkpoint.save_counter  # noqa: B018  (made on first read: saved, as the run's checkpoints hold it)
        self.checkpoints.saved_path = self.checkpoint.write(path)

    def policy(self, report):
        """The NaN policy of this run's --on_nan, acting on `report`: policy(round) -> its outcome."""
        config, context = self.config, _context(self, report, self.checkpoints)
        nan_policy = builtin.NanPolicy(config.on_nan, config.checkpoint_every)
        return lambda done: nan_policy(done, context)

    def diverge(self, steps=10):
        """A round of `steps` whose last 3 were non-finite."""
        start = int(self.step.numpy())
        self.step.assign_add(steps)
        self.batches.assign_add(steps)
        return _round(start, start + steps, skipped=3.0)


def test_the_skip_warning_names_each_updates_loss_scale():
    # Several updates each have their own scale: the first one's alone would misname the others'.
    report, warn = Lines(), builtin.SkippedWarning()
    run = _float16_run(256.0, generator=2.0)
    run.plans[0].name = "discriminator"
    warn(_round(0, 4, skipped=4.0), _context(run, report))
    assert report.lines == [
        "warning: mixed_float16: 4 of the 4 steps 1-4 were skipped (non-finite gradients in an update: that update "
        "did not train there, the others did); each update's loss scale halves at each step it skips; they are now "
        "discriminator 256, generator 2 (--initial_loss_scale=1024)"
    ]


def test_the_rollback_restores_the_checkpoint_and_reads_on_from_the_rounds_data_position(tmp_path):
    run, report = _Run(tmp_path), Lines()
    policy = run.policy(report)
    assert policy(_round(20, 30)) is None  # a round that trained: nothing to do
    run.step.assign(30)
    run.batches.assign(30)
    assert policy(_round(20, 30, skipped=3.0)) == ROLLED_BACK
    assert (int(run.step.numpy()), int(run.batches.numpy())) == (20, 30)
    assert report.rewinds == [20]
    assert report.lines == [
        f"non-finite loss or gradient between steps 21 and 30 (3 of 10 steps, float32): rolled back to step 20 "
        f"({run.checkpoints.saved_path}), discarding the 10 steps 21-30 since that checkpoint; the 10 batches they "
        "read are not trained on (--on_nan=rollback)"
    ]


def test_a_rollback_of_a_round_a_signal_cut_short_reads_on_from_where_it_was_to_end(tmp_path):
    # It read on from where the signal cut the round (batch 25), and its resume trained other batches than the run
    # never stopped (which reads on from batch 30) trains.
    run, report = _Run(tmp_path), Lines()
    run.step.assign(25)
    run.batches.assign(25)
    cut = dataclasses.replace(_round(20, 25, skipped=3.0), stopping=True, planned=30)
    assert run.policy(report)(cut) == ROLLED_BACK
    assert (int(run.step.numpy()), int(run.batches.numpy())) == (20, 30)
    run.step.assign(29)
    run.batches.assign(29)
    assert run.policy(report)(dataclasses.replace(cut, end=29)) == ROLLED_BACK  # one step short: one batch
    assert report.lines[-1].endswith("nor is the 1 batch of the steps a signal cut short (--on_nan=rollback)")
    assert report.lines[0].endswith(
        "discarding the 5 steps 21-25 since that checkpoint; the 5 batches they read are not trained on, nor are the "
        "5 batches of the steps a signal cut short (--on_nan=rollback)"
    )


def test_the_rollback_line_counts_the_steps_and_the_batches_discarded(tmp_path):
    # "discarding the 1 steps 21-21 ...; the 1 batches": and a step of fresh repetitions (WGAN-GP's critic) reads
    # several batches, which the line counted as one a step.
    run, report = _Run(tmp_path), Lines()
    policy = run.policy(report)
    run.program.batches_per_step = 5  # five fresh batches a step
    run.step.assign(21)
    run.batches.assign(25)
    assert policy(_round(20, 21, skipped=1.0)) == ROLLED_BACK
    run.program.batches_per_step = 1
    run.step.assign(21)
    run.batches.assign(26)
    assert policy(_round(20, 21, skipped=1.0)) == ROLLED_BACK
    assert [line.split("), ", 1)[1] for line in report.lines] == [
        "discarding step 21 since that checkpoint; the 5 batches it read are not trained on (--on_nan=rollback)",
        "discarding step 21 since that checkpoint; the batch it read is not trained on (--on_nan=rollback)",
    ]


def test_the_rollback_gives_up_after_max_rollbacks_without_a_save(tmp_path):
    run, report = _Run(tmp_path), Lines()
    policy = run.policy(report)
    for _ in range(builtin.MAX_ROLLBACKS):
        assert policy(run.diverge()) == ROLLED_BACK
    assert int(run.batches.numpy()) == 20 + 10 * builtin.MAX_ROLLBACKS
    with pytest.raises(TrainingError) as stopped:
        policy(run.diverge())
    assert str(stopped.value) == (
        "non-finite loss or gradient between steps 21 and 30 (3 of 10 steps, float32) (--on_nan=rollback: 3 "
        f"rollbacks without a save between them); last good checkpoint: {run.checkpoints.saved_path}; lower "
        "--learning_rate or set --clip_norm"
    )


def test_a_save_between_rollbacks_starts_the_count_again(tmp_path):
    run, report = _Run(tmp_path), Lines()
    policy = run.policy(report)
    for _ in range(builtin.MAX_ROLLBACKS):
        policy(run.diverge())
    run.step.assign(25)
    run.save()
    for _ in range(builtin.MAX_ROLLBACKS):
        assert policy(run.diverge()) == ROLLED_BACK
    assert int(run.step.numpy()) == 25 and len(report.rewinds) == 2 * builtin.MAX_ROLLBACKS


def test_a_rollback_returns_where_a_run_never_preempted_would_whatever_step_a_preemption_saved(tmp_path):
    # A run resumed from a preemption's save at step 21 (between --checkpoint_every's 20 and 25): a rollback of the
    # round 21-25 returns to step 20, as the run that was never stopped does. It returned to 21 (the checkpoint
    # saved last), training other steps on other batches: weights 2e-3 apart at the end, another eval loss.
    run, report = _Run(tmp_path), Lines()
    run.step.assign(21)
    run.save()  # the preemption's; the resumed process restored it
    policy = run.policy(report)
    run.step.assign(25)
    run.batches.assign(25)
    assert policy(_round(21, 25, skipped=1.0)) == ROLLED_BACK
    assert (int(run.step.numpy()), int(run.batches.numpy())) == (20, 25) and report.rewinds == [20]
    assert run.discarded == [20]  # the preemption's ckpt-21 goes: a restart would resume from it, as the newest
    assert f"rolled back to step 20 ({tmp_path}/ckpt-20)" in report.lines[0]
    # With no such checkpoint left (rotated away by the preemption's save, --keep_checkpoints=1), the one saved last.
    (tmp_path / "one").mkdir()
    run = _Run(tmp_path / "one")
    run.step.assign(21)
    run.save()
    for name in os.listdir(tmp_path / "one"):
        if name.startswith("ckpt-20."):
            os.remove(tmp_path / "one" / name)
    policy, report = run.policy(Lines()), None
    run.step.assign(25)
    assert policy(_round(21, 25, skipped=1.0)) == ROLLED_BACK and int(run.step.numpy()) == 21


def test_the_stop_policy_names_the_steps_and_the_last_good_checkpoint(tmp_path):
    run = _Run(tmp_path, on_nan="stop")
    with pytest.raises(TrainingError) as stopped:
        run.policy(Lines())(run.diverge())
    assert str(stopped.value) == (
        "non-finite loss or gradient between steps 21 and 30 (3 of 10 steps, float32); last good checkpoint: "
        f"{run.checkpoints.saved_path}; lower --learning_rate or set --clip_norm"
    )
    assert int(run.step.numpy()) == 30  # nothing restored


def test_float16_diverges_only_on_skips_with_the_scale_at_its_floor():
    def divergence(done):
        return builtin.divergence(done, float16=True, precision="mixed_float16")

    assert divergence(_round(0, 10, skipped=9.0)) is None  # the scale was still finding its level
    assert divergence(_round(0, 10, skipped=9.0, floor_skipped=2.0)) == (
        "2 of the 10 steps 1-10 had non-finite gradients with the loss scale at its floor (1), which no loss scale "
        "can fix (mixed_float16)"
    )


def test_a_round_of_one_step_is_said_as_one_step():
    # --steps_per_loop=1 read "1 of 1 steps", "1 of the 1 steps 21-21".
    one = _round(20, 21, skipped=1.0, floor_skipped=1.0)
    assert builtin.divergence(one, float16=False, precision="float32") == (
        "non-finite loss or gradient at step 21 (float32)"
    )
    assert builtin.divergence(one, float16=True, precision="mixed_float16") == (
        "step 21 had non-finite gradients with the loss scale at its floor (1), which no loss scale can fix "
        "(mixed_float16)"
    )
    report = Lines()
    builtin.SkippedWarning()(one, _context(_float16_run(), report))
    assert report.lines == [
        "warning: mixed_float16: step 21 was skipped (non-finite gradients: nothing trained); the loss scale halves "
        "at each skipped step and is now 4 (--initial_loss_scale=1024)"
    ]


def test_preemption_reads_the_flag_of_the_round_or_of_now_and_raises_with_its_exit_code():
    asked = []
    trainer = types.SimpleNamespace(stops_each_step=True, stopping_anywhere=lambda: asked.append(1) or True)
    checkpoints, report = types.SimpleNamespace(saved_path="/w/checkpoints/ckpt-7"), Lines()
    stops = lambda done: controller.stopping(done.out, trainer)  # noqa: E731
    assert stops(_round(0, 7, stop=1.0)) and not stops(_round(0, 7))
    assert asked == []  # a round that stops at a step carries the flag
    trainer.stops_each_step = False
    assert stops(_round(0, 7)) and asked == [1]
    stop_on_signal = builtin.StopOnSignal()
    assert stop_on_signal.due(7, stopping=True) and not stop_on_signal.due(7, stopping=False)
    with pytest.raises(Preempted) as stopped:
        stop_on_signal(_round(0, 7), _context(report=report, checkpoints=checkpoints))
    # The cause and exit code as the signal handler knows them (no signal here: a peer worker's).
    message = f"{SIGNALS.cause} at step 7; checkpoint /w/checkpoints/ckpt-7; run the same command to resume"
    # Said once, as launch.py's last line: the console only cleared its live line (it printed the message too).
    assert (str(stopped.value), stopped.value.exit_code, report.lines) == (message, SIGNALS.exit_code, ["<cleared>"])


@pytest.mark.parametrize("prune", [False, True])
def test_an_evaluation_reports_and_tells_whether_the_tuner_stops_there(prune):
    evaluator = types.SimpleNamespace(evaluate=lambda: {"accuracy": 0.5, "examples": 4}, pictures=lambda: {"p": 1})
    trainer = types.SimpleNamespace(evaluator=evaluator)
    seen, report = [], Lines()
    evaluate = builtin.Evaluate(10, 100, lambda step, results: seen.append((step, results)) or prune)
    outcome = evaluate(_round(0, 10), _context(trainer, report))
    assert isinstance(outcome, Stop) is prune
    assert seen == report.evals == [(10, {"accuracy": 0.5, "examples": 4})] and report.drawn == [(10, {"p": 1})]
    assert outcome is None or outcome.results == {"accuracy": 0.5, "examples": 4}
    assert builtin.Evaluate(10, 100)(_round(0, 10), _context(trainer)) is None  # no tuner: never stops


class _Needing(builtin.Action):
    def __init__(self, needs=frozenset(), every=0, steps=()):
        self.needs, self.every, self.steps = needs, every, steps


@pytest.mark.parametrize(
    "action, message",
    [
        (
            _Needing(needs={"gradients", "activations"}),
            "engine/run/actions/mine.py: needs 'activations': a step returns only gradients and updates",
        ),
        (
            _Needing(needs="gradients"),
            "engine/run/actions/mine.py: needs='gradients': must be a set of names, as needs = {'gradients'}",
        ),
        (
            _Needing(every=2.5),
            "engine/run/actions/mine.py: every=2.5, steps=(): must be a number of steps and a tuple of steps",
        ),
        (
            _Needing(steps=(10, -1)),
            "engine/run/actions/mine.py: every=0, steps=(10, -1): must be a number of steps and a tuple of steps",
        ),
        (
            _Needing(steps=100),
            "engine/run/actions/mine.py: every=0, steps=100: must be a number of steps and a tuple of steps",
        ),
        (
            _Needing(needs=None),
            "engine/run/actions/mine.py: needs=None: must be a set of names, as needs = {'gradients'}",
        ),
    ],
)
def test_an_action_asking_for_what_no_step_returns_is_refused_in_one_line_naming_its_file(action, message):
    with pytest.raises(TaskError) as error:
        actions.checked(action, "mine")
    assert str(error.value) == message


def test_the_worked_example_and_a_plain_action_pass_the_check(data_dir):
    from engine.run.actions import histograms

    example = histograms.Action(helpers.make_config(data_dir, actions="histograms", histogram_every=7))
    assert actions.checked(example, "histograms") is example and example.every == 7
    assert actions.checked(_Needing(needs={"gradients"}, every=5, steps=(1, 3)), "mine").steps == (1, 3)


class _Answers(base.Action):
    every = 2

    def __init__(self, answer):
        self.answer = answer

    def __call__(self, round, context):
        return self.answer


@pytest.mark.parametrize(
    "answer, message",
    [
        (True, "its Action returned True after step 2; an action returns None to go on, ROLLED_BACK or Stop(results)"),
        (
            Stop({"loss": 1.0}),
            "its Action returned Stop({'loss': 1.0}) after step 2: the run ends with these results, which lack "
            "accuracy and examples; Stop takes an evaluation's (context.run.evaluator.evaluate())",
        ),
    ],
    ids=["true", "stop_without_results"],
)
def test_an_action_answering_what_the_controller_does_not_know_is_one_line(
    data_dir, one_device, tmp_path, monkeypatch, answer, message
):
    # Taken as "go on" it would have skipped the round's evaluation, checkpoint and stop on a signal, unsaid.
    monkeypatch.setattr(actions, "load", lambda config: [_Answers(answer)])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=4, steps_per_loop=2, hidden_sizes=(8,))
    with pytest.raises(TaskError) as error:
        loop.train(config, one_device)
    assert str(error.value) == f"tests/test_actions.py: {message}"


class _Configless(base.Action):
    def __init__(self):
        pass


def test_a_plugin_file_without_what_the_engine_runs_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tasks.empty", types.ModuleType("tasks.empty"))
    with pytest.raises(TaskError) as error:
        plugins.member("task", "empty")
    assert str(error.value) == (
        "tasks/empty.py: defines no Task: a task file defines class Task(base.Task), the protocol of tasks/base.py"
    )
    with pytest.raises(TaskError) as error:
        actions.built(_Configless, None, "mine")
    assert str(error.value) == "engine/run/actions/mine.py: Action(): the engine builds it as Action(config)"


class _Recorder(base.Action):
    """Records each round's `traced` and, at the end, the steps the throughput counts."""

    def __init__(self):
        self.traced, self.timed_steps = [], None

    def __call__(self, round, context):
        self.traced.append((round.end, round.traced))

    def close(self, context):
        self.timed_steps = context.timing.steps


class _NeedsUpdates(base.Action):
    needs, every = frozenset({"updates"}), 10


def test_the_throughput_leaves_out_every_round_that_traced_a_step(data_dir, one_device, tmp_path, monkeypatch):
    # The round to step 10 traced the step that returns the action's updates: its seconds are mostly compiling, and
    # counted in summary.json's examples_per_sec they made it 13 times too low.
    recorder = _Recorder()
    monkeypatch.setattr(actions, "load", lambda config: [recorder, _NeedsUpdates()])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=30, steps_per_loop=5, hidden_sizes=(8,))
    loop.train(config, one_device)
    assert recorder.traced == [(5, True), (10, True), (15, False), (20, False), (25, False), (30, False)]
    assert recorder.timed_steps == 20


class _Unasked(base.Action):
    every = 2

    def __call__(self, round, context):
        return round.extras["gradients"]  # without needs = {"gradients"}: a KeyError, a traceback


def test_an_action_reading_what_it_did_not_ask_for_is_one_line(data_dir, one_device, tmp_path, monkeypatch):
    monkeypatch.setattr(actions, "load", lambda config: [_Unasked()])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=4, steps_per_loop=2, hidden_sizes=(8,))
    with pytest.raises(TaskError) as error:
        loop.train(config, one_device)
    assert str(error.value) == (
        "tests/test_actions.py: round.extras['gradients']: not returned this round; say needs = {'gradients'} in the "
        "action's class"
    )


class _Optional(base.Action):
    """Reads the gradients where a round has them, handling their absence as Python's dicts let it (KeyError)."""

    def __init__(self):
        self.seen = []

    def __call__(self, round, context):
        try:
            self.seen.append(sorted(round.extras["gradients"])[:1])
        except KeyError:
            self.seen.append(None)


def test_an_action_may_handle_extras_a_round_does_not_have(data_dir, one_device, tmp_path, monkeypatch):
    optional = _Optional()
    monkeypatch.setattr(actions, "load", lambda config: [optional, _NeedsGradientsAt4()])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=6, steps_per_loop=2, hidden_sizes=(8,))
    loop.train(config, one_device)
    assert optional.seen == [None, ["model/mlp/dense/bias"], None]


class _NeedsGradientsAt4(base.Action):
    needs = frozenset({"gradients"})

    def due(self, step, stopping):
        return step == 4


def test_a_summarys_update_numbers_are_the_whole_last_round_where_a_preemption_split_it(tmp_path):
    # Steps 21-30 are the last round; a preemption at 25 split it: the first process logged 21-25, the resumed one
    # 26-30. Each update's loss and gradient norm is the mean over all ten steps, as train_loss is (it was the
    # resumed process's five alone, though the weights were bit-identical to an uninterrupted run's).
    from engine.state.report import Report

    def line(step, loss, norm):
        return {"step": step, "loss": None, "d/loss": loss, "d/grad_norm": norm, "d/learning_rate": 0.1,
                "d/loss_scale": None, "examples_per_sec": 1.0, "skipped_steps": 0}  # fmt: skip

    first = Report(str(tmp_path), True, 30)
    for step, loss, norm in ((10, 9.0, 9.0), (20, 9.0, 9.0), (25, 1.0, 2.0)):
        first.train(step, line(step, loss, norm))
    resumed = Report(str(tmp_path), True, 30, resume_step=25)
    resumed.count_losses(20, 25)
    resumed.train(30, line(30, 3.0, 4.0))
    program = types.SimpleNamespace(metric_names=["d/loss", "d/grad_norm", "d/learning_rate", "d/loss_scale"],
                                    float16=False)  # fmt: skip
    last = {"d/loss": 3.0, "d/grad_norm": 4.0, "d/learning_rate": 0.1, "d/loss_scale": 1.0}
    assert controller._update_metrics(program, last, resumed) == {
        "d/loss": 2.0, "d/grad_norm": 3.0, "d/learning_rate": 0.1, "d/loss_scale": None
    }  # fmt: skip


def test_a_float16_updates_numbers_where_a_preemption_split_the_round_count_the_steps_it_did_not_skip(tmp_path):
    # float16, two updates: the body skipped every step of 21-30, the head none. The head's numbers are its means
    # over its own steps; stitched over the split round they were weighted by the steps every update was finite in.
    from engine.state.report import Report

    def line(step, loss):
        return {"step": step, "loss": None, "head/loss": loss, "head/grad_norm": 1.0, "head/loss_scale": 8.0,
                "body/loss": None, "body/grad_norm": None, "body/loss_scale": 2.0, "examples_per_sec": 1.0,
                "skipped_steps": step - 20, "body/skipped_steps": step - 20, "head/skipped_steps": 0}  # fmt: skip

    first = Report(str(tmp_path), True, 30)
    first.train(20, {**line(20, 9.0), "skipped_steps": 10, "body/skipped_steps": 10})
    first.train(25, {**line(25, 1.0), "skipped_steps": 5, "body/skipped_steps": 5})
    resumed = Report(str(tmp_path), True, 30, resume_step=25)
    resumed.count_losses(20, 25)
    resumed.train(30, {**line(30, 3.0), "skipped_steps": 5, "body/skipped_steps": 5})
    assert resumed.window_mean("head/loss") == 2.0 and resumed.window_mean("body/loss") is None
    assert [json.loads(text)["head/skipped_steps"] for text in open(tmp_path / "metrics.jsonl")] == [0, 0, 0]


class _Settingless(base.Action):  # no __init__: built as Action(config) by the interface's own
    def __call__(self, round, context):
        return None


class _NotAnAction:
    def __init__(self, config):
        pass


class _DueOfOne(base.Action):
    def due(self, step):
        return True


def test_an_action_is_built_and_checked_against_the_interface():
    # Without an __init__ of its own it was refused as Action(); one that is no base.Action, or a due of other
    # parameters, ended in a traceback at its first round.
    assert isinstance(actions.checked(actions.built(_Settingless, None, "mine"), "mine"), _Settingless)
    with pytest.raises(TaskError) as error:
        actions.checked(_NotAnAction(None), "mine")
    assert str(error.value) == (
        "engine/run/actions/mine.py: its Action is no engine.run.actions.base.Action: define class Action(base.Action)"
    )
    with pytest.raises(TaskError) as error:
        actions.checked(_DueOfOne(None), "mine")
    assert str(error.value) == "engine/run/actions/mine.py: due(step) is called as due(step, stopping)"


class _StopsAt(base.Action):
    """Stops the run at `step` with an evaluation of its own (an early stop), which it does not log."""

    def __init__(self, step):
        self.step = step

    def __call__(self, round, context):
        return Stop(context.run.evaluator.evaluate()) if round.end == self.step else None


def test_an_actions_stop_is_logged_as_the_runs_evaluation_with_the_last_rounds_loss(
    data_dir, one_device, tmp_path, monkeypatch
):
    # Before: no eval line and no eval.jsonl, and summary.json's train_loss null though the round logged its loss.
    monkeypatch.setattr(actions, "load", lambda config: [_StopsAt(6)])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, steps_per_loop=3, hidden_sizes=(8,))
    summary = loop.train(config, one_device)
    logged = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert summary["step"] == 6 and logged == [{"step": 6, **summary["eval"]}]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6] and summary["train_loss"] == lines[-1]["loss"]
    assert summary["stopped_by"] == "tests/test_actions.py"


def test_a_run_an_action_stopped_is_not_trained_past_its_stop_when_its_command_runs_again(
    data_dir, one_device, tmp_path, monkeypatch, capsys
):
    # Before: the rerun resumed from the stop's checkpoint and trained on to --train_steps (an early stop undone).
    monkeypatch.setattr(actions, "load", lambda config: [_StopsAt(6)])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, steps_per_loop=3, hidden_sizes=(8,))
    summary = loop.train(config, one_device)
    logs = {name: (tmp_path / name).read_text() for name in ("metrics.jsonl", "eval.jsonl", "summary.json")}
    capsys.readouterr()
    assert loop.train(config, one_device) == summary
    assert capsys.readouterr().out.splitlines()[-1] == (
        "an action (tests/test_actions.py) stopped the run at step 6; a rerun does not train past that (to train on "
        f"from there, remove its summary.json) ({tmp_path}/checkpoints/ckpt-6); nothing to do"
    )
    assert {name: (tmp_path / name).read_text() for name in logs} == logs
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.index")) == ["ckpt-6.index"]
    # Its summary removed, the same command trains on from the stop's checkpoint to --train_steps.
    (tmp_path / "summary.json").unlink()
    monkeypatch.setattr(actions, "load", lambda config: [])
    assert loop.train(config, one_device)["step"] == 20


class _Exited(Exception):
    """Stands in for the process's exit on a signal that came too late for the training loop (Signals._exit_now)."""


def _exit_now(where):
    raise _Exited(where)


class _StopsAsSignalled(_StopsAt):
    """Stops the run at `step` as a SIGTERM comes while it evaluates: the signal's watcher sets the loop's flag."""

    def __call__(self, round, context):
        if round.end == self.step:
            SIGNALS.signal = signal.SIGTERM
            context.run.program.stop.assign(True)
        return super().__call__(round, context)


def test_an_actions_stop_as_a_signal_comes_ends_the_run_there_and_a_rerun_does_not_train_past_it(
    data_dir, one_device, tmp_path, monkeypatch
):
    # Before: the signal ended the run at the stop's checkpoint (Preempted) without its summary, and the same command
    # run again resumed there and trained on past the early stop.
    monkeypatch.setattr(SIGNALS, "signal", None)
    monkeypatch.setattr(SIGNALS, "_exit_now", _exit_now)
    monkeypatch.setattr(actions, "load", lambda config: [_StopsAsSignalled(6)])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, steps_per_loop=3, hidden_sizes=(8,))
    with pytest.raises(_Exited):  # the signal's exit, once the run has ended at its stop
        loop.train(config, one_device)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["step"], summary["stopped_by"]) == (6, "tests/test_actions.py")
    SIGNALS.signal = None
    monkeypatch.setattr(actions, "load", lambda config: [])
    assert loop.train(config, one_device)["step"] == 6


def test_a_stop_at_train_steps_and_a_tuners_pruning_are_told_apart_from_an_early_stop(
    data_dir, one_device, tmp_path, monkeypatch
):
    # A stop at --train_steps ended the run where it would have ended: a higher --train_steps trains on from it.
    monkeypatch.setattr(actions, "load", lambda config: [_StopsAt(6)])
    config = helpers.make_config(data_dir, str(tmp_path / "a"), train_steps=6, steps_per_loop=3, hidden_sizes=(8,))
    assert "stopped_by" not in loop.train(config, one_device)
    assert loop.train(dataclasses.replace(config, train_steps=9), one_device)["step"] == 9
    # A tuner's pruning (on_eval) is named as such: the tuner reads it back where it was killed before recording it.
    monkeypatch.setattr(actions, "load", lambda config: [])
    config = helpers.make_config(
        data_dir, str(tmp_path / "b"), train_steps=12, steps_per_loop=3, eval_every=3, hidden_sizes=(8,)
    )
    summary = loop.train(config, one_device, on_eval=lambda step, results: step == 6)
    assert summary["step"] == 6 and summary["stopped_by"] == builtin.ON_EVAL == "on_eval (a tuner's pruning)"


def test_a_tuners_pruning_at_the_evaluation_a_resumed_run_redoes_stops_it_there(data_dir, one_device, tmp_path):
    # A run resumed at an --eval_every step evaluates it first; pruned there, it stops at that step, trains no
    # further, logs that evaluation once, and a rerun of the same command has nothing to do.
    config = helpers.make_config(
        data_dir, str(tmp_path), train_steps=6, steps_per_loop=3, eval_every=3, hidden_sizes=(8,)
    )
    loop.train(config, one_device)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    longer, asked = dataclasses.replace(config, train_steps=12), []

    def prune(step, results):
        asked.append(step)
        return True

    summary = loop.train(longer, one_device, on_eval=prune)
    assert asked == [6] and summary["step"] == 6 and summary["stopped_by"] == builtin.ON_EVAL
    logged = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [3, 6] and logged[-1] == {"step": 6, **summary["eval"]}
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # no step trained past 6
    assert loop.train(longer, one_device) == summary


class _ClosesBadly(base.Action):
    def __init__(self, raises=None):
        self.raises, self.closed = raises, False

    def __call__(self, round, context):
        if self.raises:
            raise self.raises

    def close(self, context):
        self.closed = True
        raise OSError("its file could not be closed")


def test_every_action_closes_and_a_failed_close_does_not_hide_the_error_the_run_ended_with(
    data_dir, one_device, tmp_path, monkeypatch, capsys
):
    first, second = _ClosesBadly(RuntimeError("the action's own mistake")), _ClosesBadly()
    monkeypatch.setattr(actions, "load", lambda config: [first, second])
    config = helpers.make_config(data_dir, str(tmp_path / "a"), train_steps=4, steps_per_loop=2, hidden_sizes=(8,))
    with pytest.raises(RuntimeError, match="the action's own mistake"):
        loop.train(config, one_device)
    assert first.closed and second.closed
    assert (
        "warning: tests/test_actions.py: close failed: OSError: its file could not be closed" in capsys.readouterr().out
    )
    # A run that ended well ends with the failed close: its error is the run's.
    monkeypatch.setattr(actions, "load", lambda config: [_ClosesBadly()])
    config = helpers.make_config(data_dir, str(tmp_path / "b"), train_steps=4, steps_per_loop=2, hidden_sizes=(8,))
    with pytest.raises(OSError, match="its file could not be closed"):
        loop.train(config, one_device)


class _Killed(Exception):
    """Stands in for a SIGKILL after an action acted, before the round's checkpoint."""


class _EarlyStop(base.Action):
    """An early stop on a scripted validation loss (0.5 at step 4, worse after it), evaluated every 2 steps: stops
    after 3 evaluations without improvement. Its best value and patience count are its checkpointed state.
    `kill_at`: the step it is killed at, after acting there."""

    every = 2

    def __init__(self, kill_at=None):
        self.best, self.bad, self.kill_at, self.seen = None, 0, kill_at, []

    def __call__(self, round, context):
        loss = {2: 1.0, 4: 0.5}.get(round.end, 0.5 + round.end / 100)
        if self.best is None or loss < self.best:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        self.seen.append((round.end, self.best, self.bad))
        if round.end == self.kill_at:
            raise _Killed()
        return Stop(context.run.evaluator.evaluate()) if self.bad >= 3 else None

    def checkpointed(self):
        return {"best": self.best, "bad": self.bad}

    def restored(self, value):
        self.best, self.bad = value["best"], value["bad"]


def test_an_actions_checkpointed_state_survives_a_kill_and_resume(data_dir, one_device, tmp_path, monkeypatch):
    # Before: an action's state lived in Python alone; resumed from step 8, the early stop began its count afresh and
    # stopped at step 16, where the run never killed stopped at step 10.
    settings = dict(train_steps=30, steps_per_loop=5, checkpoint_every=8, eval_every=0, hidden_sizes=(8,))
    whole = _EarlyStop()
    monkeypatch.setattr(actions, "load", lambda config: [whole])
    assert loop.train(helpers.make_config(data_dir, str(tmp_path / "whole"), **settings), one_device)["step"] == 10
    assert whole.seen[-1] == (10, 0.5, 3)

    config = helpers.make_config(data_dir, str(tmp_path / "killed"), **settings)
    monkeypatch.setattr(actions, "load", lambda config: [_EarlyStop(kill_at=10)])
    with pytest.raises(_Killed):
        loop.train(config, one_device)
    resumed = _EarlyStop()
    monkeypatch.setattr(actions, "load", lambda config: [resumed])
    summary = loop.train(config, one_device)
    assert (summary["resumed_at"], summary["step"], summary["stopped_by"]) == (8, 10, "tests/test_actions.py")
    assert resumed.seen == [(10, 0.5, 3)]


def test_an_actions_checkpointed_state_that_json_cannot_hold_is_one_line_naming_its_file():
    class Holds(base.Action):
        def __init__(self, value):
            self.value, self.given = value, None

        def checkpointed(self):
            return self.value

        def restored(self, value):
            self.given = value

    variable = tf.Variable("", dtype=tf.string)
    base.hand_back([Holds(None)], variable)  # a checkpoint from before the actions' state: nothing handed back
    base.hold([Holds({"best": 0.25, "bad": 2}), Holds(None)], variable)
    back = Holds(None)
    base.hand_back([back], variable)
    assert back.given == {"best": 0.25, "bad": 2}
    with pytest.raises(TaskError, match=r"^tests/test_actions\.py: checkpointed\(\) returned \{'when': datetime"):
        base.hold([Holds({"when": datetime.date(2026, 12, 7)})], variable)
    # Before: a dict keyed by steps came back keyed by strings ({"4": 0.5}), and a resumed action read other keys.
    with pytest.raises(TaskError) as error:
        base.hold([Holds({"losses": {4: 0.5, 6: 0.25}})], variable)
    assert str(error.value) == (
        "tests/test_actions.py: checkpointed() returned {'losses': {4: 0.5, 6: 0.25}}, which a checkpoint cannot hold "
        "(its dict key 4 is no string, and would come back as one): return numbers, strings, lists and dicts keyed by "
        "strings"
    )
