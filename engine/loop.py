"""The story of a run: strategy, data, model and optimizer, restore, then rounds of steps.

Inner loop in graph: one tf.function runs a round of replica steps with `tf.range(n)`, `n` a
tensor, so it is traced once whatever the round's length. Outer loop in Python: logging,
evaluation, checkpoints and preemption between rounds. Round boundaries are multiples of
--steps_per_loop, --eval_every and --checkpoint_every, so a resumed run cuts its rounds exactly
where an uninterrupted one does (and at --profile_steps, so a trace covers exactly those steps).
"""

import collections
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
import time

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled: not in tf.config

from engine import checkpoint as checkpoint_lib
from engine import data as data_lib
from engine import distribute, optim, precision, step, xla
from engine import workdir as workdir_lib
from engine.config import ConfigError, check_batch, show
from engine.preemption import PREEMPTION
from engine.report import Report, write_json

MAX_ROLLBACKS = 3  # --on_nan=rollback gives up after this many rollbacks without a save in between
# A run warns once when its steps waited for input more than this share of the time, measured (as bench.run does)
# over a window of at least this many steps after the first round, which includes tracing.
INPUT_BOUND = 0.10
INPUT_WINDOW_STEPS = 50


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss in float32 or bfloat16; float16 steps skipped with the loss scale at
    its floor); the message says where."""


class Recompiled(Exception):
    """--jit_compile=auto chose XLA and the first step could not compile: the step was rebuilt without it, and the
    round runs again from the same data position (the message says why)."""


class Preempted(Exception):
    """A signal stopped the run after a checkpoint; `exit_code` tells a scheduler to restart it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def gathers_in_step(config, strategy, data, coordinator):
    """Whether each replica gathers its batch inside the step, from the training split held in memory, instead of
    reading it from a tf.data pipeline: one CPU replica per worker (one device, or multi-worker), a split held in
    memory without a per-example decode. The pipeline's hand-over costs the step more than the gather (the 256-wide
    MLP: 1.08x and 1.16x end to end, its input wait 12% before; bench/RESULTS.md). Not on accelerators, where the
    pipeline prefetches to the device and the split would have to be copied there first; not with parameter
    servers (each worker its own stream) or a tf.data service (its workers build the batches); not for several
    replicas in one process (mirrored), where the gathered steps drifted from one device 20x more than the
    pipeline's in the ResNet parity case, though every batch was identical."""
    return (
        data.gather is not None
        and coordinator is None
        and not config.tf_data_service
        and strategy.num_replicas_in_sync == distribute.num_workers(strategy)
        and xla.device_kind(strategy) == "CPU"
    )


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


def create_model(config, family, spec, outputs):
    """models/<family>.py's model for examples like `spec` (a tf.TensorSpec), with every variable built (call under
    strategy.scope()). Its layers are named afresh (dense, dense_1, ...), whatever was built before in this
    process: checkpoints key variables by these paths."""
    uids = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    try:
        try:
            model = importlib.import_module(f"models.{family}").create(config, tuple(spec.shape), outputs)
        except ValueError as e:  # a setting, or data, the family cannot build from: its message says which
            raise ConfigError(str(e) if str(e).startswith("--") else f"--model={family}: {e}") from None
        model(tf.zeros((1, *spec.shape), spec.dtype), training=False)  # variables exist before the first trace
    finally:
        global_state.set_global_attribute("object_name_uids", uids)
    return model


def _create(run_config, family, spec, outputs, config=None):
    """A task's `create`: the model of this run's settings, or of `config`, another run's (a distillation teacher)."""
    return create_model(config or run_config, family, spec, outputs)


def trained_variables(models, freeze):
    """The variables the step trains: every model's trainable ones whose <model name>/<path> (model/mlp/dense/kernel)
    --freeze does not match."""
    pattern = re.compile(freeze) if freeze else None
    return [
        v
        for name, model in models.items()
        for v in model.trainable_variables
        if not (pattern and pattern.search(f"{name}/{v.path}"))
    ]


