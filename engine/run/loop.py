"""The story of a run: strategy, the run's state (engine/trainer.py), the workdir's lock, restore, then rounds of
steps, each followed by what is due (engine/actions.py), then the final evaluation and the summary.

Inner loop in graph: one tf.function runs a round of replica steps (Trainer.run_steps). Outer loop in Python: after
each round, log, warnings, the NaN policy, evaluation, checkpoints and preemption. Round boundaries are multiples of
--steps_per_loop, --eval_every and --checkpoint_every, so a resumed run cuts its rounds exactly where an
uninterrupted one does (and at --profile_steps, so a trace covers exactly those steps).
"""

import contextlib
import dataclasses
import json
import os
import time

import tensorflow as tf

from engine.cluster import distribute
from engine.cluster.signals import PREEMPTION
from engine.run import actions, inputs, xla
from engine.run.actions import (  # noqa: F401  (re-exported: launch.py, research/ and tests read them from here)
    INPUT_BOUND,
    INPUT_WINDOW_STEPS,
    MAX_ROLLBACKS,
    Preempted,
    Profile,
    TrainingError,
)
from engine.run.build import create_model, trained_variables  # noqa: F401  (re-exported: tests read them from here)
from engine.run.inputs import gathers_in_step  # noqa: F401  (re-exported)
from engine.run.trainer import Recompiled, Trainer  # noqa: F401  (re-exported)
from engine.settings.errors import ConfigError
from engine.settings.fields import show
from engine.state import checkpoint as checkpoint_lib
from engine.state import workdir as workdir_lib
from engine.state.report import Report, write_json


def stops_each_step(strategy):
    """Whether the inner loop ends a round at the first step that all-reduced a set stop flag (on CPUs), or runs
    the round to its end and leaves the flag to the host between rounds (on GPUs and TPUs).

    At a step, a signal stops the run one step after it lands. But the loop's condition then depends on a value
    each step computes, which on an accelerator must come back to the host before the next step can be queued:
    the device idles between steps. On a GPU or TPU a signal therefore stops the run at the end of the round it
    lands in, at most --steps_per_loop steps later; a round's time (steps_per_loop times a step's) plus a
    checkpoint's save must fit in the scheduler's grace period (30 s by default on Kubernetes and for a GCE spot
    VM).
    """
    return xla.device_kind(strategy) == "CPU"


def train(config, strategy=None, on_eval=None):
    """Trains (resuming from the workdir's latest checkpoint) and evaluates as `config` says.

    Returns the summary, also written to workdir/summary.json. `on_eval(step, results)` is called after
    every evaluation; returning True stops training there (a tuner's pruning). A workdir holds one run
    (engine/workdir.py): one with other settings is refused, and so is a second process while one trains.
    """
    started = time.time()
    strategy = strategy or distribute.create_strategy(config)
    saved = workdir_lib.check_same_run(config)
    trainer = Trainer(config, strategy)
    chief = distribute.is_chief(strategy)
    with workdir_lib.Lock(config.workdir) if chief else contextlib.nullcontext():
        if chief:
            saved = workdir_lib.check_same_run(config)  # again, under the lock: a run may have written it since
        checkpoints = checkpoint_lib.Checkpoints(
            trainer, config.workdir, config.keep_checkpoints, chief, distribute.task_id(strategy)
        )
        # Before restoring: a resumed run's compiled step is read back. Not for a run with nothing left to train.
        if config.compile_cache and trainer.jit_compile and not _trained(config, checkpoints.directory):
            trainer.trace()
        restored = _restore(trainer, checkpoints)
        current = int(trainer.step.numpy())
        finished = _summary_at(config.workdir, current) if restored and current == config.train_steps else None
        if finished:
            print(f"already trained to step {current} ({restored}); nothing to do", flush=True)
            return finished
        if not restored and config.init_checkpoint:  # before anything is written: a refused one claims no workdir
            # The models trained: a frozen one (a distillation teacher) keeps the weights its task gave it.
            trained = {name: model for name, model in trainer.models.items() if model.trainable}
            checkpoint_lib.warm_start(trained, config.init_checkpoint)
            trainer.reset_ema()
        redo_eval = evaluates_on_resume(config, current)
        report = Report(config.workdir, chief, config.train_steps, resume_step=current, redo_eval=redo_eval)
        if chief:
            write_config(config, trainer.task)
        if restored:
            report.line(f"resumed from step {current} ({restored})")
            if saved and saved.train_steps != config.train_steps:
                report.line(_train_steps_change(saved, config))
        elif config.on_nan == "rollback":
            checkpoints.save()  # something to roll back to from the first step on
        return run(trainer, report, checkpoints, started, on_eval)


