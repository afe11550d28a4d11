"""What a run holds, built once, in order, under the strategy's scope (Trainer.__init__: the source and its task,
the task's data, the models, their updates, the state a checkpoint holds, the step); the traced inner loop that
runs a round of steps with `tf.range(n)`, `n` a tensor, so it is traced once whatever the round's length; and
evaluation. The steps read their batches by one of the paths of engine/inputs.py."""

import contextlib
import functools
import re

import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled: not in tf.config

from engine.cluster import distribute
from engine.data import datasets as data_lib
from engine.data.pipeline import UNDECODABLE
from engine.data.records import unreadable
from engine.numerics import replica as step
from engine.numerics import updates
from engine.run import build, inputs, xla
from engine.settings.checks import check_batch
from engine.settings.errors import ConfigError


class Recompiled(Exception):
    """--jit_compile=auto chose XLA and the first step could not compile: the step was rebuilt without it, and the
    round runs again from the same data position (the message says why)."""


class Trainer:
    """Everything a run holds: built once, eagerly, under the strategy's scope, in the order __init__ reads."""

    def __init__(self, config, strategy):
        self.config, self.strategy = config, strategy
        check_batch(config, strategy.num_replicas_in_sync)
        tf.config.run_functions_eagerly(config.run_eagerly)
        # The source, then the task built from what it gives (its spec and info), then the task's data.
        source, self.task = build.source_and_task(config)
        self.data = data_lib.prepare(config, source, self.task)
        # Seeded after the data: tensorflow-datasets draws from Python's `random` while preparing a dataset, and
        # Keras seeds its initializers from that generator, so seeding after it keeps the weights the same.
        build.seed(config)
        with strategy.scope():  # the models, what they train, their updates, the state a checkpoint holds
            self.models = self.task.models(build.Create(config, source.info))
            self.params, self.param_names = build.trained(self.models, config.freeze)
            self.ema = build.averages(self.params, config.ema_decay)
            # The task's updates, each with its optimizer and loss scale (engine/updates.py).
            self.plans = updates.build_plans(self.task, self.params, self.param_names, self.ema, config)
            self.state = build.state(self.models, self.plans, self.param_names, self.ema)
            self.stop = tf.Variable(False, trainable=False, name="stop")  # set on preemption
        # The same variables as the State's, named for the step and the loop: never rebind one.
        self.step, self.batches = self.state.step, self.state.batches
        self.skipped, self.input_pipelines = self.state.skipped, self.state.input_pipelines
        # Then what the step and the loop read: precision, counters of this process, cluster, input path, XLA.
        self.float16 = config.precision == "mixed_float16"
        # Bytes of record files this process read (a streamed split): the read-amplification count.
        self.bytes_read = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_read")
        # Parameter servers: workers run scheduled rounds asynchronously; the chief coordinates and evaluates.
        self.coordinator = (
            tf.distribute.coordinator.ClusterCoordinator(strategy) if distribute.is_parameter_server(strategy) else None
        )
        from engine.run import loop  # the loop's rule for where a signal ends a round, read where it is defined

        self.stops_each_step = loop.stops_each_step(strategy)
        self.in_step = inputs.gathers_in_step(config.cluster, strategy, self.data, self.coordinator)
        self.jit_compile, self.jit_reason = xla.resolve(config.numerics, strategy, self.models)
        self._build_train_step()
        self._reset_eval()  # eval_jit: whether the evaluation sums compile with XLA, decided when first built
        self.eval_ran = False  # an evaluation has run to its end (a later failure is not XLA's compile)
        self.retraced = set()

    def _build_train_step(self):
        self.train_step = step.make_train_step(
            self.task,
            self.models,
            self.plans,
            self.config,
            self.strategy.num_replicas_in_sync,
            self.stop,
            self.step,
            self.float16,
            asynchronous=self.coordinator is not None,
            jit_compile=self.jit_compile,
        )
        self.train_loop = tf.function(self._train_loop)

    @property
    def optimizer(self):
        """The first update's optimizer (a run of one update: its only one)."""
        return self.plans[0].optimizer

    @property
    def loss_scale(self):
        """The first update's loss scale (float16)."""
        return self.plans[0].loss_scale

    @property
    def step_metrics(self):
        """What each logged line carries from the step beside the loss: every update's rates, gradient norm and
        loss scale (and loss, in a run of several)."""
        return [name for plan in self.plans for name in plan.metric_names if not name.endswith("finite")]

    def reset_ema(self):
        """Starts the moving averages at the current weights (after a warm start)."""
        for v, average in zip(self.params, self.ema):
            average.assign(v.value)

    @property
    def model(self):
        """The run's model (a task with several: the first)."""
        return next(iter(self.models.values()))

    @functools.cached_property
    def eval_sums(self):
        """One replica's evaluation sums (engine/step.py make_eval_sums), compiled with XLA where the train step is
        when first built (`eval_jit` records it), and without after XLA could not compile them (_evaluate): a
        metric that synchronizes replicas, an op without an XLA kernel."""
        if self.eval_jit is None:  # not on a parameter server's chief: XLA reads no remote variable
            self.eval_jit = bool(self.jit_compile) and self.coordinator is None
        return step.make_eval_sums(self.task, self.models, self.eval_jit)

    @functools.cached_property
    def metric_names(self):
        """The task's metric names, in the order of the evaluation sums: found by tracing them for a replica's
        batch (compiled with XLA on one device per process, the trace the evaluation then calls)."""
        replicas = self.strategy.num_replicas_in_sync
        spec = self.data.eval_fn(tf.distribute.InputContext(num_replicas_in_sync=replicas)).element_spec
        sums = self.eval_sums  # built first: it decides eval_jit
        traced = sums if self.eval_jit else tf.function(sums)
        return sorted(traced.get_concrete_function(spec).structured_outputs[0])

    @functools.cached_property
    def eval_step(self):
        return step.make_eval_step(self.eval_sums, self.metric_names)

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
        return self.train_input.open(start)

    @property
    def train_input(self):
        """The path the steps read their batches by (engine/inputs.py), from `in_step` and the strategy as they are."""
        return inputs.train_input(self)

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

        return self.first_replica(self.strategy.run(replica_stop)) > 0

    @tf.autograph.experimental.do_not_convert
    def first_replica(self, values):
        return tf.nest.map_structure(lambda v: self.strategy.experimental_local_results(v)[0], values)

    def _train_loop(self, iterator, steps, first_batch):
        # The loss summed in float64: the sums of two parts of a logging window (a run preempted inside it, then
        # resumed) then add up to the whole window's, exactly.
        summed = [plan.prefix + "loss" for plan in self.plans if plan.prefix]  # each update's, in a run of several
        sums = {name: tf.constant(0.0, tf.float64) for name in ["loss", *summed]}
        finite_steps, done = tf.constant(0.0), tf.constant(0)
        floor_skipped = tf.constant(0.0)  # float16: steps skipped whose skip could not lower the loss scale
        waited = tf.constant(0.0, tf.float64)
        last = {"stop": False, **{name: 0.0 for name in self.step_metrics if name not in summed}}
        timed, feed = self.waits_timed, self.train_input
        for i in tf.range(steps):
            out = feed.step(iterator, first_batch, i, timed)
            waited += out.pop("waited")
            sums = {k: v + tf.where(out["finite"], tf.cast(out[k], tf.float64), 0.0) for k, v in sums.items()}
            finite_steps += tf.cast(out["finite"], tf.float32)
            if self.float16:  # each update's scale against its scale after the step: a skip at the floor leaves it
                at_floor = [
                    ~out[p.prefix + "finite"] & (p.loss_scale.scale == out[p.prefix + "loss_scale"]) for p in self.plans
                ]
                floor_skipped += tf.cast(tf.reduce_any(at_floor), tf.float32)
            last = {k: out[k] for k in last}
            done += 1
            self.step.assign_add(1)
            self.batches.assign_add(1)
            if self.stops_each_step and out["stop"]:
                break
        skipped = tf.cast(done, tf.float32) - finite_steps
        # loss: the mean over the round's finite steps. stop: the all-reduced flag, the same on every worker.
        means = {k: v / tf.cast(finite_steps, tf.float64) for k, v in sums.items()}
        return {
            **means,
            **{f"{k}_sum": v for k, v in sums.items()},
            "skipped": skipped,
            "floor_skipped": floor_skipped,
            "steps": done,
            "input_wait": waited,
            **last,
        }

    def _eval_loop(self, iterator, steps):
        totals = tf.zeros([len(self.metric_names) + 1])
        for _ in tf.range(steps):
            totals += self.first_replica(self.strategy.run(self.eval_step, args=(next(iterator),)))
        return totals

    def trace(self):
        """Traces the round's loop (with the replica step) and the evaluation's now, as a run's first functions.
        XLA's persistent cache (--compile_cache) keys a compiled function by its traced name, which counts the
        functions traced before it in the process: traced before a checkpoint is restored (and a resumed run
        evaluates), a resumed run's step and evaluation are named as the first run's, and read back."""
        # Not a parameter server's rounds (scheduled functions), nor a tf.data service's (opening an iterator there
        # registers a job with the dispatcher).
        if self.coordinator is not None or self.config.tf_data_service:
            return
        spec = (tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int64))  # as run() passes the steps and position
        try:
            with inputs.releasing([self.train_input.open(0)]) as held:  # its spec: the data position is not read yet
                self.train_loop.get_concrete_function(held[0], *spec)
        except RuntimeError as e:
            self._untraceable(e)
            return self.trace()
        try:
            with inputs.releasing([inputs.eval_iterator(self)]) as held:
                self.eval_loop.get_concrete_function(held[0], tf.TensorSpec([], tf.int32))
        except RuntimeError as e:  # metrics XLA cannot compile: the evaluation is rebuilt without it (no entry)
            if not self._eval_without_xla(e):
                raise

    def run_steps(self, iterator, steps):
        """Runs up to `steps` train steps in one call of the traced inner loop; returns host numbers. `iterator`: the
        batches, or None (train_iterator() when in_step): each step gathers its own from the data position on."""
        position = (int(self.step.numpy()), int(self.batches.numpy()))
        try:
            out = self.train_input.run(iterator, steps, position[1])
        except RuntimeError as e:
            self._untraceable(e)
            return self.run_steps(iterator, steps)
        except tf.errors.OpError as e:
            ops = _unsupported_ops(e)
            if ops and self.jit_compile and self.config.jit_compile == "auto":
                # Found only when the first step runs, after its batch was taken: the caller reads it again.
                self.jit_compile, self.jit_reason = xla.resolve(
                    self.config.numerics, self.strategy, self.models, unsupported=ops
                )
                self._build_train_step()
                if not self.eval_ran:  # traced beforehand (trace()): the evaluation follows the step's choice
                    self._reset_eval()
                # The counters are not ordered after the failed step (they touch other variables): put them back.
                self.step.assign(position[0])
                self.batches.assign(position[1])
                raise Recompiled(f"jit_compile=false ({self.jit_reason}): the first round runs again") from None
            raise self._explain(e, training=True) from None
        return {k: float(v) for k, v in out.items()}

    def _untraceable(self, error):
        """A RuntimeError tracing the round: a replica step that synchronizes replicas (merge_call), which XLA cannot
        compile, is rebuilt without XLA where auto chose it (what auto cannot know before the step is traced),
        refused where --jit_compile=true asked for it; any other is raised."""
        if "merge_call" in str(error) and self.jit_compile and self.config.jit_compile == "auto":
            self.jit_compile, self.jit_reason = xla.resolve(self.config.numerics, self.strategy, self.models, True)
            self._build_train_step()
            print(f"jit_compile=false ({self.jit_reason}): the step is traced again without XLA", flush=True)
            return
        if "merge_call" in str(error) and self.jit_compile:
            raise ConfigError(
                f"--jit_compile=true: --model={self.config.model} or --task={self.config.task} synchronizes "
                "replicas inside the forward pass or the loss (synchronized batch norm, gathered negatives), "
                f"which XLA cannot compile with "
                f"{self.strategy.num_replicas_in_sync} replicas here; drop --jit_compile or use one replica"
            ) from None
        raise error

    def _explain(self, error, training):
        """An example the pipeline could not decode becomes DecodeError naming its file; a lost peer, PeerLost."""
        found = re.search(rf"{UNDECODABLE}\] \[(\d+)\] \[of stream\] \[(\d+)", error.message or "")
        if found:
            position, stream = int(found.group(1)), int(found.group(2))
            return data_lib.DecodeError(
                f"{self.data.origin(position, stream, training, self.pipelines)}; fix or remove it and run the same "
                "command: the run resumes from its last checkpoint"
            )
        damaged = unreadable(error)
        if damaged:
            return data_lib.DecodeError(
                f"--dataset={self.config.dataset}: {damaged}; restore the file and run the same command: the run "
                "resumes from its last checkpoint"
            )
        return distribute.explain_failure(self.strategy, self.config, error)

    @functools.cached_property
    def eval_dataset(self):
        """Built at the first evaluation: a parameter-server chief never needs it."""
        return self.strategy.distribute_datasets_from_function(self.data.eval_fn)

    def check_retrace(self, name, function):
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

    def pictures(self):
        """The task's pictures (Task.pictures), drawn with the weights evaluation reads (the averages, --ema_decay)."""
        with self.averaged_weights():
            return self.task.pictures(self.models)

    def _evaluate(self):
        if self.coordinator is not None:  # on the chief, reading the variables from the parameter servers
            return self._results(self.eval_on_chief(self.data.eval_fn(tf.distribute.InputContext())))
        # The iterator's only reference: deleted off this thread (inputs.release).
        with inputs.releasing([inputs.eval_iterator(self)]) as held:
            try:
                totals = self.eval_loop(held[0], tf.constant(self.data.eval_steps))
                self.check_retrace("eval_loop", self.eval_loop)
            except (tf.errors.OpError, RuntimeError) as e:
                if self._eval_without_xla(e):
                    return self._evaluate()
                if isinstance(e, RuntimeError):
                    raise
                raise self._explain(e, training=False) from None
        self.eval_ran = True
        return self._results(totals)

    def _eval_without_xla(self, error):
        """Rebuilds the evaluation without XLA, saying why in one line, when `error` is XLA's failing to compile it
        (the task's metrics, which training never ran, whatever --jit_compile says); False for any other error."""
        why = self._eval_uncompilable(error)
        if not why:
            return False
        print(f"evaluation without XLA ({why}): traced again", flush=True)
        self._reset_eval(jit=False)
        return True

    def _reset_eval(self, jit=None):
        """The evaluation built afresh at its next use: with XLA where the step has it (`jit` None), or not."""
        self.eval_jit = jit
        for built in ("eval_sums", "eval_step"):
            self.__dict__.pop(built, None)
        self.eval_loop = tf.function(self._eval_loop)

    def _eval_uncompilable(self, error):
        """Why XLA could not compile the evaluation sums, from the first evaluation's failure (training never runs
        the task's metrics); "" for sums not compiled, a later failure, or one that names the data."""
        if not self.eval_jit or self.eval_ran:
            return ""
        if isinstance(error, RuntimeError):
            return "the task's metrics synchronize replicas" if "merge_call" in str(error) else ""
        ops = _unsupported_ops(error)
        if ops:
            return f"the task's forward pass or metrics use {ops}, which XLA cannot compile"
        if "xla" in (error.message or "").lower():  # its compile's own failure (tf2xla, an XLA pass)
            return f"XLA could not compile the task's forward pass or metrics: {error.message.splitlines()[0]}"
        return ""

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
        """The prepared batches of `split`, each example once (weight 0 marks padding), on this host: one pass of a
        generator (its tf.data iterator deleted off this thread at the end, engine/inputs.py release)."""
        return inputs.batches(build.inputs(self.config, split).eval_fn(tf.distribute.InputContext()))


def _unsupported_ops(error):
    """The ops XLA named as without a kernel in `error` (an OpError from compiling a function), or ""."""
    found = re.search(r"unsupported operations when trying to compile.*?: ([\w, ]+) \(No registered", str(error))
    return found.group(1) if found else ""
