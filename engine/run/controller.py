"""The outer loop: rounds of steps, each handed to the run's actions, then the final evaluation and the summary.

Inner loop in graph: one tf.function runs a round of replica steps (engine/run/program.py). Outer loop in Python:
after each round the actions that are due act on it, in order (engine/run/actions/builtin.py engine_actions:
warnings, the NaN policy, log, profiling, any a fork adds, evaluation, checkpoints, a signal's stop). Round boundaries
are the multiples of --steps_per_loop and of each action's period (--eval_every, --checkpoint_every, a fork's), and
each action's steps (--profile_steps, so a trace covers exactly those steps): functions of the absolute step, so a
resumed run cuts its rounds exactly where an uninterrupted one does.
"""

import dataclasses
import time

import tensorflow as tf

from engine.cluster.signals import SIGNALS
from engine.numerics import updates
from engine.run import inputs
from engine.run.actions.base import ROLLED_BACK, Extras, NotAsked, Round, Stop
from engine.run.actions.builtin import Evaluate, stop
from engine.run.program import Recompiled
from engine.settings import plugins
from engine.settings.config import show
from engine.settings.errors import TaskError


@dataclasses.dataclass(frozen=True)
class Context:
    """What an action reads besides its round: the run, its report, its checkpoints, the rounds' timing, and whether
    this task is the chief (the one that writes files)."""

    run: object
    report: object
    checkpoints: object
    timing: object
    chief: bool


class Timing:
    """The rounds' steps, seconds and input wait, the first round and any other that traced a step left out: they
    include tracing and compilation."""

    def __init__(self):
        self.ran = False  # a round ran in this process: the first traced and compiled the step
        self.timed_from = None  # the step the first timed round started at
        self.steps, self.seconds, self.waited = 0, 0.0, 0.0
        self.timed = False  # whether the round added last is timed (metrics.jsonl says which are not)

    def add(self, round):
        # Not the first round, nor the first that returned an action's extras: another step, traced and compiled.
        self.timed, self.ran = self.ran and not round.traced, True
        if not self.timed:
            return
        if self.timed_from is None:
            self.timed_from = round.start
        self.steps, self.seconds = self.steps + round.steps, self.seconds + round.seconds
        self.waited += round.out["input_wait"]

    def summary(self, examples_per_step, waits_timed):
        """(examples_per_sec, input_wait_fraction) for the summary, over the rounds that traced nothing; (None, None)
        where every round traced (a run of one round): its time is mostly tracing and compilation, which its train
        line's examples_per_sec includes."""
        if not self.steps:
            return None, None
        examples_per_sec = self.steps * examples_per_step / self.seconds
        return examples_per_sec, self.waited / self.seconds if waits_timed else None


