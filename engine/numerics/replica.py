"""The replica steps: what `strategy.run` executes on every replica.

The train step, in order: forward and per-example loss in float32; loss over
the GLOBAL batch; loss scaling (float16); ONE all-reduce of the gradients (the
loss and the replicas' batch-norm statistics ride along); unscale; finite
check on the unclipped gradients; clipping; the optimizer update, on every
replica alike. In float16 it is applied only
when every gradient is finite (a skipped step is how loss scaling learns its
scale); in float32 and bfloat16 a non-finite step is divergence, which the loop
answers at the round's end by stopping or rolling back to the last checkpoint.
The forward pass runs stateless: what it would update in place (batch-norm
statistics) comes back as values and is masked like the weights. The models'
own losses (weight and activity regularizers, add_loss) join the loss once per
step, whatever the replica count and the microbatching.
"""

import tensorflow as tf

from engine.numerics.forward import (
    accumulation_warning,
    check_aligned,
    check_loss,
    forward_backward,
    process_gradients,
    split_statistics,
)
from engine.numerics.precision import FLOOR, pairwise_sum
from engine.settings.errors import TaskError, check_call, described

SUM = tf.distribute.ReduceOp.SUM
# What a step returns beside its scalars when an action needs it (Action.needs; ReplicaStep.outputs' `extras`):
# each update's gradients at its last apply of the step, and the change that apply made to its variables.
EXTRAS = ("gradients", "updates")
# The engine's functions marked do_not_convert are tensor code without Python control flow on tensors: autograph
# has nothing to convert in them, and converting them cost every process's start measurably (bench/RESULTS.md,
# "Start-up: autograph"), ReplicaStep's apply and outputs the most. What calls a task's or a fork's code stays
# converted (the loops, the step, gradients and the forward pass down to the task's), so their `if` and `for` on
# tensors keep working (tests/test_updates.py).


@tf.autograph.experimental.do_not_convert
def _maybe_jit(fn, jit_compile):
    # Under several replicas only per-replica math can be compiled: the all-reduce and the variable
    # assignments synchronize replicas, which XLA cannot do inside a nested function (a TPU compiles all).
    return tf.function(fn, jit_compile=True) if jit_compile else fn


@tf.autograph.experimental.do_not_convert
def _assign(variable, value):
    return variable.assign(value)


@tf.autograph.experimental.do_not_convert
def _assign_add(variable, delta):
    return variable.assign_add(delta)


class Gradients:
    """One evaluation of an update's gradients in a replica step (ReplicaStep.gradients): `loss` (all-reduced,
    unscaled), `grads` (aligned with the update's variables: all-reduced, unscaled, clipped), `norm` (their global
    norm before norm clipping) and `finite` (every element of the unclipped gradients finite)."""

    def __init__(self, owner, name, loss, grads, norm, finite):
        self.owner, self.name = owner, name
        self.loss, self.grads, self.norm, self.finite = loss, grads, norm, finite


class Setup:
    """What make_train_step fixes once for every step: the plans (engine/numerics/updates.py), the statistics a forward
    pass updates, the seed generators, the loop's batch settings, and how the pieces run.

    `loop`: the run's config.loop (the global batch and --grad_accum_steps); `freeze`: --freeze, whose batch-norm
    statistics keep their values; `task_file`: the task's file, as the primitives' messages name it. `stop_flag` (a
    boolean variable, set on preemption) rides the step's first all-reduce, so every replica and worker learns that
    any of them is stopping after this step. `asynchronous` (parameter servers): updates are applied as deltas with
    assign_add, which the server applies atomically, so concurrent workers never lose each other's updates or update
    counts. `jit_compile`: compile it with XLA (engine/run/xla.py decides)."""

    def __init__(
        self, task, models, plans, loop, freeze, task_file, replicas, stop_flag, float16, asynchronous, jit_compile
    ):
        self.task, self.models, self.loop, self.task_file = task, models, loop, task_file
        self.plans = {plan.name: plan for plan in plans}
        self.statistics, self.seeds = split_statistics(models, freeze)
        self.num_replicas, self.stop_flag, self.float16, self.asynchronous = replicas, stop_flag, float16, asynchronous
        # One replica (and no parameter server): the whole step, all-reduces and assignments included, is one XLA
        # program, faster than compiling its pieces (bench/RESULTS.md). Several replicas: only the pieces.
        self.whole = jit_compile and replicas == 1 and not asynchronous
        self.jit = jit_compile and not self.whole


