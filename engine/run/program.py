"""The train program: the traced inner loop that runs a round of replica steps, with `tf.range(n)` and `n` a tensor,
so it is traced once whatever the round's length; and the XLA fallback of --jit_compile=auto when the step turns out
unable to compile. The steps read their batches by one of the paths of engine/run/inputs.py."""

import re

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled: not in tf.config

from engine.data import streamed
from engine.numerics import replica, updates
from engine.run import create, inputs, xla
from engine.settings import plugins
from engine.settings.errors import ConfigError, counted, raising_task_errors


class Recompiled(Exception):
    """--jit_compile=auto chose XLA and the first step could not compile: the step was rebuilt without it, and the
    round runs again from the same data position (the message says why)."""


def stops_each_step(placement):
    """Whether the inner loop ends a round at the first step that all-reduced a set stop flag (on CPUs), or runs
    the round to its end and leaves the flag to the host between rounds (on GPUs and TPUs).

    At a step, a signal stops the run one step after it lands. But the loop's condition then depends on a value
    each step computes, which on an accelerator must come back to the host before the next step can be queued:
    the device idles between steps. On a GPU or TPU a signal therefore stops the run at the end of the round it
    lands in, at most --steps_per_loop steps later; a round's time (steps_per_loop times a step's) plus a
    checkpoint's save must fit in the scheduler's grace period (30 s by default on Kubernetes and for a GCE spot
    VM). `placement`: the run's engine/cluster/distribute.py Placement.
    """
    return placement.device == "CPU"