class Controller:
    """Runs the rounds of `run` (engine/run/build.py Run) from its current step to --train_steps, each followed by
    its actions, then the final evaluation; returns the summary."""

    def __init__(self, run, report, checkpoints, started):
        self.run, self.started = run, started
        self.stopped_by = None  # what stopped the run before --train_steps: the Stop's `by`, or its action's file
        self.context = Context(run, report, checkpoints, Timing(), run.placement.chief)

    def train(self):
        try:
            summary = self._rounds()
        except BaseException:
            self._close(ending=True)
            raise
        self._close(ending=False)
        return summary

    def _close(self, ending):
        """Closes every action, each even where one before it fails to. The first failure is raised, but where the
        run is `ending` on an error (or a signal) of its own: that one is what the run ends with, and a failed close
        is one line on the console."""
        failed = None
        for action in self.run.actions:
            try:
                action.close(self.context)
            except Exception as e:
                if ending:  # printed, not reported: the report may be what failed
                    print(f"warning: {plugins.file_of(action)}: close failed: {type(e).__name__}: {e}", flush=True)
                failed = failed or e
        if failed is not None and not ending:
            raise failed

    def _rounds(self):
        run, report, config = self.run, self.context.report, self.run.config
        report.line(header(run))
        # The training iterator, alone in a list: a finished one is deleted off the loop's thread (inputs.release).
        iterators, current, last, outcome = [run.program.train_iterator()], int(run.state.step.numpy()), None, None
        started = None  # where the last round run began
        report.count_losses(last_round_start(config.loop, run.actions), current)
        # From here on a signal stops the loop at a step, saved; the training iterator is released when the loop ends
        # (a signal or an error included): the final evaluation and the exit do not wait for its deletion.
        with SIGNALS.watch(run.program.stop), inputs.releasing(iterators):
            # A run stopped at an evaluation step saved it unevaluated: the resumed run evaluates it, once (Report
            # dropped any evaluation of it logged before).
            if evaluates_on_resume(config.loop, current):
                evaluation = _evaluation(run)
                outcome = self._checked(evaluation.at(current, self.context), evaluation, current)
            while current < config.train_steps and not isinstance(outcome, Stop):
                ran = self._round(iterators[0], current)
                if ran is None:  # recompiled: from the data position again, as the failed step took a batch
                    _renew(iterators, run)
                    continue
                last, outcome, started = ran.out, self._act(ran), ran.start
                if outcome == ROLLED_BACK:  # on from the checkpoint's step, reading on from the round's batches
                    current = int(run.state.step.numpy())
                    _renew(iterators, run)
                    continue
                current = ran.end
            self.context.checkpoints.save()  # nothing to do when this step is saved already
            if isinstance(outcome, Stop):  # its summary written before a signal that came meanwhile exits the run
                return self._stopped(current, outcome, started, last)
            if run.program.stopping_anywhere():  # a signal during the last round: every worker stops here alike
                stop(current, self.context)
        return self._summary(current, self._final_evaluation(current), last)

    def _stopped(self, current, outcome, started, last):
        """The summary of a run an action stopped at `current` (an early stop, a tuner pruning it at an evaluation),
        written even where a signal came as the action acted: the run ends there, and a rerun of its command does
        not train past it. The Stop's results are the run's, not evaluated again; logged as the evaluation of the
        step where the action's own evaluation was not, and its train_loss is the mean over the round it stopped
        after (the round run last began at `started`)."""
        report = self.context.report
        if report.evaluated != current:
            report.eval(current, outcome.results)
        if started is not None:
            report.count_losses(started, current)
        return self._summary(current, outcome.results, last)

    def _round(self, iterator, current):
        """The round of steps from `current` to the next boundary; None when it must run again (Recompiled)."""
        run = self.run
        end = next_boundary(run.config.loop, run.actions, current)
        extras = frozenset().union(*(a.needs for a in run.actions if a.needs and a.due(end, False)))
        around = _around(run.actions, current, end, self.context)
        traces, tic = run.program.traces(), time.perf_counter()
        try:
            with around:
                out, extra = run.program.run_round(iterator, end - current, extras)
        except Recompiled as e:
            self.context.report.line(str(e))
            return None
        seconds, traced = time.perf_counter() - tic, run.program.traces() != traces
        ended = current + int(out["steps"])
        return Round(current, ended, seconds, out, Extras(extra), stopping(out, run.program), traced, end)

    def _act(self, ran):
        """The round's bookkeeping, then each due action in turn: ROLLED_BACK or Stop ends the round's actions."""
        self.context.timing.add(ran)
        self.run.state.skipped.assign_add(int(ran.out["skipped"]))
        for action in self.run.actions:
            if action.due(ran.end, ran.stopping):
                try:
                    outcome = action(ran, self.context)
                except NotAsked as e:
                    raise TaskError(f"{plugins.file_of(action)}: {e}; {_asking(action, e.key)}") from None
                if outcome is not None:
                    return self._checked(outcome, action, ran.end)
        return None

    def _checked(self, outcome, action, step):
        """`action`'s outcome after `step`, checked. What stopped the run before --train_steps is the summary's
        `stopped_by`, which a rerun of the run's command reads: it does not train past that stop (one at --train_steps
        ended where the run would have, and a higher --train_steps trains on)."""
        if outcome is None:
            return None
        outcome = _checked_outcome(outcome, action, step, self.run.task.headline)
        if isinstance(outcome, Stop) and step < self.run.config.train_steps:
            self.stopped_by = outcome.by or plugins.file_of(action)
        return outcome

    def _final_evaluation(self, step):
        evaluator, report = self.run.evaluator, self.context.report
        results = evaluator.evaluate()
        report.eval(step, results)
        report.pictures(step, evaluator.pictures())
        return results

    def _summary(self, current, results, last):
        run, report = self.run, self.context.report
        config, program = run.config, run.program
        read = config.global_batch_size * program.batches_per_step  # the examples a step reads
        timing = self.context.timing
        if not timing.ran:  # resumed at the last step: no round of its own to time, the run's logged ones
            examples_per_sec, input_wait = report.logged_throughput(current), None
        else:
            examples_per_sec, input_wait = timing.summary(read, program.waits_timed)
        numbers = last or report.logged_at(current)
        summary = {
            "step": current,
            "train_loss": report.train_loss(),
            "eval": results,
            "examples_per_sec": examples_per_sec,
            # The share of the timed rounds' time the steps waited for their batches.
            "input_wait_fraction": input_wait,
            "input_bytes_read": int(program.bytes_read.numpy()) if run.data.sharded and program.counts_bytes else None,
            # A run of several updates: each one's loss and gradient norm over the last round, its last rates (as
            # logged, where this process resumed at the end and ran no round), and the settings each trained with.
            **(_update_metrics(program, numbers, report) if len(run.plans) > 1 and numbers else {}),
            **({"updates": settings} if (settings := updates.effective_settings(run.plans)) else {}),
            "skipped_steps": int(run.state.skipped.numpy()),
            # float16's scale as the run ends; several updates' are each their own, under <update>/loss_scale.
            "loss_scale": float(run.plans[0].loss_scale.scale.numpy())
            if program.float16 and len(run.plans) == 1
            else None,
            **({"stopped_by": self.stopped_by} if self.stopped_by else {}),  # an action's Stop ended the run
            "wall_seconds": time.time() - self.started,
            "resumed_at": report.resume_step,  # this process's first step, where it resumed a run (None: it did not)
            "strategy": run.placement.name,
            "num_replicas": run.placement.replicas,
            "precision": config.precision,
            "global_batch_size": config.global_batch_size,
            "class_names": None if run.task.class_names is None else list(run.task.class_names),
        }
        report.summary(summary)
        return summary


