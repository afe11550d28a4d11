"""The outer loop's actions (engine/actions.py), each on its own: at which steps they fire, what they write, what
they restore. Host logic on stand-ins for the trainer and the report; the rollback restores a real checkpoint."""

import types

import pytest
import tensorflow as tf

from engine.cluster.signals import PREEMPTION
from engine.run import actions, loop


class Lines:
    """A report that keeps what it was given."""

    def __init__(self):
        self.lines, self.trains, self.evals, self.drawn, self.rewinds = [], [], [], [], []

    def line(self, text):
        self.lines.append(text)

    def train(self, step, metrics):
        self.trains.append((step, metrics))

    def eval(self, step, results):
        self.evals.append((step, results))

    def pictures(self, step, images):
        self.drawn.append((step, images))

    def rewind(self, step):
        self.rewinds.append(step)


def _cadence(**settings):
    return types.SimpleNamespace(
        **{"steps_per_loop": 10, "eval_every": 0, "checkpoint_every": 0, "profile_steps": (), **settings}
    )


def _round(start, end, seconds=1.0, **out):
    return actions.Round(start, end, seconds, {"skipped": 0.0, "floor_skipped": 0.0, "stop": 0.0, **out})


def _fired(config, stopping_at=None):
    """(round ends, evaluation steps, checkpoint steps) of a run from step 0, as the loop cuts and checks them."""
    ends, evaluated, saved, current = [], [], [], 0
    while current < config.train_steps:
        current = loop._next_boundary(config, current)
        ends.append(current)
        stopping = current == stopping_at
        if actions.evaluation_due(config, current, stopping):
            evaluated.append(current)
        if actions.checkpoint_due(config, current, stopping):
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
    timing, report = actions.Timing(), Lines()
    warn = actions.InputBoundWarning(timing, report)
    rounds = [_round(0, 10, 5.0, input_wait=5.0)]  # the first round (tracing): outside the window
    rounds += [_round(10 * k, 10 * k + 10, 1.0, input_wait=0.2) for k in range(1, 7)]
    warned_at = []
    for done in rounds:
        timing.add(done)
        before = len(report.lines)
        warn(done)
        warned_at += [done.end] * (len(report.lines) - before)
    assert actions.INPUT_WINDOW_STEPS == 50 and warned_at == [60]  # 50 timed steps: steps 11-60
    assert report.lines == [
        "warning: input-bound: the steps waited for input 20% of the time over steps 11-60; the input pipeline does "
        "not keep up (more workers, --tf_data_service, a smaller --image_size or data held in memory would)"
    ]
    assert timing.summary(64, waits_timed=True) == (60 * 64 / 6.0, pytest.approx(0.2))


def test_waiting_exactly_the_bound_does_not_warn():
    timing, report = actions.Timing(), Lines()
    warn = actions.InputBoundWarning(timing, report, window=10)
    for done in [_round(0, 10, input_wait=0.0), _round(10, 20, 2.0, input_wait=0.2)]:
        timing.add(done)
        warn(done)
    assert report.lines == []


def test_a_run_of_one_round_reports_that_rounds_throughput():
    timing = actions.Timing()
    timing.add(_round(0, 20, 4.0, input_wait=1.0))
    assert timing.summary(8, waits_timed=True) == (40.0, 0.0)  # its wait is not timed: tracing is in it
    assert timing.summary(8, waits_timed=False) == (40.0, None)
    assert actions.Timing().summary(8, waits_timed=True) == (None, None)


def _float16_trainer(scale=4.0):
    return types.SimpleNamespace(
        float16=True,
        loss_scale=types.SimpleNamespace(scale=tf.constant(scale)),
        config=types.SimpleNamespace(initial_loss_scale=1024.0, precision="mixed_float16"),
    )


