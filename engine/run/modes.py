"""Evaluation and export from checkpoints: --mode=eval, --mode=continuous_eval, --mode=export."""

import contextlib
import dataclasses
import json
import os
import time

import tensorflow as tf

from engine.cluster import distribute
from engine.run import build, serving
from engine.settings import config as config_lib
from engine.settings.errors import ConfigError
from engine.state import checkpoint as checkpoint_lib
from engine.state import workdir as workdir_lib
from engine.state.files import append_text, failed_file, json_text, make_workdir, remove_tree, write_json
from engine.state.lock import Lock
from engine.state.report import format_metrics


def run_config(config, mode, given=None):
    """The config that rebuilds the trained run for `mode` ("eval", "export", ...): its config.json (beside
    --checkpoint, else in --workdir), with this command line's execution settings, --eval_split and
    --eval_batch_size, and its --global_batch_size, --data_dir and --train_steps where given; a model flag that
    contradicts the run is refused (engine/settings/config.py for_evaluation; `given`: the settings the command line
    gave). Without a config.json, the command line as given. Its --mode is `mode` whatever `config` says: a Config
    handed to export() (a notebook's, left at --mode=train) builds what --mode=export builds (a distilled student
    without its teacher)."""
    config = config_lib.validate(dataclasses.replace(config, mode=mode))  # a notebook's Config too, as flags are
    runs = [_run_of(config.checkpoint)] if config.checkpoint else []
    for workdir in [*runs, config.workdir]:
        saved = config_lib.load_run_config(workdir) if workdir else None
        if saved is not None:
            workdir_lib.warn_of_unknown_settings(workdir)
            return config_lib.for_evaluation(config, saved, workdir, given)
    return config


def _run_of(checkpoint):
    """The workdir of the run a checkpoint prefix (<workdir>/checkpoints/ckpt-N) belongs to."""
    return os.path.dirname(os.path.dirname(checkpoint.rstrip("/")))


def _check_workdir_is_the_checkpoints(config):
    """Refuses --checkpoint of another run than the one --workdir holds: the results (eval_<split>.json, an export
    under --workdir) go into --workdir, where they would replace, or stand as, that run's own."""
    if not config.checkpoint:
        return
    _check_exists(config.checkpoint)
    # Not the checkout, another run's checkpoints/ or TensorBoard folders:
    workdir_lib.check_not_inside_a_run(config.workdir)
    theirs = _run_of(config.checkpoint)
    job, marker = workdir_lib.held_job(config.workdir)
    if os.path.abspath(theirs) == os.path.abspath(config.workdir) or job is None:
        return
    if job == "run":
        raise ConfigError(
            f"--checkpoint={config.checkpoint}: a checkpoint of {theirs}, not of --workdir={config.workdir}'s run, "
            f"whose results this would replace; use --workdir={theirs}"
        )
    # A study's or an ensemble's workdir: its results beside theirs would read as the job's own.
    raise ConfigError(
        f"--checkpoint={config.checkpoint}: --workdir={config.workdir} holds another job's results ({marker}), "
        f"which this would stand beside as their own; use --workdir={theirs}"
    )


def _evaluated(config, strategy, purpose="evaluate"):
    """The run `config` rebuilds for `purpose` (engine/run/build.py PURPOSES: no optimizers, no train program); for
    its weights alone, from what its config.json keeps of its source where it does (engine/state/kept_source.py)."""
    workdir = _run_of(config.checkpoint) if config.checkpoint else config.workdir
    if purpose == "weights":  # export, sample: on one device, in float32
        config = dataclasses.replace(config, strategy="one_device", num_cpu_devices=1, precision="float32")
    kept = workdir_lib.saved_source(workdir) if purpose == "weights" else None
    run = build.run(config, strategy or distribute.create_strategy(config.cluster), purpose, source=kept)
    workdir_lib.check_same_classes(workdir, run.task)
    return run