class Trainer:
    """Everything a run holds: built once, eagerly, under the strategy's scope."""

    def __init__(self, config, strategy):
        self.config, self.strategy = config, strategy
        check_batch(config, strategy.num_replicas_in_sync)
        tf.config.run_functions_eagerly(config.run_eagerly)
        # Data first: tensorflow-datasets draws from Python's `random` while preparing a dataset, and Keras
        # seeds its initializers from that generator, so seeding after it keeps the weights the same.
        self.data = data_lib.load(config)
        self.task = self.data.task
        keras.utils.set_random_seed(config.seed)
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        precision.set_policy(config.precision)
        with strategy.scope():
            self.models = self.task.models(functools.partial(_create, config))
            self.params = trained_variables(self.models, config.freeze)
            if not self.params:
                raise ConfigError(f"--freeze={config.freeze}: matches every trainable variable; nothing to train")
            # Each trained variable as <model name>/<path>: two models of one family share their Keras paths, and
            # must not share optimizer slots or moving averages.
            owner = {id(v): name for name, model in self.models.items() for v in model.trainable_variables}
            self.param_names = [f"{owner[id(v)]}/{v.path}" for v in self.params]
            self.optimizer = optim.Optimizer(
                config, [v.value for v in self.params], self.param_names, self.task.optimizer_groups
            )
            # --ema_decay: the moving average of every trained variable, starting at its initial value.
            self.ema = [tf.Variable(v.value, trainable=False, name="ema") for v in self.params if config.ema_decay]
            # Created in every precision so a checkpoint fits any of them; only float16 uses it.
            self.loss_scale = precision.LossScale(config.initial_loss_scale, config.loss_scale_growth_interval)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")  # steps run, skipped too
            self.batches = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches")  # the data position
            self.skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped")
            # The input pipelines that read up to the data position: a streamed split's order depends on it.
            self.input_pipelines = tf.Variable(0, dtype=tf.int64, trainable=False, name="input_pipelines")
            self.stop = tf.Variable(False, trainable=False, name="stop")  # set on preemption
        self.float16 = config.precision == "mixed_float16"
        # Bytes of record files this process read (a streamed split): the read-amplification count.
        self.bytes_read = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_read")
        # Parameter servers: workers run scheduled rounds asynchronously; the chief coordinates and evaluates.
        self.coordinator = (
            tf.distribute.coordinator.ClusterCoordinator(strategy) if distribute.is_parameter_server(strategy) else None
        )
        self.stops_each_step = stops_each_step(strategy)
        self.in_step = gathers_in_step(config, strategy, self.data, self.coordinator)
        self.jit_compile, self.jit_reason = xla.resolve(config, strategy, self.models)
        self._build_train_step()
        self.eval_loop = tf.function(self._eval_loop)
        self.retraced = set()

    def _build_train_step(self):
        self.train_step = step.make_train_step(
            self.task,
            self.models,
            self.params,
            self.optimizer,
            self.loss_scale if self.float16 else None,
            self.config,
            self.strategy.num_replicas_in_sync,
            self.stop,
            self.step,
            ema=self.ema,
            asynchronous=self.coordinator is not None,
            jit_compile=self.jit_compile,
        )
        self.train_loop = tf.function(self._train_loop)

    @property
    def ema_by_path(self):
        """{model name: {variable path: moving average}}, keyed like the models in a checkpoint."""
        averages = collections.defaultdict(dict)
        for name, average in zip(self.param_names, self.ema):
            model, path = name.split("/", 1)
            averages[model][path] = average
        return dict(averages)

    def reset_ema(self):
        """Starts the moving averages at the current weights (after a warm start)."""
        for v, average in zip(self.params, self.ema):
            average.assign(v.value)

    @property
    def model(self):
        """The run's model (a task with several: the first)."""
        return next(iter(self.models.values()))

    @functools.cached_property
    def metric_names(self):
        """The task's metric names, in the order of the evaluation sums: found by tracing its metrics once."""
        spec = self.data.eval_fn(tf.distribute.InputContext()).element_spec
        traced = tf.function(lambda b: self.task.metrics(self.task.forward(self.models, b, False), b))
        return sorted(traced.get_concrete_function(spec).structured_outputs)

    @functools.cached_property
    def eval_step(self):
        return step.make_eval_step(self.task, self.models, self.metric_names)

    @property
    def waits_timed(self):
        """Whether the rounds time each step's wait for its batch: on CPUs only, as the per-step stop (on an
        accelerator the wait's end would wait for the batch to reach the device, a sync each step), and not under
        op determinism, which refuses tf.timestamp."""
        return self.stops_each_step and not tf_config.is_op_determinism_enabled()

    @property
    def pipelines(self):
        """Input pipelines reading the training stream: one per worker (a parameter server's read their own)."""
        return 1 if self.coordinator is not None else distribute.num_workers(self.strategy)

    def check_pipelines(self):
        """Refuses to resume a streamed split with another number of input pipelines than read it so far."""
        saved = int(self.input_pipelines.numpy())
        if self.data.sharded and saved and saved != self.pipelines:
            raise ConfigError(
                f"--dataset={self.config.dataset}: this run read its streamed training files with {saved} input "
                f"pipelines (workers) up to its data position, and now has {self.pipelines}: each pipeline reads its "
                f"own files, so the position means nothing to {self.pipelines}; resume it with {saved} workers, or "
                "train in a new --workdir"
            )

    def train_iterator(self):
        """An iterator over the training batches from the current data position on; None when the steps gather their
        own (`in_step`)."""
        start = int(self.batches.numpy())
        self.check_pipelines()
        self.input_pipelines.assign(self.pipelines)
        if self.in_step:
            return None
        # The byte count stays on this host: a tf.data service ships the pipeline's graph, without variables.
        counter = None if self.config.tf_data_service else self.bytes_read
        if (
            isinstance(self.strategy, tf.distribute.OneDeviceStrategy)
            and "CPU" in self.strategy.extended.worker_devices[0]
        ):
            # One CPU device: the dataset's own iterator. The distributed one adds a hop of about 1 ms of host
            # time per batch here, on the cores the step needs.
            return iter(self.data.train_fn(tf.distribute.InputContext(), start, counter=counter))
        if self.coordinator is None:
            return iter(
                self.strategy.distribute_datasets_from_function(
                    lambda ctx: self.data.train_fn(ctx, start, counter=counter)
                )
            )
        with self.strategy.scope():  # on a parameter server, shared by the workers
            streams = tf.Variable(0, dtype=tf.int64, trainable=False, name="streams")
            lock = tf.CriticalSection(name="streams")

        def per_worker():
            # Traced once, then run by each worker as it builds its dataset: the server's counter, incremented
            # under a lock, gives each worker (and a restarted one) its own stream 1, 2, ... With the tf.data
            # service all workers consume one shared job instead, which hands each batch to one of them.
            stream = 1 if self.config.tf_data_service else lock.execute(lambda: tf.identity(streams.assign_add(1)))
            return self.strategy.distribute_datasets_from_function(
                lambda ctx: self.data.train_fn(ctx, start // distribute.num_workers(self.strategy), stream)
            )

        return iter(self.coordinator.create_per_worker_dataset(per_worker))

    def stopping_anywhere(self):
        """Whether any worker has been signalled. A signal that came during a round's last step is not in that
        step's all-reduce: on several workers the flag is all-reduced once more, so all of them answer alike."""
        if self.coordinator is not None or not distribute.is_multi_worker(self.strategy):
            return bool(self.stop.numpy())
        return bool(self._any_stop())

    @tf.function
    def _any_stop(self):
        def replica_stop():
            return tf.distribute.get_replica_context().all_reduce(step.SUM, tf.cast(self.stop, tf.float32))

        return self._first_replica(self.strategy.run(replica_stop)) > 0

    def _first_replica(self, values):
        return tf.nest.map_structure(lambda v: self.strategy.experimental_local_results(v)[0], values)

    def _train_loop(self, iterator, steps, first_batch):
        # The loss summed in float64: the sums of two parts of a logging window (a run preempted inside it, then
        # resumed) then add up to the whole window's, exactly.
        loss_sum, finite_steps, done = tf.constant(0.0, tf.float64), tf.constant(0.0), tf.constant(0)
        floor_skipped = tf.constant(0.0)  # float16: steps skipped whose skip could not lower the loss scale
        waited = tf.constant(0.0, tf.float64)
        last = {"grad_norm": 0.0, "loss_scale": 0.0, "stop": False, **dict.fromkeys(self.optimizer.rate_names, 0.0)}
        timed = self.waits_timed
        for i in tf.range(steps):
            if iterator is None:  # in_step: train_iterator() gives none
                # The batch's index from the loop counter, not from the `batches` variable: nothing orders the gather
                # after the previous step, so it may run ahead of it.
                batch_index = first_batch + tf.cast(i, tf.int64)
                out = self._first_replica(self.strategy.run(self._gathered_step, args=(batch_index,)))
            else:
                out = self._iterated_step(iterator, timed)
                waited += out.pop("waited")
            loss_sum += tf.where(out["finite"], tf.cast(out["loss"], tf.float64), 0.0)
            finite_steps += tf.cast(out["finite"], tf.float32)
            if self.float16:  # the step's scale against the scale after it: a skip at the floor leaves it there
                floor_skipped += tf.cast(~out["finite"] & (self.loss_scale.scale == out["loss_scale"]), tf.float32)
            last = {k: out[k] for k in last}
            done += 1
            self.step.assign_add(1)
            self.batches.assign_add(1)
            if self.stops_each_step and out["stop"]:
                break
        skipped = tf.cast(done, tf.float32) - finite_steps
        # loss: the mean over the round's finite steps. stop: the all-reduced flag, the same on every worker.
        return {
            "loss": loss_sum / tf.cast(finite_steps, tf.float64),
            "loss_sum": loss_sum,
            "skipped": skipped,
            "floor_skipped": floor_skipped,
            "steps": done,
            "input_wait": waited,
            **last,
        }

    def _gathered_step(self, batch_index):
        # One replica per worker (gathers_in_step): the replica's id is its worker's input pipeline.
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
        return self.train_step(self.data.gather(batch_index, replica, self.pipelines))

    def _iterated_step(self, iterator, timed):
        # Seconds spent waiting for the next batch: the timestamps are ordered around it by hand (automatic
        # control dependencies leave a timestamp free to run anywhere).
        asked = tf.timestamp() if timed else tf.constant(0.0, tf.float64)
        waited = tf.constant(0.0, tf.float64)
        with tf.control_dependencies([asked] if timed else []):
            batch = next(iterator)
        if timed:
            with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
                waited = tf.timestamp() - asked
        out = self._first_replica(self.strategy.run(self.train_step, args=(batch,)))
        return {**out, "waited": waited}

    def _eval_loop(self, iterator, steps):
        totals = tf.zeros([len(self.metric_names) + 1])
        for _ in tf.range(steps):
            totals += self._first_replica(self.strategy.run(self.eval_step, args=(next(iterator),)))
        return totals

    def run_steps(self, iterator, steps):
        """Runs up to `steps` train steps in one call of the traced inner loop; returns host numbers. `iterator`: the
        batches, or None (train_iterator() when in_step): each step gathers its own from the data position on."""
        position = (int(self.step.numpy()), int(self.batches.numpy()))
        try:
            if self.coordinator is not None:
                return self._run_scheduled(iterator, steps)
            out = self.train_loop(iterator, tf.constant(steps), tf.constant(position[1], tf.int64))
            self._check_retrace("train_loop", self.train_loop)
        except RuntimeError as e:
            if "merge_call" in str(e) and self.jit_compile and self.config.jit_compile == "auto":
                # What auto cannot know before the first round is traced (nothing has run yet): trace it again.
                self.jit_compile, self.jit_reason = xla.resolve(self.config, self.strategy, self.models, True)
                self._build_train_step()
                print(f"jit_compile=false ({self.jit_reason}): the first round is traced again", flush=True)
                return self.run_steps(iterator, steps)
            if "merge_call" in str(e) and self.jit_compile:
                raise ConfigError(
                    f"--jit_compile=true: --model={self.config.model} or --task={self.config.task} synchronizes "
                    "replicas inside the forward pass or the loss (synchronized batch norm, gathered negatives), "
                    f"which XLA cannot compile with "
                    f"{self.strategy.num_replicas_in_sync} replicas here; drop --jit_compile or use one replica"
                ) from None
            raise
        except tf.errors.OpError as e:
            unsupported = re.search(
                r"unsupported operations when trying to compile.*?: ([\w, ]+) \(No registered", str(e)
            )
            if unsupported and self.jit_compile and self.config.jit_compile == "auto":
                # Found only when the first step runs, after its batch was taken: the caller reads it again.
                ops = unsupported.group(1)
                self.jit_compile, self.jit_reason = xla.resolve(
                    self.config, self.strategy, self.models, unsupported=ops
                )
                self._build_train_step()
                # The counters are not ordered after the failed step (they touch other variables): put them back.
                self.step.assign(position[0])
                self.batches.assign(position[1])
                raise Recompiled(f"jit_compile=false ({self.jit_reason}): the first round runs again") from None
            raise self._explain(e, training=True) from None
        return {k: float(v) for k, v in out.items()}

    def _explain(self, error, training):
        """An example the pipeline could not decode becomes DecodeError naming its file; a lost peer, PeerLost."""
        found = re.search(rf"{data_lib.UNDECODABLE}\] \[(\d+)\] \[of stream\] \[(\d+)", error.message or "")
        if found:
            position, stream = int(found.group(1)), int(found.group(2))
            return data_lib.DecodeError(
                f"{self.data.origin(position, stream, training, self.pipelines)}; fix or remove it and run the same "
                "command: the run resumes from its last checkpoint"
            )
        damaged = data_lib.unreadable(error)
        if damaged:
            return data_lib.DecodeError(
                f"--dataset={self.config.dataset}: {damaged}; restore the file and run the same command: the run "
                "resumes from its last checkpoint"
            )
        return distribute.explain_failure(self.strategy, self.config, error)

    def _run_scheduled(self, iterator, steps):
        """Parameter servers: the round's steps as functions of a few steps each, scheduled on whichever
        worker is free (the coordinator reschedules a dead worker's share); the chief waits for all."""
        chunk = max(1, steps // (4 * distribute.num_workers(self.strategy)))
        sizes = [chunk] * (steps // chunk) + ([steps % chunk] if steps % chunk else [])
        remote = [
            self.coordinator.schedule(self.train_loop, args=(iterator, tf.constant(n), tf.constant(0, tf.int64)))
            for n in sizes
        ]
        self.coordinator.join()
        outs = [{k: float(v) for k, v in r.fetch().items()} for r in remote]
        done = sum(o["steps"] for o in outs)
        finite = done - sum(o["skipped"] for o in outs)
        loss = sum(o["loss_sum"] for o in outs)
        stop = max(o["stop"] for o in outs)  # any function that saw the flag: they ran in no set order
        return {
            **outs[-1],
            "steps": done,
            "skipped": done - finite,
            "loss": loss / finite if finite else float("nan"),
            "loss_sum": loss,
            "floor_skipped": sum(o["floor_skipped"] for o in outs),
            "stop": stop,
            "input_wait": sum(o["input_wait"] for o in outs),
        }

    @functools.cached_property
    def eval_dataset(self):
        """Built at the first evaluation: a parameter-server chief never needs it."""
        return self.strategy.distribute_datasets_from_function(self.data.eval_fn)

    def _check_retrace(self, name, function):
        """Warns once, naming the function, when a round's function was traced again: a shape or structure that
        changes between rounds (a task's, a data source's) recompiles the step every time, silently slow."""
        if function.experimental_get_tracing_count() > 1 and name not in self.retraced:
            self.retraced.add(name)
            print(
                f"warning: {name} was traced {function.experimental_get_tracing_count()} times: its inputs changed "
                "shape or structure between calls (a task's batch or outputs?); every retrace recompiles the step",
                flush=True,
            )

    def evaluate(self):
        """The task's reported metrics over the evaluation split. With --ema_decay, of the averaged weights (what
        export serves), and beside them, as raw_<metric>, of the trained weights themselves."""
        if not self.ema:
            return self._evaluate()
        raw = self._evaluate()
        with self.averaged_weights():
            averaged = self._evaluate()
        examples = averaged.pop("examples")
        return {**averaged, **{f"raw_{k}": v for k, v in raw.items() if k != "examples"}, "examples": examples}

    def _evaluate(self):
        if self.coordinator is not None:  # on the chief, reading the variables from the parameter servers
            return self._results(self.eval_on_chief(self.data.eval_fn(tf.distribute.InputContext())))
        try:
            totals = self.eval_loop(iter(self.eval_dataset), tf.constant(self.data.eval_steps))
            self._check_retrace("eval_loop", self.eval_loop)
        except tf.errors.OpError as e:
            raise self._explain(e, training=False) from None
        return self._results(totals)

    @contextlib.contextmanager
    def averaged_weights(self):
        """With --ema_decay: the trained variables hold their moving averages inside the block."""
        if not self.ema:
            yield
            return
        saved = [tf.identity(v.value) for v in self.params]
        for v, average in zip(self.params, self.ema):
            v.assign(average)
        try:
            yield
        finally:
            for v, value in zip(self.params, saved):
                v.assign(value)

    @tf.function
    def eval_on_chief(self, dataset):
        totals = tf.zeros([len(self.metric_names) + 1])
        for batch in dataset:
            totals += self.eval_step(batch)
        return totals

    def _results(self, totals):
        *sums, examples = totals.numpy()
        results = self.task.report({name: float(total / examples) for name, total in zip(self.metric_names, sums)})
        results.update(self.task.probe(self.models, self.examples))
        return {**results, "examples": int(examples)}

    def examples(self, split):
        """The prepared batches of `split`, each example once (weight 0 marks padding), on this host."""
        return data_lib.load(self.config, split).eval_fn(tf.distribute.InputContext())


def _evaluate(trainer, report, step, on_eval):
    """Evaluates at `step`; True when `on_eval` stops the run there (a tuner's pruning)."""
    results = trainer.evaluate()
    report.eval(step, results)
    return bool(on_eval and on_eval(step, results))


def evaluates_on_resume(config, step):
    """Whether a run that starts training at `step` evaluates it first: an --eval_every step short of the end
    (the end's evaluation comes after the loop), which a run stopped there may have saved unevaluated."""
    return bool(config.eval_every) and 0 < step < config.train_steps and step % config.eval_every == 0


def _divergence(trainer, out, start, current):
    """What went wrong in the round of steps start+1..current, as the error or rollback line says it; None when it
    trained. In float32 and bfloat16: any non-finite step. In float16 a skipped step is how the loss scale finds a
    scale that fits, except one skipped with the scale at its floor (a skip that could not lower it): no scale
    fits, and the run can make no more progress."""
    steps = current - start
    if not trainer.float16:
        if not out["skipped"]:
            return None
        return (
            f"non-finite loss or gradient between steps {start + 1} and {current} "
            f"({int(out['skipped'])} of {steps} steps, {trainer.config.precision})"
        )
    if not out["floor_skipped"]:
        return None
    return (
        f"{int(out['floor_skipped'])} of the {steps} steps {start + 1}-{current} had non-finite gradients with the "
        f"loss scale at its floor ({float(trainer.loss_scale.scale.numpy()):g}), which no loss scale can fix "
        "(mixed_float16)"
    )


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


class Profile:
    """--profile_steps=A,B: the chief traces steps A+1..B into workdir/profile for TensorBoard's Profile tab."""

    def __init__(self, config, chief):
        self.steps = config.profile_steps if chief else ()
        self.logdir = os.path.join(config.workdir, "profile")
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
        try:
            restored = checkpoints.restore_latest()
        except ConfigError as e:  # a workdir from before config.json, or one whose config.json was replaced
            raise ConfigError(f"--workdir={config.workdir}: {e}; give this run a new --workdir") from None
        current = int(trainer.step.numpy())
        trainer.check_pipelines()  # before anything is written: a refused resume leaves the workdir as it was
        if current > config.train_steps:
            raise ConfigError(
                f"--train_steps={config.train_steps}: the run in {config.workdir} is already at step {current} "
                f"({restored}); train it further with a higher --train_steps, or start this run in a new --workdir"
            )
        finished = _summary_at(config.workdir, current) if restored and current == config.train_steps else None
        if finished:
            print(f"already trained to step {current} ({restored}); nothing to do", flush=True)
            return finished
        if not restored and config.init_checkpoint:  # before anything is written: a refused one claims no workdir
            # The models trained: a frozen one (a distillation teacher) keeps the weights its task gave it.
            trained = {name: model for name, model in trainer.models.items() if model.trainable}
            checkpoint_lib.warm_start(trained, config.init_checkpoint)
            trainer.reset_ema()
        report = Report(
            config.workdir,
            chief,
            config.train_steps,
            resume_step=current,
            redo_eval=evaluates_on_resume(config, current),
        )
        if chief:
            write_config(config)
        if restored:
            report.line(f"resumed from step {current} ({restored})")
            if saved and saved.train_steps != config.train_steps:
                report.line(_train_steps_change(saved, config))
        elif config.on_nan == "rollback":
            checkpoints.save()  # something to roll back to from the first step on
        return run(trainer, report, checkpoints, started, on_eval)


def _preempted(checkpoints, current, report):
    message = (
        f"{PREEMPTION.cause} at step {current}; checkpoint {checkpoints.saved_path}; run the same command to resume"
    )
    report.line(message)
    raise Preempted(message, PREEMPTION.exit_code)


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


def write_config(config):
    """workdir/config.json: every setting of the run. It says which run the workdir holds (a restart with other
    settings is refused) and rebuilds its model for --mode=eval, continuous_eval, export and ensemble."""
    write_json(os.path.join(config.workdir, "config.json"), dataclasses.asdict(config))


def run(trainer, report, checkpoints, started, on_eval=None):
    """The outer loop: rounds of steps; logging, evaluation, checkpoints between them; the summary."""
    profile = Profile(trainer.config, distribute.is_chief(trainer.strategy))
    try:
        return _rounds(trainer, report, checkpoints, started, on_eval, profile)
    finally:
        profile.stop()  # a trace cut short by an error or a signal is still written


def _rounds(trainer, report, checkpoints, started, on_eval, profile):
    config, strategy = trainer.config, trainer.strategy
    params = sum(int(tf.size(v)) for v in trainer.params)
    report.line(
        f"task={config.task} model={config.model} parameters={params} dataset={config.dataset} "
        f"strategy={distribute.strategy_name(config)} replicas={strategy.num_replicas_in_sync} "
        f"precision={config.precision} global_batch_size={config.global_batch_size} "
        f"input={'in-step' if trainer.in_step else 'tf.data'} "
        f"jit_compile={show(trainer.jit_compile)} ({trainer.jit_reason})"
    )
    iterator = trainer.train_iterator()
    current, rollbacks = int(trainer.step.numpy()), 0
    report.count_losses(last_round_start(config), current)
    timed_steps, timed_seconds, first_round = 0, 0.0, None
    waited, warned = 0.0, False
    with PREEMPTION.watch(trainer.stop):  # from here on a signal stops the loop at a step, saved
        # A run stopped at an evaluation step saved it unevaluated (a preemption's grace period has no time for an
        # evaluation): the resumed run evaluates it, once (Report dropped any evaluation of it logged before).
        pruned = evaluates_on_resume(config, current) and _evaluate(trainer, report, current, on_eval)
        while current < config.train_steps and not pruned:
            start = current
            profile.before_round(current)
            tic = time.perf_counter()
            try:
                with profile.marker(current):
                    out = trainer.run_steps(iterator, _next_boundary(config, current) - current)
            except Recompiled as e:
                report.line(str(e))
                iterator = trainer.train_iterator()  # from the data position: the failed step took a batch
                continue
            seconds = time.perf_counter() - tic
            steps = int(out["steps"])
            current += steps
            if first_round is None:
                first_round = (steps, seconds)  # includes tracing and compilation: kept out of the throughput
            else:
                timed_steps, timed_seconds = timed_steps + steps, timed_seconds + seconds
                waited += out["input_wait"]
                if not warned and timed_steps >= INPUT_WINDOW_STEPS and waited > INPUT_BOUND * timed_seconds:
                    warned = True
                    report.line(
                        f"warning: input-bound: the steps waited for input {waited / timed_seconds:.0%} of the time "
                        f"over steps {first_round[0] + 1}-{current}; the input pipeline does not keep up (more "
                        "workers, --tf_data_service, a smaller --image_size or data held in memory would)"
                    )

            diverged = _divergence(trainer, out, start, current)
            if diverged:
                last_good = checkpoints.saved_path
                if config.on_nan != "rollback" or rollbacks >= MAX_ROLLBACKS or not last_good:
                    gave_up = (
                        f" (--on_nan=rollback: {rollbacks} rollbacks without a save between them)"
                        if config.on_nan == "rollback" and last_good
                        else ""
                    )
                    raise TrainingError(
                        f"{diverged}{gave_up}; last good checkpoint: {last_good or 'none'}; lower --learning_rate "
                        "or set --clip_norm"
                    )
                reached, position = current, int(trainer.batches.numpy())
                checkpoint_lib.restore(checkpoints.checkpoint, last_good)
                trainer.batches.assign(position)  # read on from here: the discarded steps' batches are not redone
                current, rollbacks = int(trainer.step.numpy()), rollbacks + 1
                report.rewind(current)
                discarded = reached - current
                report.line(
                    f"{diverged}: rolled back to step {current} ({last_good}), discarding the {discarded} steps "
                    f"{current + 1}-{reached} since that checkpoint; the {discarded} batches they read are not "
                    "trained on (--on_nan=rollback)"
                )
                iterator = trainer.train_iterator()
                continue
            if trainer.float16 and 2 * out["skipped"] > steps:
                report.line(
                    f"warning: mixed_float16: {int(out['skipped'])} of the {steps} steps {start + 1}-{current} were "
                    "skipped (non-finite gradients: nothing trained); the loss scale halves at each skipped step and "
                    f"is now {float(trainer.loss_scale.scale.numpy()):g} "
                    f"(--initial_loss_scale={config.initial_loss_scale:g})"
                )

            trainer.skipped.assign_add(int(out["skipped"]))
            report.train(
                current,
                {
                    "loss": out["loss"],
                    # The rates the optimizer's groups used: `learning_rate` where a variable trains with the
                    # run's settings, `learning_rate/<regex>` for each group.
                    **{name: out[name] for name in trainer.optimizer.rate_names},
                    "grad_norm": out["grad_norm"],
                    "loss_scale": out["loss_scale"] if trainer.float16 else None,
                    "examples_per_sec": steps * config.global_batch_size / seconds,
                    "skipped_steps": out["skipped"],
                },
            )
            profile.after_round(current, report)
            # All-reduced: every worker stops here, whichever one was signalled. A round that does not stop at a
            # step also reads the flag as it is now: a signal after its last step stops the run here, not a round on.
            stopping = bool(out["stop"]) or (not trainer.stops_each_step and trainer.stopping_anywhere())
            if config.eval_every and current % config.eval_every == 0 and current < config.train_steps and not stopping:
                if _evaluate(trainer, report, current, on_eval):
                    break
            if (
                stopping
                or current == config.train_steps
                or (config.checkpoint_every and current % config.checkpoint_every == 0)
            ):
                checkpoints.save()
                rollbacks = 0
            if stopping:
                _preempted(checkpoints, current, report)

        checkpoints.save()  # nothing to do when this step is saved already
        if trainer.stopping_anywhere():  # a signal during the last round: every worker stops here alike
            _preempted(checkpoints, current, report)
    results = trainer.evaluate()
    report.eval(current, results)
    if not timed_steps and first_round:
        timed_steps, timed_seconds = first_round
    summary = {
        "step": current,
        "train_loss": report.train_loss(),
        "eval": results,
        "examples_per_sec": timed_steps * config.global_batch_size / timed_seconds if timed_steps else None,
        # The share of the timed rounds' time the steps waited for their batches.
        "input_wait_fraction": waited / timed_seconds if timed_seconds and trainer.waits_timed else None,
        "input_bytes_read": int(trainer.bytes_read.numpy()) if trainer.data.sharded else None,
        "skipped_steps": int(trainer.skipped.numpy()),
        "loss_scale": float(trainer.loss_scale.scale.numpy()) if trainer.float16 else None,
        "wall_seconds": time.time() - started,
        "strategy": distribute.strategy_name(config),
        "num_replicas": strategy.num_replicas_in_sync,
        "precision": config.precision,
        "global_batch_size": config.global_batch_size,
    }
    report.summary(summary)
    return summary
