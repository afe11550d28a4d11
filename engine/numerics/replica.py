"""The replica steps: what `strategy.run` executes on every replica.

The train step, in order: forward and per-example loss in float32; loss over
the GLOBAL batch; loss scaling (float16); ONE all-reduce of the gradients (the
loss rides along); unscale; finite check on the unclipped gradients; clipping;
the optimizer update, on every replica alike. In float16 it is applied only
when every gradient is finite (a skipped step is how loss scaling learns its
scale); in float32 and bfloat16 a non-finite step is divergence, which the loop
answers at the round's end by stopping or rolling back to the last checkpoint.
The forward pass runs stateless: what it would update in place (batch-norm
statistics) comes back as values and is masked like the weights. The models'
own losses (weight and activity regularizers, add_loss) join the loss once per
step, whatever the replica count and the microbatching.
"""

import re

import keras
import tensorflow as tf

SUM = tf.distribute.ReduceOp.SUM
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


def split_state(models, freeze=""):
    """(state, seeds): the models' non-trainable variables a forward pass updates (batch-norm statistics),
    and their random seed-generator states (Keras names them so), which the step derives instead. A frozen
    model (a teacher) and the statistics whose <model>/<path> matches --freeze keep their values."""
    pattern = re.compile(freeze) if freeze else None
    state, seeds = [], []
    for name, model in models.items():
        if not model.trainable:  # only read: nothing of it changes, nothing is assigned
            continue
        for v in model.non_trainable_variables:
            if v.path.endswith("seed_generator_state"):
                seeds.append(v)
            elif not (pattern and pattern.search(f"{name}/{v.path}")):
                state.append(v)
    return state, seeds


def pass_seed(step, replica, draw=0):
    """The seed of one forward pass: (step, replica) for a step's first, folded with `draw` for its later ones."""
    seed = tf.stack([step, replica])
    return seed if draw == 0 else tf.random.experimental.stateless_fold_in(seed, draw)


def stateless_forward(task, models, batch, state, values, seeds, step, replica, draw=0, run=None, weights=()):
    """The task's training forward pass with nothing assigned, starting from `values` of `state`: returns (outputs,
    new values of `state`, the losses the pass added: activity regularizers and `add_loss` in a model's call).

    Each seed generator draws from (its own seed, `step`, `replica`, `draw`): every replica of a mirrored or
    multi-worker job gets its own dropout masks, every forward pass of a step (`draw`: its updates, their
    repetitions) its own, and a resumed run draws exactly the masks an uninterrupted one would have.
    (Parameter-server workers all count as replica 0; they differ by the step they read.) `run(models, batch, seed)`
    replaces the task's forward (an update's loss; `seed` its own noise's, apart from the masks'); `weights`:
    (variable, value) pairs the pass reads instead of the variables (SAM's ascent point).
    """
    mapping = [*zip(state, values), *weights]
    if seeds:
        seed = pass_seed(step, replica, draw)
        noise = tf.random.stateless_uniform([], seed, minval=None, maxval=None, dtype=tf.int64)
        mapping += [(v, tf.stack([v.value[0], noise])) for v in seeds]
    # collect_losses: inside a stateless scope Keras records add_loss (activity regularizers too) in the scope
    # only, and only when asked. `model.losses` is not read here: it would evaluate the weight regularizers on the
    # scope's value of each weight, which it has none of (the step evaluates them on the weights).
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        if run is None:
            outputs = task.forward(models, batch, training=True)
        else:  # the task's own noise: a stream no pass's masks draw from (their replica ids are >= 0)
            outputs = run(models, batch, pass_seed(step, -1 - replica, draw))
    return outputs, [scope.get_current_value(v) for v in state], list(scope.losses)


@tf.autograph.experimental.do_not_convert
def weight_penalty(params, values=None):
    """The sum of the weight regularizers (kernel_regularizer, bias_regularizer) of the trained variables `params`
    (Keras variables), in float32; None where none has one. Evaluated on the variables themselves (or `values`),
    so a tape differentiates it. A frozen variable's penalty is a constant of the loss, left out as Keras leaves
    out a non-trainable layer's."""
    values = [v.value for v in params] if values is None else values
    terms = [tf.cast(v.regularizer(x), tf.float32) for v, x in zip(params, values) if getattr(v, "regularizer", None)]
    return tf.add_n(terms) if terms else None