def test_the_skip_warning_needs_more_than_half_of_the_rounds_steps_skipped():
    report, trainer = Lines(), _float16_trainer()
    actions.warn_skipped(trainer, report, _round(10, 20, skipped=5.0))
    assert report.lines == []
    actions.warn_skipped(trainer, report, _round(10, 20, skipped=6.0))
    assert report.lines == [
        "warning: mixed_float16: 6 of the 10 steps 11-20 were skipped (non-finite gradients: nothing trained); the "
        "loss scale halves at each skipped step and is now 4 (--initial_loss_scale=1024)"
    ]
    actions.warn_skipped(types.SimpleNamespace(float16=False), report, _round(10, 20, skipped=10.0))
    assert len(report.lines) == 1  # float32: a skipped step is divergence, the NaN policy's


def test_the_log_counts_skipped_steps_and_writes_the_train_line():
    trainer = types.SimpleNamespace(
        skipped=tf.Variable(2, dtype=tf.int64),
        step_metrics=["learning_rate", "grad_norm", "loss_scale"],
        float16=False,
        config=types.SimpleNamespace(global_batch_size=16),
    )
    report = Lines()
    out = dict(loss=0.5, learning_rate=0.1, grad_norm=2.0, loss_scale=1.0, skipped=3.0)
    actions.log(trainer, report, _round(10, 20, 2.0, **out))
    assert int(trainer.skipped.numpy()) == 5
    assert report.trains == [
        (
            20,
            dict(loss=0.5, learning_rate=0.1, grad_norm=2.0, loss_scale=None, examples_per_sec=80.0, skipped_steps=3.0),
        )
    ]


class _Run:
    """The state a rollback touches: the step and data-position counters, saved in a real checkpoint."""

    def __init__(self, tmp_path, on_nan="rollback"):
        self.step = tf.Variable(20, dtype=tf.int64)
        self.batches = tf.Variable(20, dtype=tf.int64)
        self.float16 = False
        self.config = types.SimpleNamespace(on_nan=on_nan, precision="float32")
        checkpoint = tf.train.Checkpoint(step=self.step, batches=self.batches)
        self.checkpoints = types.SimpleNamespace(
            checkpoint=checkpoint, saved_path=checkpoint.save(str(tmp_path / "ckpt"))
        )

    def diverge(self, steps=10):
        """A round of `steps` whose last 3 were non-finite."""
        start = int(self.step.numpy())
        self.step.assign_add(steps)
        self.batches.assign_add(steps)
        return _round(start, start + steps, skipped=3.0)


def test_the_rollback_restores_the_checkpoint_and_reads_on_from_the_rounds_data_position(tmp_path):
    run, report = _Run(tmp_path), Lines()
    policy = actions.NanPolicy(run, run.checkpoints, report)
    assert policy(_round(20, 30)) is False  # a round that trained: nothing to do
    run.step.assign(30)
    run.batches.assign(30)
    assert policy(_round(20, 30, skipped=3.0)) is True
    assert (int(run.step.numpy()), int(run.batches.numpy())) == (20, 30)
    assert report.rewinds == [20]
    assert report.lines == [
        f"non-finite loss or gradient between steps 21 and 30 (3 of 10 steps, float32): rolled back to step 20 "
        f"({run.checkpoints.saved_path}), discarding the 10 steps 21-30 since that checkpoint; the 10 batches they "
        "read are not trained on (--on_nan=rollback)"
    ]


def test_the_rollback_gives_up_after_max_rollbacks_without_a_save(tmp_path):
    run, report = _Run(tmp_path), Lines()
    policy = actions.NanPolicy(run, run.checkpoints, report)
    for _ in range(actions.MAX_ROLLBACKS):
        assert policy(run.diverge()) is True
    assert int(run.batches.numpy()) == 20 + 10 * actions.MAX_ROLLBACKS
    with pytest.raises(actions.TrainingError) as stopped:
        policy(run.diverge())
    assert str(stopped.value) == (
        "non-finite loss or gradient between steps 21 and 30 (3 of 10 steps, float32) (--on_nan=rollback: 3 "
        f"rollbacks without a save between them); last good checkpoint: {run.checkpoints.saved_path}; lower "
        "--learning_rate or set --clip_norm"
    )


