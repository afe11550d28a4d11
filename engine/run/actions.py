"""What the outer loop does after a round of steps, each its own piece: log it, warn when the steps waited for
input or float16 skipped most of them, apply the NaN policy (stop, or roll back), evaluate, checkpoint, stop on a
signal, profile. engine/loop.py calls them in that order; each reads the round it is given and the run's state.
"""

import contextlib
import dataclasses
import os

import tensorflow as tf

from engine.cluster.signals import PREEMPTION
from engine.settings import sections
from engine.state import checkpoint as checkpoint_lib

MAX_ROLLBACKS = 3  # --on_nan=rollback gives up after this many rollbacks without a save in between
# A run warns once when its steps waited for input more than this share of the time, measured (as bench.run does)
# over a window of at least this many steps after the first round, which includes tracing.
INPUT_BOUND = 0.10
INPUT_WINDOW_STEPS = 50


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss in float32 or bfloat16; float16 steps skipped with the loss scale at
    its floor); the message says where."""


class Preempted(Exception):
    """A signal stopped the run after a checkpoint; `exit_code` tells a scheduler to restart it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class Round:
    """A round of steps that ran: steps start+1..end, in `seconds`; `out`: the inner loop's numbers (run_steps)."""

    start: int
    end: int
    seconds: float
    out: dict

    @property
    def steps(self):
        return self.end - self.start


class Timing:
    """The rounds' steps, seconds and input wait, the first round left out: it includes tracing and compilation."""

    def __init__(self):
        self.first = None  # (steps, seconds) of the first round
        self.steps, self.seconds, self.waited = 0, 0.0, 0.0

    def add(self, done):
        if self.first is None:
            self.first = (done.steps, done.seconds)
            return
        self.steps, self.seconds = self.steps + done.steps, self.seconds + done.seconds
        self.waited += done.out["input_wait"]

    def summary(self, global_batch_size, waits_timed):
        """(examples_per_sec, input_wait_fraction) for the summary: of the first round when it was the only one."""
        steps, seconds = (self.steps, self.seconds) if self.steps or not self.first else self.first
        examples_per_sec = steps * global_batch_size / seconds if steps else None
        return examples_per_sec, self.waited / seconds if seconds and waits_timed else None


class InputBoundWarning:
    """Warns once when, over at least `window` timed steps, the steps waited for input more than `bound` of the
    time: the input pipeline does not keep up."""

    def __init__(self, timing, report, window=INPUT_WINDOW_STEPS, bound=INPUT_BOUND):
        self.timing, self.report, self.window, self.bound = timing, report, window, bound
        self.warned = False

    def __call__(self, done):
        t = self.timing
        if self.warned or not t.steps or t.steps < self.window or t.waited <= self.bound * t.seconds:
            return
        self.warned = True
        self.report.line(
            f"warning: input-bound: the steps waited for input {t.waited / t.seconds:.0%} of the time over steps "
            f"{t.first[0] + 1}-{done.end}; the input pipeline does not keep up (more workers, --tf_data_service, a "
            "smaller --image_size or data held in memory would)"
        )


def warn_skipped(trainer, report, done):
    """mixed_float16: a warning when more than half of the round's steps were skipped (non-finite gradients)."""
    if not trainer.float16 or 2 * done.out["skipped"] <= done.steps:
        return
    report.line(
        f"warning: mixed_float16: {int(done.out['skipped'])} of the {done.steps} steps {done.start + 1}-{done.end} "
        "were skipped (non-finite gradients: nothing trained); the loss scale halves at each skipped step and is now "
        f"{float(trainer.loss_scale.scale.numpy()):g} (--initial_loss_scale={trainer.config.initial_loss_scale:g})"
    )


def log(trainer, report, done):
    """The round into the run's record: its skipped steps counted, its train line and metrics written."""
    out = done.out
    trainer.skipped.assign_add(int(out["skipped"]))
    scales = [name for name in trainer.step_metrics if name.endswith("loss_scale")]
    metrics = {
        "loss": out["loss"],
        # Each update's rates (`learning_rate` where a variable trains with its settings, `learning_rate/<regex>`
        # for each group), gradient norm and loss scale; prefixed <update>/ and with its loss in a run of several.
        **{name: out[name] for name in trainer.step_metrics if name not in scales},
        **{name: out[name] if trainer.float16 else None for name in scales},
        "examples_per_sec": done.steps * trainer.config.global_batch_size / done.seconds,
        "skipped_steps": out["skipped"],
    }
    report.train(done.end, metrics)


def divergence(trainer, done):
    """What went wrong in the round, as the error or rollback line says it; None when it trained. In float32 and
    bfloat16: any non-finite step. In float16 a skipped step is how the loss scale finds a scale that fits, except
    one skipped with the scale at its floor (a skip that could not lower it): no scale fits, and the run can make
    no more progress."""
    out, steps, first = done.out, done.steps, done.start + 1
    if not trainer.float16:
        if not out["skipped"]:
            return None
        return (
            f"non-finite loss or gradient between steps {first} and {done.end} "
            f"({int(out['skipped'])} of {steps} steps, {trainer.config.precision})"
        )
    if not out["floor_skipped"]:
        return None
    return (
        f"{int(out['floor_skipped'])} of the {steps} steps {first}-{done.end} had non-finite gradients with the "
        f"loss scale at its floor ({float(trainer.loss_scale.scale.numpy()):g}), which no loss scale can fix "
        "(mixed_float16)"
    )