def accumulation_warning(models, state, accumulate):
    """The warning line for --grad_accum_steps with state a forward pass updates (batch norm), or None."""
    if accumulate == 1 or not state:
        return None
    owner = {id(v): name for name, model in models.items() for v in model.variables}
    names = [f"{owner[id(v)]}/{v.path}" for v in state]
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return (
        f"warning: --grad_accum_steps={accumulate}: each of the {accumulate} microbatches runs its own forward pass, "
        f"which updates {names[0]}{more}: batch norm normalizes each microbatch with its own statistics and moves "
        "its moving averages once per microbatch (ghost batch norm), so a step is not the whole batch's update"
    )


@tf.autograph.experimental.do_not_convert
def global_norm(grads):
    """(norm, finite): the gradients' global norm, and whether every element is finite.

    A finite sum of squares proves every element finite. Only when it is not are the elements checked,
    and the norm taken relative to the largest magnitude: finite gradients above about 1e19 overflow a
    float32 sum of squares, which must not read as a non-finite step.
    """
    squares = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])

    def rescaled():
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        largest = tf.reduce_max([tf.reduce_max(tf.abs(g)) for g in grads])
        divisor = tf.where(finite & (largest > 0), largest, 1.0)
        ratio = tf.add_n([tf.reduce_sum(tf.square(g / divisor)) for g in grads])
        return divisor * tf.sqrt(ratio), finite

    return tf.cond(tf.math.is_finite(squares), lambda: (tf.sqrt(squares), tf.constant(True)), rescaled)


@tf.autograph.experimental.do_not_convert
def process_gradients(grads, scale, clipping):
    """(grads, grad_norm, finite) from the all-reduced gradients: unscaled (float16's `scale`), then judged
    finite element by element BEFORE clipping (clip_value would turn an overflow into +-clip_value), then
    clipped by value and by global norm (`clipping`: an update's Clipping, or config.optimization). `grad_norm` is
    the norm before norm clipping."""
    if scale is not None:
        grads = [g / scale for g in grads]  # unscale before anything looks at the gradients
    finite = None
    if clipping.clip_value:
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        grads = [tf.clip_by_value(g, -clipping.clip_value, clipping.clip_value) for g in grads]
    grad_norm, norm_finite = global_norm(grads)
    finite = norm_finite if finite is None else finite
    if clipping.clip_norm:
        grads = [g * tf.minimum(1.0, clipping.clip_norm / grad_norm) for g in grads]
    return grads, grad_norm, finite


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


class Built:
    """What make_train_step fixes once for every step: the plans (engine/updates.py), the state a forward pass
    updates, the seed generators, and how the pieces run."""

    def __init__(self, task, models, plans, config, num_replicas, stop_flag, float16, asynchronous, jit):
        self.task, self.models, self.config = task, models, config
        self.plans = {plan.name: plan for plan in plans}
        self.state, self.seeds = split_state(models, config.freeze)
        self.num_replicas, self.stop_flag, self.float16 = num_replicas, stop_flag, float16
        self.asynchronous, self.jit = asynchronous, jit