class TrainProgram:
    """A round of steps on the host's call: the replica step (engine/numerics/replica.py) over the run's updates in
    one traced loop; the counters it moves (State: steps run, batches read); the stop flag a signal sets. `placement`:
    distribute.py's Placement; `jit`: xla.py's Choice (changed where XLA cannot compile); `coordinator`: a PS's."""

    def __init__(self, config, placement, task, models, plans, data, state, jit, coordinator=None):
        strategy = placement.strategy
        self.config, self.placement, self.strategy, self.task = config, placement, strategy, task
        self.models, self.plans, self.data, self.state, self.coordinator = models, plans, data, state, coordinator
        self.jit = jit
        self.float16 = config.precision == "mixed_float16"
        self.batches_per_step = updates.batches_per_step(plans)  # more than one: an update reads a fresh batch each
        with strategy.scope():
            self.stop = tf.Variable(False, trainable=False, name="stop")  # set on preemption
        # Bytes of record files this process read (a streamed split), not where other processes read them (workers).
        self.bytes_read = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_read")
        self.counts_bytes = coordinator is None and not config.tf_data_service
        self.stops_each_step = stops_each_step(placement)
        if data.sharded:  # now, not as its first batch is read: nothing is written yet
            streamed.check_enough_files(data.train_shards, config.data, self.pipelines)
            streamed.warn_of_uneven_shares(data.train_shards, config.data, self.pipelines)
        self.input = self.input_path()
        self.retraced = set()
        self._build()

    def input_path(self, in_step=None):
        """The path the steps read their batches by (engine/run/inputs.py path): gathered in the step where it
        decides, or not (`in_step` False: from the tf.data pipeline, as a test feeding batches of its own sets it)."""
        counter = self.bytes_read if self.counts_bytes else None
        return inputs.path(self.placement, self.data, counter, self.coordinator, self.config.tf_data_service, in_step)

    def traces(self):
        """How often the rounds' loops were traced so far: a round that traced one (a new variant, the extras an
        action asked for first) compiled it too."""
        return sum(loop.experimental_get_tracing_count() for _, loop in self._loops.values())

    @property
    def in_step(self):
        """Whether each replica gathers its own batch inside the step (engine/run/inputs.py gathers_in_step)."""
        return isinstance(self.input, inputs.InStep)

    jit_compile = property(lambda self: self.jit.compile)  # whether the step compiles with XLA now
    jit_reason = property(lambda self: self.jit.reason)  # why, as the run's header says it

    def _fall_back(self, synchronizes=False, unsupported=""):
        """The step rebuilt as --jit_compile=auto decides knowing what XLA could not compile."""
        numerics, placement = self.config.numerics, self.placement
        self.jit.compile, self.jit.reason = xla.resolve(numerics, placement, self.models, synchronizes, unsupported)
        self._build()

    def _build(self):
        """The step and its round's loop, with XLA or not as chosen now; a variant that also returns the step's
        `extras` is built when a round first asks for them."""
        self._loops = {}
        self.train_step, self.train_loop = self._loop(frozenset())

    def _loop(self, extras):
        if extras not in self._loops:
            setup = replica.Setup(
                self.task,
                self.models,
                self.plans,
                self.config.loop,
                self.config.freeze,
                plugins.file("task", self.config.task),
                self.placement.replicas,
                self.stop,
                self.float16,
                asynchronous=self.coordinator is not None,
                jit_compile=self.jit_compile,
            )
            train_step = replica.make_train_step(setup, self.state.step, extras)

            def train_loop(iterator, steps, first_batch):
                return self._train_loop(train_step, extras, iterator, steps, first_batch)

            self._loops[extras] = train_step, tf.function(train_loop)
        return self._loops[extras]

    @property
    def metric_names(self):
        """What each logged line carries from the step beside the loss: every update's rates, gradient norm and
        loss scale (and loss, in a run of several)."""
        return [name for plan in self.plans for name in plan.metric_names if not name.endswith("finite")]

    @property
    def waits_timed(self):
        """Whether the rounds time each step's wait for its batch: on CPUs only, as the per-step stop (on an
        accelerator the wait's end would wait for the batch to reach the device, a sync each step), and not under
        op determinism, which refuses tf.timestamp."""
        return self.stops_each_step and not tf_config.is_op_determinism_enabled()

    @property
    def pipelines(self):
        """Input pipelines reading the training stream: one per worker (a parameter server's read their own)."""
        return 1 if self.coordinator is not None else self.placement.workers

    def check_pipelines(self):
        """Refuses to resume a streamed split with another number of input pipelines than read it so far."""
        saved = int(self.state.input_pipelines.numpy())
        if self.data.sharded and saved and saved != self.pipelines:
            raise ConfigError(
                f"--dataset={self.config.dataset}: this run read its streamed training files with "
                f"{counted(saved, 'input pipeline')} (workers) up to its data position, and now has {self.pipelines}: "
                f"each pipeline reads its own files, so the position means nothing to {self.pipelines}; resume it "
                f"with {counted(saved, 'worker')}, or train in a new --workdir"
            )

    def train_iterator(self):
        """An iterator over the training batches from the current data position on; None when the steps gather their
        own (`in_step`)."""
        start = int(self.state.batches.numpy())
        self.check_pipelines()
        self.state.input_pipelines.assign(self.pipelines)
        return self.input.open(start)

    def stopping_anywhere(self):
        """Whether any worker has been signalled. A signal that came during a round's last step is not in that
        step's all-reduce: on several workers the flag is all-reduced once more, so all of them answer alike."""
        if self.coordinator is not None or not self.placement.multi_worker:
            return bool(self.stop.numpy())
        return bool(self._any_stop())

    @tf.function
    def _any_stop(self):
        def replica_stop():
            return tf.distribute.get_replica_context().all_reduce(replica.SUM, tf.cast(self.stop, tf.float32))

        return inputs.first_replica(self.strategy, self.strategy.run(replica_stop)) > 0

    def _train_loop(self, train_step, extras, iterator, steps, first_batch):
        summed, own = _summed_numbers(self.plans)
        sums = {name: tf.constant(0.0, tf.float64) for name in ["loss", *summed]}
        counted = {name: tf.constant(0.0, tf.float64) for name in own}
        finite_steps, ran = tf.constant(0.0), tf.constant(0)
        floor_skipped = tf.constant(0.0)  # float16: steps skipped whose skip could not lower the loss scale
        timed, feed, state = self.waits_timed, self.input, self.state
        began = tf.timestamp() if timed else tf.constant(0.0, tf.float64)
        waited = began - began  # zero, and the loop that adds to it starts after `began`
        last = {"stop": False, **{name: 0.0 for name in self.metric_names if name not in summed}}
        # The last step's extras (its gradients or updates, for an action that asked for them), carried through
        # the loop.
        carried = {name: _zeros(self.plans) for name in extras}
        for i in tf.range(steps):
            out = feed.step(train_step, iterator, first_batch, i, timed, self.batches_per_step)
            waited += out.pop("waited")
            carried = {name: out.pop(name) for name in extras}
            sums = {
                k: v + tf.where(out[own.get(k, "finite")], tf.cast(out[k], tf.float64), 0.0) for k, v in sums.items()
            }
            counted = {k: v + tf.cast(out[own[k]], tf.float64) for k, v in counted.items()}
            finite_steps += tf.cast(out["finite"], tf.float32)
            if self.float16:  # a due apply skipped with its loss scale at the floor (ReplicaStep.outputs)
                floor_skipped += tf.cast(out.pop("at_floor"), tf.float32)
            last = {k: out[k] for k in last}
            ran += 1
            state.step.assign_add(1)
            state.batches.assign_add(self.batches_per_step)
            if self.stops_each_step and out["stop"]:
                break
        with tf.control_dependencies([ran, waited]):  # the loop's end, as the timestamps are ordered by hand
            busy = tf.timestamp() - began if timed else tf.constant(0.0, tf.float64)
        timing = {"input_wait": waited, "busy": busy}
        return _round_numbers(self.plans, sums, counted, finite_steps, ran, floor_skipped, **timing, **last, **carried)

    def trace(self):
        """Traces the round's loop (with the replica step) now, as a run's first function. XLA's persistent cache
        (--compile_cache) keys a compiled function by its traced name, which counts the functions traced before it
        in the process: traced before a checkpoint is restored, a resumed run's step is named as the first run's,
        and read back. False where nothing is traced ahead: a parameter server's rounds (scheduled functions) and a
        tf.data service's (opening an iterator there registers a job with the dispatcher)."""
        if self.coordinator is not None or self.config.tf_data_service:
            return False
        spec = (tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int64))  # as run_steps passes the steps and position
        with raising_task_errors():
            try:
                with inputs.releasing([self.input.open(0)]) as iterators:  # its spec: the data position is not read yet
                    self.train_loop.get_concrete_function(iterators[0], *spec)
            except RuntimeError as e:
                self._untraceable(e)
                return self.trace()
            create.check_built(self.models)  # no variable made as it traced
        return True

    def run_steps(self, iterator, steps):
        """Runs up to `steps` train steps in one call of the traced inner loop; returns host numbers. `iterator`: the
        batches, or None (train_iterator() when in_step): each step gathers its own from the data position on.
        Recompiled when --jit_compile=auto's XLA could not compile the step: rebuilt without, the round runs again."""
        return self.run_round(iterator, steps)[0]

    def run_round(self, iterator, steps, extras=frozenset()):
        """run_steps, and the round's last step's `extras` ({"gradients": {<model>/<path>: numpy array}}: the
        gradients it applied, all-reduced, unscaled and clipped; {"updates": ...}: the change each apply made to the
        variables), as an action asked for them. A task's code that cannot run (TaskError, found as the step is
        traced) is raised as itself: one line, naming the task."""
        with raising_task_errors():
            return self._run_round(iterator, steps, extras)

    def _run_round(self, iterator, steps, extras):
        position = (int(self.state.step.numpy()), int(self.state.batches.numpy()))
        try:
            loop = self._loop(frozenset(extras))[1]
            out = self.input.run(loop, iterator, steps, position[1])
            if self.coordinator is None:  # a parameter server's workers trace their own
                warn_retraced("train_loop", loop, self.retraced)
                create.check_built(self.models)
            else:  # a dead worker's function ran again elsewhere, its counters' increments twice: the chief's count
                self.state.step.assign(position[0] + int(out["steps"]))  # of the steps that ran is the run's
                self.state.batches.assign(position[1] + int(out["steps"]) * self.batches_per_step)
        except RuntimeError as e:
            self._untraceable(e)
            return self._run_round(iterator, steps, extras)
        except tf.errors.OpError as e:
            ops = unsupported_ops(e)
            if ops and self.jit_compile and self.config.jit_compile == "auto":
                # Found only when the first step runs, after its batch was taken: the caller reads it again.
                self._fall_back(unsupported=ops)
                # The counters are not ordered after the failed step (they touch other variables): put them back.
                self.state.step.assign(position[0])
                self.state.batches.assign(position[1])
                raise Recompiled(f"jit_compile=false ({self.jit_reason}): the first round runs again") from None
            raise inputs.explain(e, self.config, self.strategy, self.data, True, self.pipelines) from None
        found = {name: tf.nest.map_structure(np.asarray, out.pop(name)) for name in extras}
        return {k: float(v) for k, v in out.items()}, found

    def _untraceable(self, error):
        """A RuntimeError tracing the round: a replica step that synchronizes replicas (merge_call), which XLA cannot
        compile, is rebuilt without XLA where auto chose it (what auto cannot know before the step is traced),
        refused where --jit_compile=true asked for it; any other is raised."""
        if "merge_call" in str(error) and self.jit_compile and self.config.jit_compile == "auto":
            self._fall_back(synchronizes=True)
            print(f"jit_compile=false ({self.jit_reason}): the step is traced again without XLA", flush=True)
            return
        if "merge_call" in str(error) and self.jit_compile:
            raise ConfigError(
                f"--jit_compile=true: --model={self.config.model} or --task={self.config.task} synchronizes "
                "replicas inside the forward pass or the loss (synchronized batch norm, gathered negatives), "
                f"which XLA cannot compile with "
                f"{self.placement.replicas} replicas here; drop --jit_compile or use one replica"
            ) from None
        raise error