class ReplicaStep:
    """The primitives a task's `replica_step(step, batch)` is written from; the engine's own step is written
    from them too. Made afresh on each replica at each step.

    gradients(name, batch, loss=None, shift=None) -> Gradients: update `name`'s loss over its own forward pass,
        reduced against the global batch with the models' own losses, scaled (float16), all-reduced ONCE,
        unscaled, checked finite, clipped. `loss(models, batch, seed)` replaces the update's; `shift` (aligned with
        variables(name)) evaluates it, and its gradients, at the weights + shift.
    apply(name, gradients, when=None): the update's optimizer step with gradients from `gradients(name, ...)`
        of this step, and its moving averages, the statistics the step's latest forward pass left, its loss
        scale; masked: nothing of it changes unless every evaluation of it since its last apply was finite
        (float16) and `when` (a bool tensor) holds. Every update is applied at least once a step.
    variables(name): the values of the update's trained variables. `updates`: the Updates, in order;
    `count`: the run's step counter; `batches`: the step's batches (more than one where an update reads a fresh batch
    per repetition, Update.fresh); gradients(..., repetition=r) tells an update's loss its repetition.
    """

    def __init__(self, setup, count, replica, batches, extras):
        self.updates = [plan.update for plan in setup.plans.values()]
        self._extras = extras  # what the step returns beside its scalars (EXTRAS): kept from each apply only then
        self.batches = batches  # the step's training batches: one, or an update's fresh batch per repetition
        self.count, self._setup, self._replica = count, setup, replica
        self._ctx = tf.distribute.get_replica_context()
        self._graph = tf.compat.v1.get_default_graph()  # the step's: an apply in a tf.cond or loop of its own is not
        self._file = f"{setup.task_file}: replica_step"
        self._draws, self._stop, self._statistics = 0, None, None
        self._pending = {name: [] for name in setup.plans}
        self._applied = {name: [] for name in setup.plans}  # each apply's (loss, norm, finite, scale, rates, ...)

    @tf.autograph.experimental.do_not_convert
    def _plan(self, name, primitive):
        """The plan of update `name`, asked for by `primitive`: TaskError for a name the task has no update of, or a
        primitive called outside the replica step it was handed to (another strategy's, or none)."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.strategy is not self._ctx.strategy:
            raise TaskError(
                f"{self._file}: step.{primitive}({name!r}, ...) called outside the replica step it was handed to; "
                "call the primitives inside replica_step(step, batch) only"
            )
        if name not in self._setup.plans:
            raise TaskError(
                f"{self._file}: step.{primitive}({name!r}, ...): no update {name!r}; the task's updates are "
                f"{', '.join(self._setup.plans)}"
            )
        return self._setup.plans[name]

    @tf.autograph.experimental.do_not_convert
    def variables(self, name):
        return [v.value for v in self._plan(name, "variables").variables]

    def gradients(self, name, batch, loss=None, shift=None, repetition=0):
        setup, plan = self._setup, self._plan(name, "gradients")
        if loss is not None:
            check_loss(loss, f"{self._file}: step.gradients({name!r}, ..., loss=...)")
        if shift is not None:
            check_aligned(shift, plan, f"{self._file}: step.gradients({name!r}, ..., shift=...)", "shift")
        draw, self._draws = self._draws, self._draws + 1
        local = _maybe_jit(
            lambda b, c, r, s, v: forward_backward(
                setup, plan, b, c, r, draw, loss or plan.update.loss, s, v, repetition
            ),
            setup.jit,
        )
        total, grads, statistics = local(batch, self.count, self._replica, shift, self._statistics)
        shared = self._shared(statistics)
        flag = [tf.cast(setup.stop_flag, tf.float32)] if self._stop is None else []  # rides the step's first
        # This evaluation's one all-reduce: the loss, the gradients and the replicas' statistics.
        total, *reduced = self._ctx.all_reduce(SUM, [total, *flag, *grads, *(statistics[i] for i in shared)])
        if flag:
            self._stop, *reduced = reduced
        grads, sums = reduced[: len(grads)], reduced[len(grads) :]
        self._statistics = list(statistics)
        for i, summed in zip(shared, sums):
            self._statistics[i] = summed / setup.num_replicas
        scale = plan.loss_scale.scale if setup.float16 else None
        grads, norm, finite = _maybe_jit(lambda g: process_gradients(g, scale, plan.clipping), setup.jit)(grads)
        gradients = Gradients(self, name, total, grads, norm, finite)
        self._pending[name].append(gradients)
        return gradients

    @tf.autograph.experimental.do_not_convert
    def _shared(self, statistics):
        """The positions of the float `statistics` averaged over replicas as the gradients are all-reduced: a batch
        norm that is not synchronized (Keras's default) moves each replica's statistics by its own examples, and
        replicas that drift apart evaluate unlike one another and checkpoint only the first's. Synchronized ones are
        alike already, and their mean is the same number."""
        if self._setup.num_replicas == 1 or self._setup.asynchronous:
            return []
        return [i for i, value in enumerate(statistics) if value.dtype.is_floating]

    @tf.autograph.experimental.do_not_convert
    def apply(self, name, gradients, when=None):
        setup, plan = self._setup, self._plan(name, "apply")
        if not isinstance(gradients, Gradients) or gradients.owner is not self or gradients.name != name:
            raise TaskError(
                f"{self._file}: step.apply({name!r}, ...) takes the Gradients of step.gradients({name!r}, ...) of "
                f"this step, not {_described(gradients, self)}"
            )
        if tf.compat.v1.get_default_graph() is not self._graph:  # autograph traces both branches of a tensor `if`
            raise TaskError(
                f"{self._file}: step.apply({name!r}, ...) inside an `if` or loop on a tensor (graph mode runs it as "
                "tf.cond or tf.while_loop and traces every branch); apply in replica_step's body and say whether the "
                "update is due with when="
            )
        if not any(g is gradients for g in self._pending[name]):  # taken before the weights its apply moved
            raise TaskError(
                f"{self._file}: step.apply({name!r}, ...): these gradients were applied already; take new "
                f"step.gradients({name!r}, ...)"
            )
        check_aligned(
            gradients.grads, plan, f"{self._file}: step.apply({name!r}, ...): its Gradients' grads", "gradient"
        )
        when = self._checked_when(name, when)
        pending, self._pending[name] = self._pending[name], []
        finite = pending[0].finite if len(pending) == 1 else tf.reduce_all([g.finite for g in pending])
        scale = plan.loss_scale.scale.value() if setup.float16 else tf.constant(0.0)  # the scale before
        # float16: a skip that could not lower the scale (due, non-finite, the scale at its floor already) is
        # divergence; one above the floor, or of an update not due (its scale kept), is how the scale learns.
        at_floor = tf.logical_and(~finite, scale <= FLOOR) if setup.float16 else None
        if setup.float16 and when is not None:
            at_floor = tf.logical_and(at_floor, when)

        def new_values(grads, finite, when, statistics, step):
            return plan.new_values(
                grads, finite, when, statistics, setup.statistics, setup.float16, setup.asynchronous, step
            )

        update = _maybe_jit(new_values, setup.jit)
        values, rates = update(gradients.grads, finite, when, self._statistics, self.count)
        changes = None
        if "updates" in self._extras:  # asynchronous values are the changes already
            changes = values["params"]
            if not setup.asynchronous:  # read before the assignment below
                changes = [new - v.value for new, v in zip(changes, plan.variables)]
        assign = _assign_add if setup.asynchronous else _assign
        targets = plan.targets(setup.statistics, setup.float16)

        def assign_all(strategy, values):
            for variable, value in zip(tf.nest.flatten(targets), tf.nest.flatten(values)):
                strategy.extended.update(variable, assign, args=(value,), group=False)

        self._ctx.merge_call(assign_all, args=(values,))
        self._statistics = None  # the next forward pass reads the statistics as assigned
        if setup.float16:  # what the line and the summary show: the scale as the step leaves it, the next one's
            left = values["loss_scale"]["scale"]
            scale = scale + left if setup.asynchronous else left  # asynchronous values are changes
        self._applied[name].append(
            (pending[0].loss, gradients.norm, finite, scale, rates, gradients.grads, changes, at_floor)
        )

    @tf.autograph.experimental.do_not_convert
    def _checked_when(self, name, when):
        """`when` as apply reads it: None, or a boolean scalar; TaskError for anything else, named."""
        if when is None or isinstance(when, bool):
            return when
        try:
            tensor = tf.convert_to_tensor(when)
        except (TypeError, ValueError):
            tensor = None
        if tensor is None or tensor.dtype != tf.bool or tensor.shape.rank not in (0, None):
            kind = type(when).__name__ if tensor is None else f"tensor of {tensor.dtype.name}, shape {tensor.shape}"
            raise TaskError(
                f"{self._file}: step.apply({name!r}, ..., when=...) takes a boolean scalar (True, False or a tf.bool "
                f"tensor of shape []), whether the update is due on every replica alike, not a {kind}"
            )
        return tensor

    @tf.autograph.experimental.do_not_convert
    def outputs(self):
        """The step's scalars: loss (the updates' summed), stop, finite; each update's loss, grad_norm, loss_scale
        (as the step leaves it), rates (a one-update run's under the plain names). The step's `extras`: under
        "gradients", each update's gradients of its last apply, by <model>/<path>; under "updates", the change that
        apply made to each variable (zero where it was masked: a skipped float16 step, an update not due)."""
        out, losses, finites, grads, changes, floors = {}, [], [], {}, {}, []
        for name, applied in self._applied.items():
            plan = self._setup.plans[name]
            if not applied:
                raise TaskError(
                    f"{self._file}: never applies update {name!r}; every update is applied once a step at least "
                    "(step.apply(name, gradients, when=False) skips it)"
                )
            # Its loss and gradient norm alike: their means over the step's applications (repeat).
            loss = applied[0][0] if len(applied) == 1 else tf.add_n([a[0] for a in applied]) / len(applied)
            norm = applied[0][1] if len(applied) == 1 else tf.add_n([a[1] for a in applied]) / len(applied)
            *_, finite, scale, rates, applied_grads, applied_changes, _ = applied[-1]
            floors.extend(a[-1] for a in applied)
            grads.update(zip(plan.names, applied_grads))
            changes.update(zip(plan.names, applied_changes or ()))
            finite = tf.reduce_all([a[2] for a in applied]) if len(applied) > 1 else finite
            if plan.prefix:
                out.update({f"{plan.prefix}loss": loss, f"{plan.prefix}finite": finite})
            out.update({f"{plan.prefix}grad_norm": norm, f"{plan.prefix}loss_scale": scale})
            out.update({plan.prefix + rate: value for rate, value in rates.items()})
            losses.append(loss)
            finites.append(finite)
        # Finite: every evaluation of the step, applied or not (float32 and bfloat16 answer any with divergence).
        evaluated = [g.finite for pending in self._pending.values() for g in pending]
        finite = finites[0] if len(finites) == 1 and not evaluated else tf.reduce_all([*finites, *evaluated])
        loss = losses[0] if len(losses) == 1 else tf.add_n(losses)
        extra = {k: v for k, v in (("gradients", grads), ("updates", changes)) if k in self._extras}
        if self._setup.float16:  # whether a due apply was skipped with its loss scale at the floor
            extra["at_floor"] = floors[0] if len(floors) == 1 else tf.reduce_any(floors)
        return {"loss": loss, "stop": self._stop > 0, "finite": finite, **out, **extra}


def _described(gradients, step):
    """What an apply of `step` was handed instead of its update's gradients of this step, in words."""
    if not isinstance(gradients, Gradients):
        return f"a {type(gradients).__name__}"
    if gradients.owner is not step:
        return f"the gradients of update {gradients.name!r} of another step"
    return f"the gradients of update {gradients.name!r}"


def engine_step(step, batch):
    """The engine's replica step: each update in order, `repeat` times (each repetition on a batch of its own with
    `fresh`), applied when due (`every`)."""
    for update in step.updates:
        when = None if update.every == 1 else tf.equal(step.count % update.every, 0)
        for repetition in range(update.repeat):
            read = step.batches[repetition] if update.fresh else batch
            step.apply(update.name, step.gradients(update.name, read, repetition=repetition), when=when)


def make_train_step(setup, counter, extras=frozenset()):
    """Returns train_step(batch) -> dict of scalars, identical on every replica: the task's `replica_step`, or
    the engine's, over the plans of `setup` (a Setup). `counter` (the run's step counter) seeds the dropout masks.
    `extras` (of EXTRAS, what a due action asked for): "gradients" adds the gradients each update last applied,
    {<model>/<path>: gradient}; "updates" the change that apply made to each variable, {<model>/<path>: change}.
    """
    warning = accumulation_warning(setup.models, setup.statistics, setup.loop.grad_accum_steps)
    if warning:
        print(warning, flush=True)
    body = setup.task.replica_step or engine_step
    if setup.task.replica_step is not None:
        check_call(
            body,
            (None, None),
            setup.task_file,
            "replica_step",
            "replica_step(step, batch) (the task's own method, with self)",
        )

    def train_step(batch):
        # A step reading several batches (Update.fresh) is handed them as a tuple: the first is the step's batch.
        batches = batch if isinstance(batch, tuple) else (batch,)
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
        replica_step = ReplicaStep(setup, tf.convert_to_tensor(counter), replica, batches, extras)
        returned = body(replica_step, batches[0])
        if returned is not None:  # nothing reads it: a metric of its own is not logged, and would go unsaid
            raise TaskError(
                f"{setup.task_file}: replica_step returned {described(returned)}; it returns nothing: nothing would "
                "log it (the step's logged numbers are the loss and gradient norm of the Gradients it applies)"
            )
        return replica_step.outputs()

    return tf.function(train_step, jit_compile=True) if setup.whole else train_step


def make_eval_sums(task, models, task_file, jit_compile=False):
    """Returns sums(batch) -> ({metric: sum of weight x metric}, sum of weights) over one replica's batch: the task's
    forward pass and metrics (checked_metric), no all-reduce. With `jit_compile`, a tf.function compiled with XLA,
    under any number of replicas unless a metric synchronizes them (the evaluator then evaluates without); without,
    the plain function (a nested tf.function could not hold such a metric). Padding examples carry weight 0, so every
    real example counts once."""

    def sums(batch):
        weights = batch["weight"]
        values = task.metrics(task.forward(models, batch, training=False), batch)
        if not isinstance(values, dict):  # a list of values would fail in the engine's code, with its traceback
            raise TaskError(
                f"{task_file}: metrics: returned {described(values)}, not a dict of per-example values by name"
            )
        values = {name: checked_metric(name, v, weights, task_file) for name, v in values.items()}
        return {name: tf.reduce_sum(weights * v) for name, v in values.items()}, pairwise_sum(weights)

    return tf.function(sums, jit_compile=True) if jit_compile else sums


def checked_metric(name, value, weights, task_file):
    """A metric of Task.metrics as float32, once it is one value per example of the batch (`weights`' shape) and not
    named as the engine's own count; TaskError naming the task's file else: a batch mean would count the padding
    examples, a [batch, 1] broadcast against the weights to [batch, batch]."""
    if name == "examples":
        raise TaskError(
            f"{task_file}: metrics: a metric named 'examples' would replace the engine's count of the examples "
            "evaluated; name it otherwise"
        )
    value = tf.convert_to_tensor(value)
    shape, size = value.shape, weights.shape[0]
    if shape.rank is not None and (shape.rank != 1 or (size is not None and shape[0] not in (None, size))):
        raise TaskError(  # of an unknown rank (a tf.numpy_function's): taken as it is
            f"{task_file}: metrics: {name!r} has shape {shape.as_list()}, not "
            f"one value per example of the batch ([{size}]): the engine averages it over the real examples (padding "
            "weighs 0); never average or keep other axes"
        )
    return tf.cast(value, tf.float32)


def make_eval_step(sums, names):
    """Returns eval_step(batch) -> [sum of weight x metric for each of `names`..., sum of weights], summed over
    all replicas; `sums` from make_eval_sums."""

    def eval_step(batch):
        metrics, weight = sums(batch)
        return tf.distribute.get_replica_context().all_reduce(SUM, tf.stack([*(metrics[n] for n in names), weight]))

    return eval_step
