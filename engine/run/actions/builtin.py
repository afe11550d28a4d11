"""The engine's own actions after a round, in the order the controller calls them: warn when the steps waited for
input, apply the NaN policy (stop, or roll back), warn when float16 skipped most steps, log, profile, then the run's
own (--actions, its task's ACTIONS), then evaluate, checkpoint, stop on a signal. Each is an
engine/run/actions/base.py Action; `engine_actions` puts them in that order."""

import os

import tensorflow as tf

from engine.cluster.signals import SIGNALS
from engine.numerics.precision import FLOOR
from engine.run.actions.base import ROLLED_BACK, Action, Stop
from engine.settings.errors import Preempted, TrainingError, counted
from engine.state import checkpoint as checkpoint_lib

# What stopped a run whose `on_eval` stopped it (a tuner's pruning), as its summary's `stopped_by` says.
ON_EVAL = "on_eval (a tuner's pruning)"
MAX_ROLLBACKS = 3  # --on_nan=rollback gives up after this many rollbacks without a save in between
# A run warns once when its steps waited for input more than this share of the time, measured (as bench.run does)
# over a window of at least this many steps after the first round, which includes tracing.
INPUT_BOUND = 0.10
INPUT_WINDOW_STEPS = 50


def engine_actions(loop, own=(), on_eval=None):
    """The actions of a run of `loop` (its config.loop) in order: the engine's, with the run's `own` after the round's
    log and before its evaluation, checkpoint and stop, so a round a signal stops the run at (or a kill right after
    its checkpoint) is recorded by every action due at it: the resumed run starts after it. A diverged round is
    recorded by none (the NaN policy comes first). `on_eval(step, results)` returning True stops the run at that
    evaluation (a tuner's pruning)."""
    return [
        InputBoundWarning(),
        NanPolicy(loop.on_nan, loop.checkpoint_every),
        SkippedWarning(),
        Log(),
        Profile(loop.profile_steps),
        *own,
        Evaluate(loop.eval_every, loop.train_steps, on_eval),
        Checkpoint(loop.checkpoint_every, loop.train_steps),
        StopOnSignal(),
    ]


class InputBoundWarning(Action):
    """Warns once when, over at least `window` timed steps, the steps waited for input more than `bound` of the
    time: the input pipeline does not keep up."""

    def __init__(self, window=INPUT_WINDOW_STEPS, bound=INPUT_BOUND):
        self.window, self.bound, self.warned = window, bound, False

    def __call__(self, round, context):
        timing = context.timing
        steps, waited, seconds = timing.steps, timing.waited, timing.seconds
        if self.warned or not steps or steps < self.window or waited <= self.bound * seconds:
            return
        self.warned = True
        context.report.line(
            f"warning: input-bound: the steps waited for input {waited / seconds:.0%} of the time over steps "
            f"{timing.timed_from + 1}-{round.end}; the input pipeline does not keep up (more workers, "
            "--tf_data_service, a smaller --image_size or data held in memory would)"
        )


def divergence(round, float16, precision):
    """What went wrong in the round, as the error or rollback line says it; None when it trained. In float32 and
    bfloat16: any non-finite step. In float16 a skipped step is how the loss scale finds a scale that fits, except
    one skipped with the scale at its floor (a skip that could not lower it): no scale fits, and the run can make
    no more progress (whichever update's scale it was: each has its own, and the same floor)."""
    out, steps, first = round.out, round.steps, round.start + 1
    if not float16:
        if not out["skipped"]:
            return None
        if steps == 1:
            return f"non-finite loss or gradient at step {first} ({precision})"
        return (
            f"non-finite loss or gradient between steps {first} and {round.end} "
            f"({int(out['skipped'])} of {steps} steps, {precision})"
        )
    if not out["floor_skipped"]:
        return None
    return (
        f"{_some_of(out['floor_skipped'], first, round.end)} had non-finite gradients with the loss scale at its "
        f"floor ({FLOOR:g}), which no loss scale can fix (mixed_float16)"
    )


def _steps(first, last):
    """Steps first..last as a line says them: "step 21", "the 10 steps 21-30"."""
    return f"step {first}" if first == last else f"the {last - first + 1} steps {first}-{last}"


def _some_of(count, first, last):
    """`count` of steps first..last: "step 21" (a round of one step), "3 of the 10 steps 21-30"."""
    return _steps(first, last) if first == last else f"{int(count)} of {_steps(first, last)}"