def warn_retraced(name, function, warned):
    """Warns once (`warned`: the names warned of so far) when a round's function was traced again: a shape or
    structure that changes between rounds (a task's, a data source's) recompiles the step every time, silently
    slow."""
    count = function.experimental_get_tracing_count()
    if count > 1 and name not in warned:
        warned.add(name)
        print(
            f"warning: {name} was traced {count} times: its inputs changed shape or structure between calls (a task's "
            "batch or outputs?); every retrace recompiles the step",
            flush=True,
        )


def _summed_numbers(plans):
    """What a round's loop sums, in float64 (the sums of two parts of a logging window, a run preempted inside it
    and resumed, add up to the whole window's exactly): the loss, and each update's loss (in a run of several) and
    gradient norm; and {number: its update's finite flag} for those a run of several counts over the steps where
    that update's gradients were finite. A logged line holds their means: in float16 each update skips alone (a
    discriminator's overflow does not stop its generator from training), and the step's finite flag (every
    update's) would drop the numbers of the updates that did train there."""
    summed = [name for p in plans for name in ((p.prefix + "loss",) if p.prefix else ()) + (p.prefix + "grad_norm",)]
    own = {name: p.prefix + "finite" for p in plans if p.prefix for name in (p.prefix + "loss", p.prefix + "grad_norm")}
    return summed, own