def _checked_outcome(outcome, action, step, headline):
    """An action's outcome, once it is one the controller knows (Action.__call__) and a Stop's results are an
    evaluation's (the run ends with them: its `headline` and `examples`); TaskError naming the action's file else:
    an outcome it did not mean would skip the round's evaluation, checkpoint and stop on a signal."""
    where = plugins.file_of(action)
    if isinstance(outcome, Stop):
        results = outcome.results
        missing = [k for k in (headline, "examples") if not isinstance(results, dict) or k not in results]
        if missing:
            raise TaskError(
                f"{where}: its Action returned Stop({results!r}) after step {step}: the run ends with these results, "
                f"which lack {' and '.join(missing)}; Stop takes an evaluation's (context.run.evaluator.evaluate())"
            )
        return outcome
    if isinstance(outcome, str) and outcome == ROLLED_BACK:
        return outcome
    raise TaskError(
        f"{where}: its Action returned {outcome!r} after step {step}; an action returns None to go on, ROLLED_BACK "
        "or Stop(results)"
    )


def _asking(action, key):
    """How an action gets `key` of round.extras: asking for it, or being due where the round's end was chosen."""
    if key not in action.needs:
        return f"say needs = {{{key!r}}} in the action's class"
    return (
        "the step returns it on the rounds where the action's due(step, False) holds at the round's end, as the "
        "controller asks before the round runs"
    )