def _restore(trainer, checkpoints):
    """Restores the latest checkpoint (its path, or None) and refuses a resume that cannot go on, before anything
    is written: a refused resume leaves the workdir as it was."""
    config = trainer.config
    try:
        restored = checkpoints.restore_latest()
    except ConfigError as e:  # a workdir from before config.json, or one whose config.json was replaced
        raise ConfigError(f"--workdir={config.workdir}: {e}; give this run a new --workdir") from None
    current = int(trainer.step.numpy())
    trainer.check_pipelines()
    if current > config.train_steps:
        raise ConfigError(
            f"--train_steps={config.train_steps}: the run in {config.workdir} is already at step {current} "
            f"({restored}); train it further with a higher --train_steps, or start this run in a new --workdir"
        )
    return restored


def _trained(config, directory):
    """Whether the newest checkpoint says, by its name, that the run has nothing left to train: at --train_steps with
    its summary written (the run ends as already trained), or past them (refused). A damaged newest checkpoint
    says so too, though the run then trains from an older one: untraced, so its step compiles again (a cache miss)."""
    step = checkpoint_lib.latest_step(directory)
    return step is not None and (
        step > config.train_steps or (step == config.train_steps and _summary_at(config.workdir, step) is not None)
    )


def _summary_at(workdir, step):
    """summary.json when it reports `step` (a run that ended there), else None (killed before writing it)."""
    path = os.path.join(workdir, "summary.json")
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path) as f:
            summary = json.loads(f.read())
    except ValueError:  # damaged: the final evaluation runs again and rewrites it
        return None
    return summary if isinstance(summary, dict) and summary.get("step") == step else None


def _train_steps_change(saved, config):
    line = f"--train_steps={config.train_steps} (was {saved.train_steps}): training on to step {config.train_steps}"
    if config.lr_schedule == "cosine":
        line += f"; --lr_schedule=cosine now decays to 0 at step {config.train_steps}, not {saved.train_steps}"
    return line


def write_config(config, task):
    """workdir/config.json: every setting of the run. It says which run the workdir holds (a restart with other
    settings is refused) and rebuilds its model for --mode=eval, continuous_eval, export and ensemble. Beside
    them, what the labels mean (a classification task's class_names, null for others): no setting, read by
    people and by the programs that use the export."""
    names = list(task.class_names) if hasattr(task, "class_names") else None
    saved = {**dataclasses.asdict(config), "class_names": names}
    write_json(os.path.join(config.workdir, "config.json"), saved)


def run(trainer, report, checkpoints, started, on_eval=None):
    """The outer loop: rounds of steps, each followed by what is due; the final evaluation; the summary."""
    profile = actions.Profile(trainer.config.loop, trainer.config.workdir, distribute.is_chief(trainer.strategy))
    try:
        return _rounds(trainer, report, checkpoints, started, on_eval, profile)
    finally:
        profile.stop()  # a trace cut short by an error or a signal is still written


def _rounds(trainer, report, checkpoints, started, on_eval, profile):
    config = trainer.config
    report.line(_header(trainer))
    # The training iterator, held alone in a list: a finished one is deleted off the loop's thread (inputs.release).
    held, current, last = [trainer.train_iterator()], int(trainer.step.numpy()), None
    report.count_losses(last_round_start(config), current)
    timing, evaluate = actions.Timing(), actions.Evaluate(trainer, report, on_eval)
    input_bound = actions.InputBoundWarning(timing, report)
    nan_policy = actions.NanPolicy(trainer, checkpoints, report)
    preemption = actions.Preemption(trainer, checkpoints, report)
    # From here on a signal stops the loop at a step, saved; the training iterator is released when the loop ends
    # (a signal or an error included): the final evaluation and the exit do not wait for its deletion.
    with PREEMPTION.watch(trainer.stop), inputs.releasing(held):
        # A run stopped at an evaluation step saved it unevaluated: the resumed run evaluates it, once (Report
        # dropped any evaluation of it logged before).
        pruned = evaluates_on_resume(config, current) and evaluate(current)
        while current < config.train_steps and not pruned:
            done = _round(trainer, held[0], current, profile, report)
            if done is None:  # recompiled: from the data position again, as the failed step took a batch
                _renew(held, trainer)
                continue
            timing.add(done)
            input_bound(done)
            last = done.out
            if nan_policy(done):  # rolled back: on from the checkpoint's step, reading on from the round's batches
                current = int(trainer.step.numpy())
                _renew(held, trainer)
                continue
            current = done.end
            actions.warn_skipped(trainer, report, done)
            actions.log(trainer, report, done)
            profile.after_round(current, report)
            stopping = preemption.stopping(done)
            pruned = actions.evaluation_due(config.loop, current, stopping) and evaluate(current)
            if pruned:
                break
            if actions.checkpoint_due(config.loop, current, stopping):
                checkpoints.save()
            if stopping:
                preemption(current)
        checkpoints.save()  # nothing to do when this step is saved already
        if trainer.stopping_anywhere():  # a signal during the last round: every worker stops here alike
            preemption(current)
    # A tuner that stopped the run at an evaluation: its results are the run's, not evaluated again.
    results = evaluate.results if pruned else _final_evaluation(trainer, report, current)
    return _summary(trainer, report, current, results, timing, last, started)