def _round_numbers(plans, sums, counted, finite_steps, ran, floor_skipped, **rest):
    """What a round's loop returns: each summed number's mean over the round's finite steps (the loss; an update's
    own over its own) and its sum, the steps skipped (each update's too), the steps run, and `rest` as it is: the
    input's wait and the seconds the loop ran (`busy`, where its waits are timed, else 0: the time they are a share
    of), the last step's numbers (`stop`: the all-reduced flag, the same on every worker) and its extras."""
    means = {k: v / counted.get(k, tf.cast(finite_steps, tf.float64)) for k, v in sums.items()}
    return {
        **means,
        **{f"{k}_sum": v for k, v in sums.items()},
        "skipped": tf.cast(ran, tf.float32) - finite_steps,
        **_each_skipped(plans, ran, counted),
        "floor_skipped": floor_skipped,
        "steps": ran,
        **rest,
    }


def _each_skipped(plans, ran, counted):
    """Each update's own skipped steps in a run of several (<update>/skipped): the steps its numbers leave out."""
    return {p.prefix + "skipped": tf.cast(ran, tf.float64) - counted[p.prefix + "loss"] for p in plans if p.prefix}


def _zeros(plans):
    """{<model>/<path>: zeros like the variable} of every update's variables: the extras before the first step."""
    return {name: tf.zeros(v.shape, v.dtype) for plan in plans for name, v in zip(plan.names, plan.variables)}


def unsupported_ops(error):
    """The ops XLA named as without a kernel in `error` (an OpError from compiling a function), or ""."""
    found = re.search(r"unsupported operations when trying to compile.*?: ([\w, ]+) \(No registered", str(error))
    return found.group(1) if found else ""