def stopping(out, program):
    """Whether the run stops after the round whose numbers are `out`. All-reduced: every worker stops there, whichever
    one was signalled. A round that does not stop at a step (on an accelerator) also reads the flag as it is now: a
    signal after its last step stops the run there, not a round on."""
    return bool(out["stop"]) or (not program.stops_each_step and program.stopping_anywhere())


def _evaluation(run):
    return next(action for action in run.actions if isinstance(action, Evaluate))


class _around:
    """Every action's context around a round (a profiler's trace), entered in order, left in reverse."""

    def __init__(self, actions, start, end, context):
        self.managers = [action.around(start, end, context) for action in actions]

    def __enter__(self):
        for manager in self.managers:
            manager.__enter__()

    def __exit__(self, *exc):
        for manager in reversed(self.managers):
            manager.__exit__(*exc)


def _renew(iterators, run):
    """Replaces the training iterator in `iterators` by one from the data position on, the old one released."""
    inputs.release([iterators.pop()])
    iterators.append(run.program.train_iterator())


def header(run):
    """The run's first line: what trains, where, in what precision, how the steps get their batches and whether
    they compile with XLA (and why)."""
    config, where, program = run.config, run.placement, run.program
    return (
        f"task={config.task} model={config.model} parameters={parameters(run)} dataset={config.dataset} "
        f"strategy={where.name} replicas={where.replicas} "
        f"precision={config.precision} global_batch_size={config.global_batch_size} "
        f"input={program.input.label} jit_compile={show(program.jit_compile)} ({program.jit_reason})"
    )


def parameters(run):
    """The run's parameters as the header says them: every model's (Keras's count_params, each variable once,
    batch-norm statistics and a frozen teacher included), and the trained ones beside them where those are fewer
    (--freeze, a teacher, statistics)."""
    held = {id(v): v for model in run.models.values() for v in model.weights}
    total = sum(int(tf.size(v)) for v in held.values())
    trained = sum(int(tf.size(v)) for v in run.weights.variables)
    return str(total) if trained == total else f"{total} (trained {trained})"


def _update_metrics(program, last, report):
    """Each update's numbers of the last round, for the summary: its loss and gradient norm the means over the
    round's finite steps as the run logged them (Report.window_mean: the same numbers where a preemption split the
    round), its rates as they last were, its loss scale only in float16, as in the log."""
    found = {}
    for name in program.metric_names:
        if name.endswith("loss_scale") and not program.float16:
            found[name] = None
            continue
        stitched = report.window_mean(name) if name.endswith(("/loss", "grad_norm")) else None
        found[name] = last[name] if stitched is None else stitched
    return found


def evaluates_on_resume(loop, step):
    """Whether a run that starts training at `step` evaluates it first: an --eval_every step short of the end
    (the end's evaluation comes after the loop), which a run stopped there may have saved unevaluated. `loop`: the
    run's config.loop."""
    return bool(loop.eval_every) and 0 < step < loop.train_steps and step % loop.eval_every == 0


def last_round_start(loop, actions):
    """The step after which the last round of an uninterrupted run begins: the steps whose mean loss is the
    summary's train_loss. Rounds end at the boundaries of next_boundary."""
    last = loop.train_steps - 1
    starts = [0, *((last // every) * every for every in _periods(loop, actions))]
    return max([*starts, *(step for action in actions for step in action.steps if step <= last)])


def _periods(loop, actions):
    """The periods whose multiples end a round: the round's length, and each action's (an evaluation's, ...)."""
    return [every for every in (loop.steps_per_loop, *(action.every for action in actions)) if every]


def next_boundary(loop, actions, current):
    """Where the round that starts at `current` ends: a function of the absolute step only (the run's `actions` are
    the same whenever it resumes)."""
    ends = [loop.train_steps, *((current // every + 1) * every for every in _periods(loop, actions))]
    return min([*ends, *(step for action in actions for step in action.steps if step > current)])
