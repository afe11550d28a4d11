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


def stateless_forward(task, models, batch, state, values, seeds, step, replica):
    """The task's training forward pass with nothing assigned, starting from `values` of `state`: returns (outputs,
    new values of `state`, the losses the pass added: activity regularizers and `add_loss` in a model's call).

    Each seed generator draws from (its own seed, `step`, `replica`): every replica of a mirrored or
    multi-worker job gets its own dropout masks, and a resumed run draws exactly the masks an uninterrupted
    one would have. (Parameter-server workers all count as replica 0; they differ by the step they read.)
    """
    mapping = list(zip(state, values))
    if seeds:
        noise = tf.random.stateless_uniform([], tf.stack([step, replica]), minval=None, maxval=None, dtype=tf.int64)
        mapping += [(v, tf.stack([v.value[0], noise])) for v in seeds]
    # collect_losses: inside a stateless scope Keras records add_loss (activity regularizers too) in the scope
    # only, and only when asked. `model.losses` is not read here: it would evaluate the weight regularizers on the
    # scope's value of each weight, which it has none of (make_train_step evaluates them on the weights).
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        outputs = task.forward(models, batch, training=True)
    return outputs, [scope.get_current_value(v) for v in state], list(scope.losses)


def weight_penalty(params):
    """The sum of the weight regularizers (kernel_regularizer, bias_regularizer) of the trained variables `params`
    (Keras variables), in float32; None where none has one. Evaluated on the variables themselves, so a tape
    differentiates it. A frozen variable's penalty is a constant of the loss, left out as Keras leaves out a
    non-trainable layer's."""
    terms = [tf.cast(v.regularizer(v.value), tf.float32) for v in params if getattr(v, "regularizer", None)]
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


def process_gradients(grads, scale, config):
    """(grads, grad_norm, finite) from the all-reduced gradients: unscaled (float16's `scale`), then judged
    finite element by element BEFORE clipping (clip_value would turn an overflow into +-clip_value), then
    clipped by value and by global norm. `grad_norm` is the norm before norm clipping."""
    if scale is not None:
        grads = [g / scale for g in grads]  # unscale before anything looks at the gradients
    finite = None
    if config.clip_value:
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        grads = [tf.clip_by_value(g, -config.clip_value, config.clip_value) for g in grads]
    grad_norm, norm_finite = global_norm(grads)
    finite = norm_finite if finite is None else finite
    if config.clip_norm:
        grads = [g * tf.minimum(1.0, config.clip_norm / grad_norm) for g in grads]
    return grads, grad_norm, finite


def _assign(variable, value):
    return variable.assign(value)


def _assign_add(variable, delta):
    return variable.assign_add(delta)