class NanPolicy(Action):
    """--on_nan: a round that diverged stops the run (TrainingError naming the steps and the last good checkpoint),
    or with rollback restores that checkpoint and reads on from the data position the round reached."""

    def __init__(self, on_nan, checkpoint_every=0):
        self.rollback, self.checkpoint_every = on_nan == "rollback", checkpoint_every
        self.rollbacks, self.target = 0, None  # rollbacks in a row to checkpoint `target`

    def __call__(self, round, context):
        run = context.run
        float16 = run.program.float16
        diverged = divergence(round, float16, run.config.precision)
        if not diverged:
            return None
        checkpoints = context.checkpoints
        last_good = self._last_good(checkpoints, round.start) if self.rollback else checkpoints.saved_path
        if last_good != self.target:  # saved since the last rollback: a new count
            self.rollbacks, self.target = 0, last_good
        if not self.rollback or self.rollbacks >= MAX_ROLLBACKS or not last_good:
            gave_up = f" (--on_nan=rollback: {self.rollbacks} rollbacks without a save between them)"
            raise TrainingError(
                f"{diverged}{gave_up if self.rollback and last_good else ''}; last good checkpoint: "
                f"{last_good or 'none'}; lower --learning_rate or set --clip_norm"
            )
        self._roll_back(context, diverged, round, last_good)
        return ROLLED_BACK

    def _last_good(self, checkpoints, start):
        """The checkpoint a rollback returns to: the newest one by --checkpoint_every (or step 0's) up to the round's
        `start`, as a run never stopped has saved, so that a preemption's save (at whatever step the signal came)
        changes nothing; the one saved or restored last where no such checkpoint is left (rotated away by the
        preemption's save, with --keep_checkpoints=1)."""
        saved = checkpoints.saved_path
        if saved is None or self._scheduled(checkpoint_lib.step_of(saved)):
            return saved
        scheduled = [
            path
            for path in checkpoint_lib.list_checkpoints(checkpoints.directory)
            if checkpoint_lib.step_of(path) <= start and self._scheduled(checkpoint_lib.step_of(path))
        ]
        return scheduled[0] if scheduled else saved

    def _scheduled(self, step):
        return step == 0 or bool(self.checkpoint_every and step % self.checkpoint_every == 0)

    def _roll_back(self, context, diverged, round, last_good):
        state, reached, batches_per_step = context.run.state, round.end, context.run.program.batches_per_step
        position, saved = int(state.batches.numpy()), context.checkpoints.saved_path
        # A round a signal cut short reads on from where it was to end, as the run never stopped does: its resume
        # then trains what that run trains.
        ahead = ((round.planned or reached) - reached) * batches_per_step
        try:
            context.checkpoints.restore(last_good)  # its actions' state too
        except checkpoint_lib.Unreadable as e:  # one found on disk, not this process's own: the one it knows
            if last_good == saved:
                raise
            context.report.line(f"warning: checkpoint {last_good} is unreadable ({e}); rolling back to {saved}")
            context.checkpoints.restore(saved)
            last_good = saved
        context.checkpoints.saved_path = last_good  # the checkpoint that holds the state now
        context.checkpoints.discard_after(checkpoint_lib.step_of(last_good))
        state.batches.assign(position + ahead)  # read on from here: the discarded steps' batches are not redone
        current, self.rollbacks = int(state.step.numpy()), self.rollbacks + 1
        context.report.rewind(current)
        one, read = reached - current == 1, (reached - current) * batches_per_step
        steps = _steps(current + 1, reached)
        batches = f"the batch {'it' if one else 'they'} read is" if read == 1 else f"the {read} batches"
        batches += "" if read == 1 else f" {'it' if one else 'they'} read are"
        verb = "is" if ahead == 1 else "are"
        skipped = (
            f", nor {verb} the {counted(ahead, 'batch', 'batches')} of the steps a signal cut short" if ahead else ""
        )
        context.report.line(
            f"{diverged}: rolled back to step {current} ({last_good}), discarding {steps} since that checkpoint; "
            f"{batches} not trained on{skipped} (--on_nan=rollback)"
        )


def _scales_now(run):
    """How the loss scale fell, for the skip warning: one update's "is now S", several updates' each by name."""
    scales = [(plan.name, float(plan.loss_scale.scale.numpy())) for plan in run.plans]
    if len(scales) == 1:
        return f"the loss scale halves at each skipped step and is now {scales[0][1]:g}"
    now = ", ".join(f"{name} {scale:g}" for name, scale in scales)
    return f"each update's loss scale halves at each step it skips; they are now {now}"


def _what_skipped(run):
    """What a skipped step left untrained: everything, or with several updates, each skips alone, those whose
    gradients were not finite (a generator trains where its discriminator overflowed)."""
    if len(run.plans) == 1:
        return "non-finite gradients: nothing trained"
    return "non-finite gradients in an update: that update did not train there, the others did"


class SkippedWarning(Action):
    """mixed_float16: a warning when more than half of the round's steps were skipped (non-finite gradients)."""

    def __call__(self, round, context):
        run = context.run
        if not run.program.float16 or 2 * round.out["skipped"] <= round.steps:
            return
        context.report.line(
            f"warning: mixed_float16: {_some_of(round.out['skipped'], round.start + 1, round.end)} "
            f"{'was' if round.steps == 1 else 'were'} skipped ({_what_skipped(run)}); "
            f"{_scales_now(run)} "
            f"(--initial_loss_scale={run.config.initial_loss_scale:g})"
        )


