"""The story of a run: the strategy, the run built in one place (engine/run/build.py), the workdir's lock, restore,
then the controller's rounds of steps and their actions (engine/run/controller.py), then the final evaluation and
the summary."""

import contextlib
import time

from engine.cluster import distribute
from engine.numerics import updates
from engine.run import build
from engine.run.actions.base import hand_back, hold
from engine.run.controller import Controller, evaluates_on_resume
from engine.settings.config import validate
from engine.settings.errors import ConfigError
from engine.state import checkpoint as checkpoint_lib
from engine.state import lock, warm_start
from engine.state import workdir as workdir_lib
from engine.state.report import Report


def train(config, strategy=None, on_eval=None):
    """Trains (resuming from the workdir's latest checkpoint) and evaluates as `config` says.

    Returns the summary, also written to workdir/summary.json. `on_eval(step, results)` is called after
    every evaluation; returning True stops training there (a tuner's pruning). A workdir holds one run
    (engine/state/workdir.py): one with other settings is refused, and so is a second process while one trains.
    `config` is checked as launch.py checks flags (a notebook's Config too): a bad setting is ConfigError naming it.
    """
    started = time.time()
    config = validate(config)
    strategy = strategy or distribute.create_strategy(config.cluster)
    workdir_lib.check_same_run(config)  # before the data loads, but for the order settings it may not read
    run = build.run(config, strategy, on_eval=on_eval)
    workdir_lib.check_same_run(config, run.data.unread)  # those the training split reads too, before the lock's file
    chief = run.placement.chief
    with lock.Lock(config.workdir) if chief else contextlib.nullcontext():
        saved = workdir_lib.check_same_run(config, run.data.unread)  # again: a run may have written it since
        checkpoints = checkpoint_lib.Checkpoints(
            run.state, config.workdir, config.keep_checkpoints, chief, run.placement.task, config.save_initial
        )
        # The actions' own state (Action.checkpointed), saved and restored with the run's.
        checkpoints.before_save = lambda: hold(run.actions, run.state.actions)
        checkpoints.after_restore = lambda: hand_back(run.actions, run.state.actions)
        # Before restoring: a resumed run's compiled step is read back. Not for a run with nothing left to train.
        if config.compile_cache and run.program.jit_compile and not _nothing_left(config, checkpoints.directory):
            trace(run)
        restored = _restore(run, checkpoints)
        distribute.check_same_step(run.placement, config.workdir, int(run.state.step.numpy()))
        if restored:  # its labels must mean what they meant
            workdir_lib.check_same_classes(config.workdir, run.task)
        current = int(run.state.step.numpy())
        finished = _ended_at(config, current) if restored else None
        if finished:
            print(f"{_ended(finished, current)} ({restored}); nothing to do", flush=True)
            return finished
        if restored and chief:  # its data position means what it meant only on the examples it counted in
            workdir_lib.warn_of_another_split(config, run.data, current)
        # Of this run's config.json, kept: one killed before its first save is this run too (check_same_run).
        unknown = workdir_lib.warn_of_unknown_settings(config.workdir) if saved and chief else None
        if not restored and config.init_checkpoint:  # before anything is written: a refused one claims no workdir
            # The models trained: a frozen one (a distillation teacher) keeps the weights its task gave it.
            trainable = {name: model for name, model in run.models.items() if model.trainable}
            warm_start.warm_start(trainable, config.init_checkpoint)
            run.weights.restart_averages()
        redo_eval = evaluates_on_resume(config.loop, current)
        resumed_at = current if restored else None  # a checkpoint of step 0 is resumed too
        report = Report(config.workdir, chief, config.train_steps, resume_step=resumed_at, redo_eval=redo_eval)
        if chief:
            workdir_lib.write_config(config, run.task, updates.effective_settings(run.plans), run.data, unknown)
        if restored:
            report.line(f"resumed from step {current} ({restored})")
            if saved and saved.train_steps != config.train_steps:
                report.line(_train_steps_change(saved, config, run.plans))
        elif config.on_nan == "rollback" or config.save_initial:
            checkpoints.save()  # step 0: something to roll back to from the first step on, or to hold a fork against
        return Controller(run, report, checkpoints, started).train()


def trace(run):
    """Traces the round's loop (with the replica step) and the evaluation's now, as a run's first functions.
    XLA's persistent cache (--compile_cache) keys a compiled function by its traced name, which counts the
    functions traced before it in the process: traced before a checkpoint is restored (and a resumed run
    evaluates), a resumed run's step and evaluation are named as the first run's, and read back."""
    if run.program.trace():
        run.evaluator.trace()


def _restore(run, checkpoints):
    """Restores the latest checkpoint (its path, or None) and refuses a resume that cannot go on, before anything
    is written: a refused resume leaves the workdir as it was."""
    config = run.config
    try:
        restored = checkpoints.restore_latest()
    except ConfigError as e:  # every checkpoint damaged, or one that does not fit this run
        raise ConfigError(f"--workdir={config.workdir}: {e}") from None
    current = int(run.state.step.numpy())
    run.program.check_pipelines()
    if current > config.train_steps:
        raise ConfigError(
            f"--train_steps={config.train_steps}: the run in {config.workdir} is already at step {current} "
            f"({restored}); train it further with a higher --train_steps, or start this run in a new --workdir"
        )
    return restored


def _nothing_left(config, directory):
    """Whether the newest checkpoint says, by its name, that the run has nothing left to train: where the run ended
    (its summary written), or past --train_steps (refused). A damaged newest checkpoint says so too, though the run
    then trains from an older one: untraced, so its step compiles again (a cache miss)."""
    step = checkpoint_lib.latest_step(directory)
    return step is not None and (step > config.train_steps or _ended_at(config, step) is not None)


def _ended_at(config, step):
    """The summary of a run that ended at `step`, where it has nothing left to train: at --train_steps, or where an
    action stopped it (an early stop, a tuner's pruning), which a rerun of its command does not train past. None
    where it goes on (a run killed before its summary, one given more --train_steps)."""
    summary = workdir_lib.summary_at(config.workdir, step)
    if summary is not None and (step == config.train_steps or summary.get("stopped_by")):
        return summary
    return None


def _ended(summary, step):
    """What the console says of a run that ended at `step` (its `summary`) before this process."""
    if summary.get("stopped_by"):
        return (
            f"an action ({summary['stopped_by']}) stopped the run at step {step}; a rerun does not train past that "
            "(to train on from there, remove its summary.json)"
        )
    return f"already trained to step {step}"


def _train_steps_change(saved, config, plans):
    """The line a changed --train_steps prints: where the run now ends, and each learning rate whose schedule now
    decays to 0 there instead (the run's, or an update's or group's own)."""
    line = f"--train_steps={config.train_steps} (was {saved.train_steps}): training on to step {config.train_steps}"
    decaying = updates.decaying_rates(plans, config.train_steps)
    if not decaying:
        return line
    if decaying == {"learning_rate": config.lr_schedule}:  # the run's one rate, on the flag's schedule
        rates = f"--lr_schedule={decaying['learning_rate']}"
    else:
        rates = ", ".join(f"{name} (lr_schedule={schedule})" for name, schedule in decaying.items())
    verb = "decays" if len(decaying) == 1 else "decay"
    return f"{line}; {rates} now {verb} to 0 at step {config.train_steps}, not {saved.train_steps}"