def make_train_step(
    task,
    models,
    params,
    optimizer,
    loss_scale,
    config,
    num_replicas,
    stop_flag,
    step,
    ema=(),
    asynchronous=False,
    jit_compile=False,
):
    """Returns train_step(batch) -> dict of scalars, identical on every replica.

    `params`: the variables trained (every model's trainable ones, less --freeze). `loss_scale` is None unless
    float16. `stop_flag` (a boolean variable, set on preemption) rides the all-reduce, so every replica and worker
    learns that any of them is stopping after this step. `step` (the run's step counter) seeds the dropout masks.
    `ema`: moving averages of `params` (--ema_decay), updated with them. `asynchronous` (parameter servers):
    updates are applied as deltas with assign_add, which the server applies atomically, so concurrent workers
    never lose each other's updates or update counts. `jit_compile`: compile it with XLA (engine/xla.py decides).
    """
    trained, params = params, [v.value for v in params]  # the Keras variables (their regularizers), their values
    state, seeds = split_state(models, config.freeze)
    warning = accumulation_warning(models, state, config.grad_accum_steps)
    if warning:
        print(warning, flush=True)
    slot_counts = [len(param_slots) for param_slots in optimizer.slots]
    assigned = params + [s for param_slots in optimizer.slots for s in param_slots] + [optimizer.iterations]
    assigned += [v.value for v in state] + list(ema)
    if loss_scale:
        assigned += [loss_scale.scale, loss_scale.good_steps]
    global_batch = config.global_batch_size
    accumulate = config.grad_accum_steps

    def forward_backward(batch, step, replica):
        # --grad_accum_steps=K: K microbatches in turn, each its own forward and backward pass, their gradients
        # summed before the one all-reduce: the update of the whole batch in 1/K of the activation memory.
        # Dynamic: a multi-worker strategy's distributed batches have no static batch dimension.
        size = tf.shape(next(iter(batch.values())))[0] // accumulate if accumulate > 1 else None
        loss, grads, values = 0.0, None, [v.value for v in state]
        for k in range(accumulate):
            part = batch if size is None else {name: t[k * size : (k + 1) * size] for name, t in batch.items()}
            with tf.GradientTape() as tape:
                outputs, values, pass_losses = stateless_forward(
                    task, models, part, state, values, seeds, step, replica * accumulate + k
                )
                per_example = tf.cast(task.loss(outputs, part), tf.float32)
                # Divide by the GLOBAL batch: the SUM all-reduce then gives the mean over all replicas'
                # examples, the same number one device computes, whatever the replica count.
                part_loss = tf.reduce_sum(per_example) / global_batch
                if pass_losses:
                    # A pass's own losses are its estimate over the examples it saw (Keras divides an activity
                    # penalty by that batch): the mean over the step's num_replicas x accumulate equal passes is the
                    # estimate over the global batch, one device's number.
                    pass_total = tf.add_n([tf.cast(x, tf.float32) for x in pass_losses])
                    part_loss += pass_total / (num_replicas * accumulate)
                penalty = weight_penalty(trained) if k == 0 else None
                if penalty is not None:
                    # The weights' penalty is every replica's whole term, once per step: the SUM all-reduce would
                    # count it once per replica.
                    part_loss += penalty / num_replicas
                scaled = part_loss * loss_scale.scale if loss_scale else part_loss
            part_grads = [
                tf.zeros_like(p) if g is None else tf.convert_to_tensor(g)
                for p, g in zip(params, tape.gradient(scaled, params))
            ]
            grads = part_grads if grads is None else [g + d for g, d in zip(grads, part_grads)]
            loss += part_loss
        return loss, grads, values

    def new_values(grads, new_state):
        current = [tf.convert_to_tensor(v) for v in assigned]  # every variable read once
        now_params, rest = current[: len(params)], iter(current[len(params) :])
        now_slots = [[next(rest) for _ in range(count)] for count in slot_counts]
        iterations = next(rest)
        for _ in state:  # the statistics' new values come from the forward pass
            next(rest)
        now_ema = [next(rest) for _ in ema]
        grads, grad_norm, finite = process_gradients(grads, loss_scale.scale if loss_scale else None, config)
        new_params, new_slots, rates = optimizer.updates(now_params, now_slots, iterations, grads)
        updated = new_params + [s for param_slots in new_slots for s in param_slots] + [iterations + 1] + new_state
        # --ema_decay warmed up by the update count t, as TensorFlow's ExponentialMovingAverage(num_updates) and
        # Model Garden do: min(D, (1 + t) / (10 + t)). A fixed D from the first update would leave D**t of the
        # initial weights in the average that evaluation and export use.
        t = tf.cast(iterations + 1, tf.float32)
        decay = tf.minimum(config.ema_decay, (1.0 + t) / (10.0 + t))
        updated += [decay * average + (1.0 - decay) * p for average, p in zip(now_ema, new_params)]
        if loss_scale:
            # float16: a non-finite step is routine (the scale was too high) and changes nothing but the scale: no
            # weight, slot, update count, statistic or average.
            values = [*(tf.where(finite, u, c) for u, c in zip(updated, current)), *loss_scale.next_state(finite)]
        else:
            # float32 and bfloat16: a non-finite step is divergence, and the loop stops or rolls back to the last
            # checkpoint at the round's end, before anything is saved. Masking every value here would make each
            # update wait for the global norm: 15% of a 1024-wide MLP's step, with XLA or without (bench/RESULTS.md).
            values = updated
        if asynchronous:
            values = [v - c for v, c in zip(values, current)]
        scale = loss_scale.scale.value() if loss_scale else tf.constant(0.0)
        # The rates by optimizer.rate_names: `learning_rate` (a default run's one rate) only where some variable
        # trains with the run's settings, each optimizer group's as `learning_rate/<its regex>`.
        return values, {"grad_norm": grad_norm, "finite": finite, "loss_scale": scale, **rates}

    # One replica (and no parameter server): the whole step, all-reduce and assignments included, is one
    # XLA program, 1.1-1.2x faster than compiling its two halves. Several replicas: only the halves.
    whole = jit_compile and num_replicas == 1 and not asynchronous
    forward_backward = _maybe_jit(forward_backward, jit_compile and not whole)
    new_values = _maybe_jit(new_values, jit_compile and not whole)

    update = _assign_add if asynchronous else _assign

    def assign_all(strategy, values):
        for var, value in zip(assigned, values):
            strategy.extended.update(var, update, args=(value,), group=False)

    def train_step(batch):
        ctx = tf.distribute.get_replica_context()
        replica = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
        loss, grads, new_state = forward_backward(batch, tf.convert_to_tensor(step), replica)
        stop = tf.cast(stop_flag, tf.float32)
        loss, stop, *grads = ctx.all_reduce(SUM, [loss, stop, *grads])  # the one all-reduce of the step
        values, metrics = new_values(grads, new_state)
        ctx.merge_call(assign_all, args=(values,))
        return {"loss": loss, "stop": stop > 0, **metrics}

    return tf.function(train_step, jit_compile=True) if whole else train_step


def make_eval_step(task, models, names):
    """Returns eval_step(batch) -> [sum of weight x metric for each of `names`..., sum of weights], summed over
    all replicas. Padding examples carry weight 0, so every real example counts exactly once."""

    def eval_step(batch):
        weights = batch["weight"]
        values = task.metrics(task.forward(models, batch, training=False), batch)
        sums = [tf.reduce_sum(weights * tf.cast(values[name], tf.float32)) for name in names]
        return tf.distribute.get_replica_context().all_reduce(SUM, tf.stack([*sums, tf.reduce_sum(weights)]))

    return eval_step