class Log(Action):
    """The round's train line and metrics (console, metrics.jsonl, TensorBoard)."""

    def __call__(self, round, context):
        run, out = context.run, round.out
        names = run.program.metric_names
        scales = [name for name in names if name.endswith("loss_scale")]
        read = run.program.batches_per_step * run.config.global_batch_size  # the examples a step reads
        metrics = {
            # Several updates' losses summed mean nothing (a critic's and a generator's): each is logged, not their sum.
            "loss": out["loss"] if len(run.plans) == 1 else None,
            # Each update's rates (`learning_rate` where a variable trains with its settings, `learning_rate/<regex>`
            # for each group), gradient norm and loss scale; prefixed <update>/ and with its loss in a run of several.
            **{name: out[name] for name in names if name not in scales},
            **{name: out[name] if run.program.float16 else None for name in scales},
            # Every example the steps read: a step whose update reads a fresh batch per repetition reads several.
            "examples_per_sec": round.steps * read / round.seconds,
            "skipped_steps": out["skipped"],
            # float16, several updates: each skips alone, and its numbers are over the steps it did not skip.
            **(
                {f"{p.prefix}skipped_steps": int(out[p.prefix + "skipped"]) for p in run.plans}
                if len(run.plans) > 1 and run.program.float16
                else {}
            ),
        }
        context.report.train(round.end, metrics, traced=not context.timing.timed)


class Profile(Action):
    """--profile_steps=A,B: the chief traces steps A+1..B into workdir/profile for TensorBoard's Profile tab."""

    def __init__(self, steps):
        self.steps, self.running = steps, False  # rounds end at A and B (Action.steps)
        self.started = None  # the step this process's trace started after: A, or where a resumed run began inside A..B

    def _logdir(self, context):
        return os.path.join(context.run.config.workdir, "profile")

    def around(self, start, end, context):
        """Starts the trace at the first round inside A..B (on the chief) and marks the round: the Profile tab's
        step-time views need a marker (one per round: its steps run in one call of the traced loop)."""
        if self.steps and context.chief and not self.running and self.steps[0] <= start < self.steps[1]:
            tf.profiler.experimental.start(self._logdir(context))
            self.running, self.started = True, start
        if not self.running:
            return super().around(start, end, context)
        return tf.profiler.experimental.Trace("train", step_num=start + 1, _r=1)

    def __call__(self, round, context):
        if self.running and round.end >= self.steps[1]:
            self.close(context)
            context.report.line(
                f"profile of steps {self.started + 1}..{round.end} in {self._logdir(context)} (tensorboard --logdir)"
            )

    def close(self, context):
        if self.running:  # a trace cut short by an error or a signal is still written
            tf.profiler.experimental.stop()
            self.running = False


class Evaluate(Action):
    """Evaluates and reports every --eval_every steps short of the end (the end's evaluation comes after the loop),
    unless the run is stopping (a preemption's grace period has no time for it: the resumed run evaluates it).
    `on_eval(step, results)` returning True stops the run there (a tuner's pruning), whose results are then the
    run's."""

    def __init__(self, every, train_steps, on_eval=None):
        self.every, self.train_steps, self.on_eval = every, train_steps, on_eval

    def due(self, step, stopping):
        return bool(self.every) and step % self.every == 0 and step < self.train_steps and not stopping

    def __call__(self, round, context):
        return self.at(round.end, context)

    def at(self, step, context):
        """Evaluates at `step`; Stop(results) when `on_eval` stops the run there."""
        evaluator = context.run.evaluator
        results = evaluator.evaluate()
        context.report.eval(step, results)
        context.report.pictures(step, evaluator.pictures())
        return Stop(results, ON_EVAL) if self.on_eval and self.on_eval(step, results) else None


class Checkpoint(Action):
    """Saves every --checkpoint_every steps, at the end, and when the run stops on a signal."""

    def __init__(self, every, train_steps):
        self.every, self.train_steps = every, train_steps

    def due(self, step, stopping):
        return stopping or step == self.train_steps or bool(self.every and step % self.every == 0)

    def __call__(self, round, context):
        context.checkpoints.save()


class StopOnSignal(Action):
    """A signal (engine/cluster/signals.py) stops the run after the checkpoint of its round, raising Preempted with
    its exit code."""

    def due(self, step, stopping):
        return stopping

    def __call__(self, round, context):
        stop(round.end, context)


def stop(step, context):
    """Ends the run at `step`, saved: Preempted, which launch.py says as the run's last line (said here too, it was
    said twice)."""
    message = (
        f"{SIGNALS.cause} at step {step}; checkpoint {context.checkpoints.saved_path}; run the same command to resume"
    )
    context.report.clear()
    raise Preempted(message, SIGNALS.exit_code)