def _check_not_another_job(workdir):
    """Refuses a workdir that holds a tuning study or an ensemble, which have no checkpoints of their own (a study's
    trials are train runs in its trials/ folder)."""
    job, marker = workdir_lib.held_job(workdir)
    if job == "study":
        raise ConfigError(
            f"--workdir={workdir} holds a tuning study ({marker}), not a train run: its trials are the runs, in "
            f"{os.path.join(workdir, 'trials')}"
        )
    if job == "results":
        raise ConfigError(f"--workdir={workdir} holds another job's results ({marker}, an ensemble's), not a train run")


def _check_exists(checkpoint):
    """ConfigError unless --checkpoint names a checkpoint (its prefix, <workdir>/checkpoints/ckpt-N)."""
    if tf.io.gfile.exists(checkpoint + ".index"):
        return
    inside = checkpoint_lib.latest(checkpoint) if tf.io.gfile.isdir(checkpoint) else None
    hint = f"; a folder of checkpoints: name one, as --checkpoint={inside}" if inside else ""
    raise ConfigError(f"--checkpoint={checkpoint}: no such checkpoint (expected {checkpoint}.index){hint}")


def _checkpoint_paths(config):
    """--checkpoint, or the workdir's checkpoints newest first."""
    if config.checkpoint:
        _check_exists(config.checkpoint)
        return [config.checkpoint]
    _check_not_another_job(config.workdir)
    found = checkpoint_lib.list_checkpoints(os.path.join(config.workdir, "checkpoints"))
    if not found:
        raise ConfigError(f"--workdir={config.workdir}: no checkpoint to use (train first, or pass --checkpoint)")
    return found


def _restore(run, config, paths):
    """Restores the first readable of `paths` into `run`; a damaged one in the workdir is reported and the previous
    one used, as training does. One gone, or going, since they were listed was rotated away by a run still training (a
    newer one appeared): the workdir's checkpoints are listed again. Returns the path restored."""
    tried, damaged = set(), 0
    while path := next((p for p in paths if p not in tried), None):
        tried.add(path)
        try:
            _restore_from(run, path)
            return path
        except checkpoint_lib.Unreadable as e:
            if config.checkpoint:
                raise ConfigError(f"--checkpoint={path}: unreadable ({e})") from None
            listed = _checkpoint_paths(config)
            if path not in listed or listed[0] not in paths:  # rotated away (--keep_checkpoints), not damaged
                paths = listed
                continue
            damaged += 1
            print(f"warning: checkpoint {path} is unreadable ({e}); trying the previous one", flush=True)
    raise ConfigError(f"--workdir={config.workdir}: no readable checkpoint (all {damaged} are damaged)")


def _restore_from(run, path):
    """Restores `path` into `run` through a checkpoint object of its own: one whose restore failed part way (its files
    rotated away as they were read) keeps TensorFlow's deferred restorations of that checkpoint, and every later
    restore through it fails ("does not fit this run") or reads the files that failed."""
    checkpoint_lib.restore(run.state.evaluated(), path, partial=True)


def evaluate(config, strategy=None, given=None):
    """--mode=eval: evaluates one checkpoint (--checkpoint, or the latest readable in --workdir) of the run
    rebuilt from its config.json."""
    _check_workdir_is_the_checkpoints(config)
    config = run_config(config, "eval", given)
    paths = _checkpoint_paths(config)
    if config.checkpoint:  # of a run elsewhere: a new --workdir is made before the evaluation, not after it
        make_workdir(config.workdir)
    run = _evaluated(config, strategy)
    path = _restore(run, config, paths)
    step = int(run.state.step.numpy())
    results = run.evaluator.evaluate()
    print(f"eval step={step} split={config.eval_split} {format_metrics(results)} checkpoint={path}", flush=True)
    summary = {"step": step, "checkpoint": path, "split": config.eval_split, "eval": results}
    if run.placement.chief:
        write_json(os.path.join(config.workdir, f"eval_{config.eval_split}.json"), summary)
    return summary