def _renew(held, trainer):
    """Replaces the training iterator in `held` by one from the data position on, the old one released."""
    inputs.release([held.pop()])
    held.append(trainer.train_iterator())


def _round(trainer, iterator, current, profile, report):
    """The round of steps from `current` to the next boundary; None when it must run again (Recompiled)."""
    profile.before_round(current)
    tic = time.perf_counter()
    try:
        with profile.marker(current):
            out = trainer.run_steps(iterator, _next_boundary(trainer.config, current) - current)
    except Recompiled as e:
        report.line(str(e))
        return None
    return actions.Round(current, current + int(out["steps"]), time.perf_counter() - tic, out)


def _header(trainer):
    config, strategy = trainer.config, trainer.strategy
    params = sum(int(tf.size(v)) for v in trainer.params)
    return (
        f"task={config.task} model={config.model} parameters={params} dataset={config.dataset} "
        f"strategy={distribute.strategy_name(config)} replicas={strategy.num_replicas_in_sync} "
        f"precision={config.precision} global_batch_size={config.global_batch_size} "
        f"input={trainer.train_input.label} jit_compile={show(trainer.jit_compile)} ({trainer.jit_reason})"
    )


def _final_evaluation(trainer, report, step):
    results = trainer.evaluate()
    report.eval(step, results)
    report.pictures(step, trainer.pictures())
    return results


def _update_metrics(trainer, last):
    """Each update's numbers of the last round, for the summary; its loss scale only in float16, as in the log."""
    return {
        name: last[name] if trainer.float16 or not name.endswith("loss_scale") else None
        for name in trainer.step_metrics
    }


def _summary(trainer, report, current, results, timing, last, started):
    config = trainer.config
    examples_per_sec, input_wait = timing.summary(config.global_batch_size, trainer.waits_timed)
    summary = {
        "step": current,
        "train_loss": report.train_loss(),
        "eval": results,
        "examples_per_sec": examples_per_sec,
        # The share of the timed rounds' time the steps waited for their batches.
        "input_wait_fraction": input_wait,
        "input_bytes_read": int(trainer.bytes_read.numpy()) if trainer.data.sharded else None,
        # A run of several updates: each one's loss over the last round, and its last rates and gradient norm.
        **(_update_metrics(trainer, last) if len(trainer.plans) > 1 and last else {}),
        "skipped_steps": int(trainer.skipped.numpy()),
        "loss_scale": float(trainer.loss_scale.scale.numpy()) if trainer.float16 else None,
        "wall_seconds": time.time() - started,
        "strategy": distribute.strategy_name(config),
        "num_replicas": trainer.strategy.num_replicas_in_sync,
        "precision": config.precision,
        "global_batch_size": config.global_batch_size,
        "class_names": list(trainer.task.class_names) if hasattr(trainer.task, "class_names") else None,
    }
    report.summary(summary)
    return summary


def evaluates_on_resume(config, step):
    """Whether a run that starts training at `step` evaluates it first: an --eval_every step short of the end
    (the end's evaluation comes after the loop), which a run stopped there may have saved unevaluated."""
    return bool(config.eval_every) and 0 < step < config.train_steps and step % config.eval_every == 0


def last_round_start(config):
    """The step after which the last round of an uninterrupted run begins: the steps whose mean loss is the
    summary's train_loss. Rounds end at the boundaries of _next_boundary."""
    last = config.train_steps - 1
    starts = [0, *((last // every) * every for every in _periods(config))]
    return max([*starts, *(step for step in config.profile_steps if step <= last)])


def _periods(config):
    """The periods whose multiples end a round: the round's length, and every evaluation and checkpoint."""
    return [every for every in (config.steps_per_loop, config.eval_every, config.checkpoint_every) if every]


def _next_boundary(config, current):
    """Where the round that starts at `current` ends: a function of the absolute step only."""
    ends = [config.train_steps, *((current // every + 1) * every for every in _periods(config))]
    return min([*ends, *(step for step in config.profile_steps if step > current)])