class NanPolicy:
    """--on_nan: a round that diverged stops the run (TrainingError naming the steps and the last good checkpoint),
    or with rollback restores that checkpoint and reads on from the data position the round reached."""

    def __init__(self, trainer, checkpoints, report):
        self.trainer, self.checkpoints, self.report = trainer, checkpoints, report
        self.rollbacks, self.target = 0, None  # rollbacks in a row to checkpoint `target`

    def __call__(self, done):
        """True when the round was rolled back: the run's step is the checkpoint's, and its steps are undone."""
        diverged = divergence(self.trainer, done)
        if not diverged:
            return False
        last_good, rollback = self.checkpoints.saved_path, self.trainer.config.on_nan == "rollback"
        if last_good != self.target:  # saved since the last rollback: a new count
            self.rollbacks, self.target = 0, last_good
        if not rollback or self.rollbacks >= MAX_ROLLBACKS or not last_good:
            gave_up = f" (--on_nan=rollback: {self.rollbacks} rollbacks without a save between them)"
            raise TrainingError(
                f"{diverged}{gave_up if rollback and last_good else ''}; last good checkpoint: {last_good or 'none'}; "
                "lower --learning_rate or set --clip_norm"
            )
        self._roll_back(diverged, done.end, last_good)
        return True

    def _roll_back(self, diverged, reached, last_good):
        trainer = self.trainer
        position = int(trainer.batches.numpy())
        checkpoint_lib.restore(self.checkpoints.checkpoint, last_good)
        trainer.batches.assign(position)  # read on from here: the discarded steps' batches are not redone
        current, self.rollbacks = int(trainer.step.numpy()), self.rollbacks + 1
        self.report.rewind(current)
        discarded = reached - current
        self.report.line(
            f"{diverged}: rolled back to step {current} ({last_good}), discarding the {discarded} steps "
            f"{current + 1}-{reached} since that checkpoint; the {discarded} batches they read are not trained on "
            "(--on_nan=rollback)"
        )


class Evaluate:
    """Evaluates and reports at a step; `on_eval(step, results)` returning True stops the run there (a tuner's
    pruning), whose results are then the run's."""

    def __init__(self, trainer, report, on_eval=None):
        self.trainer, self.report, self.on_eval = trainer, report, on_eval
        self.results = None

    def __call__(self, step):
        """Evaluates at `step`; True when `on_eval` stops the run there."""
        self.results = self.trainer.evaluate()
        self.report.eval(step, self.results)
        self.report.pictures(step, self.trainer.pictures())
        return bool(self.on_eval and self.on_eval(step, self.results))


def evaluation_due(loop, step, stopping):
    """Whether the loop evaluates after reaching `step` (`loop`: the run's config.loop): an --eval_every step short
    of the end (the end's evaluation comes after the loop), unless the run is stopping (a preemption's grace period
    has no time for it: the resumed run evaluates it, evaluates_on_resume)."""
    loop = sections.section(loop, "loop")
    return bool(loop.eval_every) and step % loop.eval_every == 0 and step < loop.train_steps and not stopping


def checkpoint_due(loop, step, stopping):
    """Whether the loop saves after reaching `step`: every --checkpoint_every steps, at the end, and on a stop."""
    loop = sections.section(loop, "loop")
    return stopping or step == loop.train_steps or bool(loop.checkpoint_every and step % loop.checkpoint_every == 0)


class Preemption:
    """A signal (engine/preemption.py) stops the run after a checkpoint, raising Preempted with its exit code."""

    def __init__(self, trainer, checkpoints, report):
        self.trainer, self.checkpoints, self.report = trainer, checkpoints, report

    def stopping(self, done):
        """Whether the run stops after this round. All-reduced: every worker stops here, whichever one was
        signalled. A round that does not stop at a step also reads the flag as it is now: a signal after its last
        step stops the run here, not a round on."""
        return bool(done.out["stop"]) or (not self.trainer.stops_each_step and self.trainer.stopping_anywhere())

    def __call__(self, step):
        message = (
            f"{PREEMPTION.cause} at step {step}; checkpoint {self.checkpoints.saved_path}; run the same command to "
            "resume"
        )
        self.report.line(message)
        raise Preempted(message, PREEMPTION.exit_code)


class Profile:
    """--profile_steps=A,B: the chief traces steps A+1..B into workdir/profile for TensorBoard's Profile tab."""

    def __init__(self, loop, workdir, chief):
        self.steps = loop.profile_steps if chief else ()
        self.logdir = os.path.join(workdir, "profile")
        self.running = False

    def before_round(self, current):
        if self.steps and not self.running and self.steps[0] <= current < self.steps[1]:
            tf.profiler.experimental.start(self.logdir)
            self.running = True

    def marker(self, current):
        """A step marker around a traced round, which the Profile tab's step-time views need (one per round:
        the steps inside a round run in one call of the traced loop, with no host code between them)."""
        if not self.running:
            return contextlib.nullcontext()
        return tf.profiler.experimental.Trace("train", step_num=current + 1, _r=1)

    def after_round(self, current, report):
        if self.running and current >= self.steps[1]:
            self.stop()
            report.line(f"profile of steps {self.steps[0] + 1}..{current} in {self.logdir} (tensorboard --logdir)")

    def stop(self):
        if self.running:
            tf.profiler.experimental.stop()
            self.running = False