def follow(config, strategy=None, poll_seconds=2.0, given=None):
    """--mode=continuous_eval: a sidecar that evaluates each new checkpoint of a running job.

    A sidecar started before its trainer waits for the run to appear (its config.json, which says what model to
    build, or a checkpoint of a workdir from before config.json). Writes continuous_eval.jsonl and TensorBoard
    events under workdir/continuous_eval/<split>, beside the job's own, from its first evaluation on; stops after
    evaluating step --train_steps, or after --eval_timeout seconds with nothing new. When nothing came in that
    time it writes nothing and stops with ConfigError saying so.
    """
    if config.checkpoint:  # its model would be that run's, its checkpoints --workdir's
        raise ConfigError(
            f"--checkpoint={config.checkpoint}: continuous_eval follows the checkpoints of --workdir; for one "
            "checkpoint, --mode=eval"
        )
    _check_not_another_job(config.workdir)
    directory = os.path.join(config.workdir, "checkpoints")
    print(f"continuous_eval: following {directory}", flush=True)
    _wait_for_run(config, directory, poll_seconds)
    config = run_config(config, "continuous_eval", given)
    # A restarted sidecar goes on from its records: each checkpoint is evaluated, and recorded, once.
    results = _followed(config.workdir, config.eval_split)
    if results and max(r["step"] for r in results) >= config.train_steps:
        print(f"continuous_eval: step {config.train_steps} was evaluated already (continuous_eval.jsonl)", flush=True)
        return results
    # One sidecar a split: a second would evaluate and record each checkpoint again beside the first's.
    doing = f"evaluating --eval_split={config.eval_split} (--mode=continuous_eval)"
    with Lock(config.workdir, doing=doing, name=f"continuous_eval_{config.eval_split}.lock"):
        return _follow(config, strategy, poll_seconds)


def _follow(config, strategy, poll_seconds):
    """follow's loop, under its sidecar lock: the records read again now that no other sidecar of this split runs."""
    results = _followed(config.workdir, config.eval_split)
    if results and max(r["step"] for r in results) >= config.train_steps:
        print(f"continuous_eval: step {config.train_steps} was evaluated already (continuous_eval.jsonl)", flush=True)
        return results
    directory = os.path.join(config.workdir, "checkpoints")
    run = _evaluated(config, strategy)
    # By name (ckpt-N): a restart may spell --workdir otherwise.
    writer, evaluated, waited_since = None, {os.path.basename(r["checkpoint"]) for r in results}, time.monotonic()
    unreadable = FailedReads(poll_seconds, config.eval_timeout)
    while time.monotonic() - waited_since < config.eval_timeout:
        latest = next((p for p in checkpoint_lib.list_checkpoints(directory) if not unreadable.passed_over(p)), None)
        if latest is None or os.path.basename(latest) in evaluated:
            stopped = results and workdir_lib.stopped_by(config.workdir, results[-1]["step"])
            if stopped:  # an action ended the run there: no checkpoint comes after it
                print(f"continuous_eval: {stopped} stopped the run at step {results[-1]['step']}; stopping", flush=True)
                break
            time.sleep(poll_seconds)
            continue
        try:
            _restore_from(run, latest)
        except checkpoint_lib.Unreadable as e:
            unreadable.failed(latest, e)  # still being written (tried again), or damaged (the previous one next)
            time.sleep(poll_seconds)
            continue
        except checkpoint_lib.CheckpointError:  # the storage did not answer: a sidecar waits it out
            print(f"continuous_eval: the storage did not answer a read of {latest}; trying again", flush=True)
            time.sleep(poll_seconds)
            continue
        evaluated.add(os.path.basename(latest))
        # A curve a split: sidecars of two splits write their steps beside each other's.
        writer = writer or tf.summary.create_file_writer(
            os.path.join(config.workdir, "continuous_eval", config.eval_split)
        )
        results.append(_recorded(run, config, latest, writer))
        if results[-1]["step"] >= config.train_steps:
            break
        waited_since = time.monotonic()
    else:
        _waited_in_vain(config, directory, results, unreadable.damaged)
    return results