def forward_backward(built, plan, batch, step, replica, draw, loss, shift, values):
    """One replica's loss and gradients of `plan`'s update over its batch, before the all-reduce; returns (loss,
    grads, the state's new values). `values` of the state, or None to read them; `shift`: weights + shift."""
    config, task, scale = built.config, built.task, plan.loss_scale.scale if built.float16 else None
    variables, global_batch, accumulate = plan.variables, config.global_batch_size, config.grad_accum_steps
    params = [v.value for v in variables]
    at = params if shift is None else [p + tf.cast(s, p.dtype) for p, s in zip(params, shift)]
    weights = () if shift is None else tuple(zip(variables, at))
    values = [v.value for v in built.state] if values is None else values
    # --grad_accum_steps=K: K microbatches in turn, each its own forward and backward pass, their gradients
    # summed before the one all-reduce: the update of the whole batch in 1/K of the activation memory.
    # Dynamic: a multi-worker strategy's distributed batches have no static batch dimension.
    size = tf.shape(next(iter(batch.values())))[0] // accumulate if accumulate > 1 else None
    total, grads = 0.0, None
    for k in range(accumulate):
        part = batch if size is None else {name: t[k * size : (k + 1) * size] for name, t in batch.items()}
        with tf.GradientTape() as tape:
            if shift is not None:
                tape.watch(at)
            outputs, values, pass_losses = stateless_forward(
                task, built.models, part, built.state, values, built.seeds, step, replica * accumulate + k,
                draw, loss, weights,
            )  # fmt: skip
            per_example = tf.cast(task.loss(outputs, part) if loss is None else outputs, tf.float32)
            # Divide by the GLOBAL batch: the SUM all-reduce then gives the mean over all replicas'
            # examples, the same number one device computes, whatever the replica count.
            part_loss = tf.reduce_sum(per_example) / global_batch
            if pass_losses:
                # A pass's own losses are its estimate over the examples it saw (Keras divides an activity
                # penalty by that batch): the mean over the step's num_replicas x accumulate equal passes is the
                # estimate over the global batch, one device's number.
                pass_total = tf.add_n([tf.cast(x, tf.float32) for x in pass_losses])
                part_loss += pass_total / (built.num_replicas * accumulate)
            penalty = weight_penalty(variables, None if shift is None else at) if k == 0 else None
            if penalty is not None:
                # The weights' penalty is every replica's whole term, once per step: the SUM all-reduce would
                # count it once per replica.
                part_loss += penalty / built.num_replicas
            scaled = part_loss * scale if scale is not None else part_loss
        part_grads = [
            tf.zeros_like(p) if g is None else tf.convert_to_tensor(g) for p, g in zip(at, tape.gradient(scaled, at))
        ]
        grads = part_grads if grads is None else [g + d for g, d in zip(grads, part_grads)]
        total += part_loss
    return total, grads, values


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
    `count`: the run's step counter.
    """

    def __init__(self, built, count, replica):
        self.updates = [plan.update for plan in built.plans.values()]
        self.count, self._built, self._replica = count, built, replica
        self._ctx = tf.distribute.get_replica_context()
        self._draws, self._stop, self._state = 0, None, None
        self._pending = {name: [] for name in built.plans}
        self._applied = {name: [] for name in built.plans}  # each apply's (loss, norm, finite, scale, rates)

    @tf.autograph.experimental.do_not_convert
    def _plan(self, name):
        if name not in self._built.plans:
            raise ValueError(f"no update {name!r}: the task's updates are {', '.join(self._built.plans)}")
        return self._built.plans[name]

    @tf.autograph.experimental.do_not_convert
    def variables(self, name):
        return [v.value for v in self._plan(name).variables]

    def gradients(self, name, batch, loss=None, shift=None):
        built, plan = self._built, self._plan(name)
        draw, self._draws = self._draws, self._draws + 1
        local = _maybe_jit(
            lambda b, c, r, s, v: forward_backward(built, plan, b, c, r, draw, loss or plan.update.loss, s, v),
            built.jit,
        )
        total, grads, self._state = local(batch, self.count, self._replica, shift, self._state)
        if self._stop is None:  # the stop flag rides the step's first all-reduce
            total, stop, *grads = self._ctx.all_reduce(SUM, [total, tf.cast(built.stop_flag, tf.float32), *grads])
            self._stop = stop
        else:
            total, *grads = self._ctx.all_reduce(SUM, [total, *grads])  # this evaluation's one all-reduce
        scale = plan.loss_scale.scale if built.float16 else None
        grads, norm, finite = _maybe_jit(lambda g: process_gradients(g, scale, plan.clipping), built.jit)(grads)
        gradients = Gradients(self, name, total, grads, norm, finite)
        self._pending[name].append(gradients)
        return gradients

    @tf.autograph.experimental.do_not_convert
    def apply(self, name, gradients, when=None):
        built, plan = self._built, self._plan(name)
        if not isinstance(gradients, Gradients) or gradients.owner is not self or gradients.name != name:
            raise ValueError(f"apply({name!r}, ...) takes the Gradients of gradients({name!r}, ...) of this step")
        if not any(g is gradients for g in self._pending[name]):  # taken before the weights its apply moved
            raise ValueError(
                f"apply({name!r}, ...): these gradients were applied already; take new gradients({name!r}, ...)"
            )
        pending, self._pending[name] = self._pending[name], []
        finite = pending[0].finite if len(pending) == 1 else tf.reduce_all([g.finite for g in pending])
        scale = plan.loss_scale.scale.value() if built.float16 else tf.constant(0.0)  # the scale before
        update = _maybe_jit(
            lambda g, f, w, s: plan.new_values(g, f, w, s, built.state, built.float16, built.asynchronous), built.jit
        )
        values, rates = update(gradients.grads, finite, when, self._state)
        assign = _assign_add if built.asynchronous else _assign
        targets = plan.targets(built.state, built.float16)

        def assign_all(strategy, values):
            for variable, value in zip(tf.nest.flatten(targets), tf.nest.flatten(values)):
                strategy.extended.update(variable, assign, args=(value,), group=False)

        self._ctx.merge_call(assign_all, args=(values,))
        self._state = None  # the next forward pass reads the statistics as assigned
        self._applied[name].append((pending[0].loss, gradients.norm, finite, scale, rates, gradients.grads))

    @tf.autograph.experimental.do_not_convert
    def outputs(self, extras=frozenset()):
        """The step's scalars: loss (the updates' summed), stop, finite; each update's loss, grad_norm, loss_scale,
        rates (a one-update run's under the plain names). `extras` {"gradients"}: each update's gradients of its last
        apply, by <model>/<path>, under "gradients"."""
        out, losses, finites, grads = {}, [], [], {}
        for name, applied in self._applied.items():
            plan = self._built.plans[name]
            if not applied:
                raise ValueError(f"the replica step never applies update {name!r} (apply it with when=False to skip)")
            loss = applied[0][0] if len(applied) == 1 else tf.add_n([a[0] for a in applied]) / len(applied)
            *_, norm, finite, scale, rates, applied_grads = applied[-1]
            grads.update(zip(plan.names, applied_grads))
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
        extra = {"gradients": grads} if "gradients" in extras else {}
        return {"loss": loss, "stop": self._stop > 0, "finite": finite, **out, **extra}


def engine_step(step, batch):
    """The engine's replica step: each update in order, `repeat` times, applied when due (`every`)."""
    for update in step.updates:
        when = None if update.every == 1 else tf.equal(step.count % update.every, 0)
        for _ in range(update.repeat):
            step.apply(update.name, step.gradients(update.name, batch), when=when)


def make_train_step(
    task,
    models,
    plans,
    config,
    num_replicas,
    stop_flag,
    step,
    float16,
    asynchronous=False,
    jit_compile=False,
    extras=frozenset(),
):
    """Returns train_step(batch) -> dict of scalars, identical on every replica: the task's `replica_step`, or
    the engine's, over `plans` (engine/updates.py).

    `stop_flag` (a boolean variable, set on preemption) rides the step's first all-reduce, so every replica and
    worker learns that any of them is stopping after this step. `step` (the run's step counter) seeds the dropout
    masks. `asynchronous` (parameter servers): updates are applied as deltas with assign_add, which the server
    applies atomically, so concurrent workers never lose each other's updates or update counts. `jit_compile`:
    compile it with XLA (engine/run/xla.py decides). `extras`: {"gradients"} adds the gradients each update last
    applied, {<model>/<path>: gradient} under "gradients" (an action asked for them).
    """
    # One replica (and no parameter server): the whole step, all-reduces and assignments included, is one XLA
    # program, faster than compiling its pieces (bench/RESULTS.md). Several replicas: only the pieces.
    whole = jit_compile and num_replicas == 1 and not asynchronous
    built = Built(
        task, models, plans, config, num_replicas, stop_flag, float16, asynchronous, jit_compile and not whole
    )
    warning = accumulation_warning(models, built.state, config.grad_accum_steps)
    if warning:
        print(warning, flush=True)
    body = task.replica_step or engine_step

    def train_step(batch):
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
        replica_step = ReplicaStep(built, tf.convert_to_tensor(step), replica)
        body(replica_step, batch)
        return replica_step.outputs(extras)

    return tf.function(train_step, jit_compile=True) if whole else train_step


def make_eval_sums(task, models, jit_compile=False):
    """Returns sums(batch) -> ({metric: sum of weight x metric}, sum of weights) over one replica's batch: the task's
    forward pass and metrics, no all-reduce. With `jit_compile`, a tf.function compiled with XLA, under any number
    of replicas unless a metric synchronizes them (Trainer._evaluate then evaluates without); without, the plain
    function (a nested tf.function could not hold such a metric). Padding examples carry weight 0, so every real
    example counts once."""

    def sums(batch):
        weights = batch["weight"]
        values = task.metrics(task.forward(models, batch, training=False), batch)
        return {name: tf.reduce_sum(weights * tf.cast(v, tf.float32)) for name, v in values.items()}, tf.reduce_sum(
            weights
        )

    return tf.function(sums, jit_compile=True) if jit_compile else sums


def make_eval_step(sums, names):
    """Returns eval_step(batch) -> [sum of weight x metric for each of `names`..., sum of weights], summed over
    all replicas; `sums` from make_eval_sums."""

    def eval_step(batch):
        metrics, weight = sums(batch)
        return tf.distribute.get_replica_context().all_reduce(SUM, tf.stack([*(metrics[n] for n in names), weight]))

    return eval_step