def test_a_save_between_rollbacks_starts_the_count_again(tmp_path):
    run, report = _Run(tmp_path), Lines()
    policy = actions.NanPolicy(run, run.checkpoints, report)
    for _ in range(actions.MAX_ROLLBACKS):
        policy(run.diverge())
    run.step.assign(25)
    run.checkpoints.saved_path = run.checkpoints.checkpoint.save(str(tmp_path / "ckpt"))
    for _ in range(actions.MAX_ROLLBACKS):
        assert policy(run.diverge()) is True
    assert int(run.step.numpy()) == 25 and len(report.rewinds) == 2 * actions.MAX_ROLLBACKS


def test_the_stop_policy_names_the_steps_and_the_last_good_checkpoint(tmp_path):
    run = _Run(tmp_path, on_nan="stop")
    with pytest.raises(actions.TrainingError) as stopped:
        actions.NanPolicy(run, run.checkpoints, Lines())(run.diverge())
    assert str(stopped.value) == (
        "non-finite loss or gradient between steps 21 and 30 (3 of 10 steps, float32); last good checkpoint: "
        f"{run.checkpoints.saved_path}; lower --learning_rate or set --clip_norm"
    )
    assert int(run.step.numpy()) == 30  # nothing restored


def test_float16_diverges_only_on_skips_with_the_scale_at_its_floor():
    trainer = _float16_trainer(scale=1.0)
    assert actions.divergence(trainer, _round(0, 10, skipped=9.0)) is None  # the scale was still finding its level
    assert actions.divergence(trainer, _round(0, 10, skipped=9.0, floor_skipped=2.0)) == (
        "2 of the 10 steps 1-10 had non-finite gradients with the loss scale at its floor (1), which no loss scale "
        "can fix (mixed_float16)"
    )


def test_preemption_reads_the_flag_of_the_round_or_of_now_and_raises_with_its_exit_code():
    asked = []
    trainer = types.SimpleNamespace(stops_each_step=True, stopping_anywhere=lambda: asked.append(1) or True)
    checkpoints, report = types.SimpleNamespace(saved_path="/w/checkpoints/ckpt-7"), Lines()
    preemption = actions.Preemption(trainer, checkpoints, report)
    assert preemption.stopping(_round(0, 7, stop=1.0)) and not preemption.stopping(_round(0, 7))
    assert asked == []  # a round that stops at a step carries the flag
    trainer.stops_each_step = False
    assert preemption.stopping(_round(0, 7)) and asked == [1]
    with pytest.raises(actions.Preempted) as stopped:
        preemption(7)
    # The cause and exit code as the signal handler knows them (no signal here: a peer worker's).
    message = f"{PREEMPTION.cause} at step 7; checkpoint /w/checkpoints/ckpt-7; run the same command to resume"
    assert (str(stopped.value), stopped.value.exit_code, report.lines) == (message, PREEMPTION.exit_code, [message])


@pytest.mark.parametrize("prune", [False, True])
def test_an_evaluation_reports_and_tells_whether_the_tuner_stops_there(prune):
    trainer = types.SimpleNamespace(evaluate=lambda: {"accuracy": 0.5, "examples": 4}, pictures=lambda: {"p": 1})
    seen, report = [], Lines()
    evaluate = actions.Evaluate(trainer, report, lambda step, results: seen.append((step, results)) or prune)
    assert evaluate(10) is prune
    assert seen == report.evals == [(10, {"accuracy": 0.5, "examples": 4})] and report.drawn == [(10, {"p": 1})]
    assert evaluate.results == {"accuracy": 0.5, "examples": 4}
    assert actions.Evaluate(trainer, Lines())(10) is False  # no tuner: never stops