def _waited_in_vain(config, directory, results, damaged):
    """What a sidecar says when --eval_timeout passed without a new checkpoint: ConfigError where it evaluated none."""
    if not results:
        said = f" ({len(damaged)} damaged: {', '.join(damaged)})" if damaged else ""
        raise ConfigError(
            f"--workdir={config.workdir}: no {'readable ' if damaged else ''}checkpoint appeared in {directory} "
            f"within --eval_timeout={config.eval_timeout:g} s{said}; nothing evaluated"
        )
    print(
        f"continuous_eval: no new checkpoint for {config.eval_timeout:g} s (--eval_timeout) after step "
        f"{results[-1]['step']} of {config.train_steps}; stopping",
        flush=True,
    )


def _recorded(run, config, checkpoint, writer):
    """The evaluation of the checkpoint restored into `run`, said, appended to continuous_eval.jsonl and written as
    TensorBoard scalars by `writer`."""
    step = int(run.state.step.numpy())
    result = {"step": step, "checkpoint": checkpoint, "split": config.eval_split, **run.evaluator.evaluate()}
    print(f"continuous_eval step={step} {format_metrics(evaluation_results(result))}", flush=True)
    append_text(os.path.join(config.workdir, "continuous_eval.jsonl"), json_text(result) + "\n")
    with writer.as_default(step=step):
        for name, value in evaluation_results(result).items():
            if name != "examples":
                tf.summary.scalar(name, value)
    writer.flush()
    return result


class FailedReads:
    """The checkpoints continuous_eval could not read: one is damaged once it failed twice with its index written
    (the index comes last), or for a minute without it (half --eval_timeout where that is shorter: the previous one
    is evaluated before the sidecar gives up); a damaged one is said once and passed over, but one passed over for
    want of its index is read again once the index is there (a slow save's, finished: a run's final step too)."""

    WITHOUT_INDEX_SECONDS = 60.0

    def __init__(self, poll_seconds, eval_timeout):
        self.poll_seconds, self.first_failed, self.damaged, self.unindexed = poll_seconds, {}, [], set()
        self.without_index = min(self.WITHOUT_INDEX_SECONDS, eval_timeout / 2)

    def failed(self, path, error):
        since = self.first_failed.setdefault(path, time.monotonic())
        indexed = tf.io.gfile.exists(path + ".index")
        if time.monotonic() - since < (self.poll_seconds / 2 if indexed else self.without_index):
            return
        self.damaged.append(path)
        if not indexed:
            self.unindexed.add(path)
        print(f"warning: checkpoint {path} is unreadable ({error}); evaluating the previous one", flush=True)

    def passed_over(self, path):
        """Whether the sidecar passes `path` over: damaged, unless it lacked its index, which is there now (it is then
        tried afresh: twice with its index before it counts as damaged again)."""
        if path in self.unindexed and tf.io.gfile.exists(path + ".index"):
            self.unindexed.discard(path)
            self.damaged.remove(path)
            self.first_failed.pop(path, None)
        return path in self.damaged


def _followed(workdir, split):
    """The evaluations of `split` an earlier continuous_eval of `workdir` recorded (continuous_eval.jsonl; a torn last
    line, a killed process's, left out; a record from before records named their split is no one's)."""
    path = os.path.join(workdir, "continuous_eval.jsonl")
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        lines = f.read().splitlines(keepends=True)
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [
        r for r in records if isinstance(r, dict) and {"step", "checkpoint"} <= r.keys() and r.get("split") == split
    ]


def _wait_for_run(config, directory, poll_seconds):
    """Waits up to --eval_timeout for the run of --workdir to exist: its config.json (or, in a workdir from
    before config.json, a checkpoint). Built earlier, the sidecar would evaluate the command line's model."""
    since = time.monotonic()
    while not (tf.io.gfile.exists(os.path.join(config.workdir, "config.json")) or checkpoint_lib.latest(directory)):
        if time.monotonic() - since >= config.eval_timeout:
            raise ConfigError(
                f"--workdir={config.workdir}: no run appeared there (no config.json, no checkpoint) within "
                f"--eval_timeout={config.eval_timeout:g} s; nothing evaluated"
            )
        time.sleep(poll_seconds)


def evaluation_results(result):
    """The evaluation's own numbers in a continuous_eval record (without step, checkpoint and split)."""
    return {k: v for k, v in result.items() if k not in ("step", "checkpoint", "split")}


def export(config, given=None):
    """--mode=export: writes a SavedModel whose serving signature is the task's (classification: images to
    logits, probabilities, classes and their class_names; the names also as the variable `class_names`), with
    the weights of --checkpoint (or the latest readable in --workdir). It computes in float32 whatever the
    training precision (the weights are float32 in every precision): a mixed_bfloat16 graph would need
    TensorFlow ops that TFLite lacks (ERROR_NEEDS_FLEX_OPS), and serving CPUs rarely have bfloat16 units."""
    if config.export_dir:  # where it is told, but not where a run's files are
        workdir_lib.check_not_in_run_folders(
            config.export_dir, "export_dir", os.path.join(config.workdir, "export", "STEP")
        )
    else:
        _check_workdir_is_the_checkpoints(config)
    config = run_config(config, "export", given)
    paths = _checkpoint_paths(config)
    run = _evaluated(config, None, "weights")
    path = _restore(run, config, paths)
    step = int(run.state.step.numpy())
    export_dir = config.export_dir or os.path.join(config.workdir, "export", str(step))
    where = workdir_lib.export_target(config, export_dir, step)
    module, signature = serving.module(run)
    names = run.task.class_names
    # Written beside it, then renamed into place: a killed export leaves no half SavedModel where a server looks
    # for versions, and the same command (exit 75: restart) removes what it left and exports again.
    partial = where + ".incomplete"
    with run.weights.averaged():  # --ema_decay: the moving averages are what the run evaluated
        try:
            remove_tree(partial)  # what a killed export left; a link there itself, never what it points to
            tf.saved_model.save(module, partial, signatures={"serving_default": module.serve})
            tf.io.gfile.rename(partial, where, overwrite=True)  # over an empty folder the check let through
        except (tf.errors.OpError, OSError) as e:
            with contextlib.suppress(tf.errors.OpError, OSError):
                remove_tree(partial)  # half a SavedModel, of no use: the same command writes it whole
            reason = failed_file(e)[1]  # TensorFlow's own text ("{{function_node ...}} ...; why [Op:SaveV2]") left out
            raise checkpoint_lib.CheckpointError(f"cannot write the SavedModel to {export_dir}: {reason}") from None
    inputs = ", ".join(f"{s.name} {s.dtype.name} {s.shape.as_list()}" for s in signature.structured_input_signature[0])
    outputs = ", ".join(sorted(signature.structured_outputs))
    plain = [name if name.isprintable() and name.strip() == name != "" else repr(name) for name in names or ()]
    shown = f"; classes {', '.join(plain[:5])}{', ...' if len(plain) > 5 else ''}" if names is not None else ""
    print(
        f"exported step {step} from {path} to {export_dir} (serving_default: {inputs} -> {outputs}{shown})", flush=True
    )
    return export_dir


def sample(config, given=None):
    """--mode=sample: text generated by the trained model of --workdir (or --checkpoint), continuing
    --sample_prompt, for tasks that generate (language_model)."""
    config = run_config(config, "sample", given)
    paths = _checkpoint_paths(config)
    run = _evaluated(config, None, "weights")
    if run.task.sample is None:
        raise ConfigError(f"--mode=sample: --task={config.task} generates nothing (a language_model run does)")
    path = _restore(run, config, paths)
    with run.weights.averaged():
        text = run.task.sample(run.models, config.plugin("task", config.task))
    print(text, flush=True)
    print(f"(sampled {config.sample_length} tokens from step {int(run.state.step.numpy())}, {path})", flush=True)
    return text
