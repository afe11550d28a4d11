"""One evaluation of an update's loss and gradients on a replica, the math before and after the all-reduce: the
forward pass run stateless (what it would update in place, batch-norm statistics, comes back as values; dropout
seeded by step, replica and pass), the per-example loss reduced against the GLOBAL batch with the models' own losses
once, float16's loss scale, gradient accumulation over microbatches; and, after the all-reduce, unscale, the finite
check and clipping (process_gradients). engine/numerics/replica.py puts them together with the all-reduce and the
masked update."""

import inspect
import re

import keras
import tensorflow as tf

from engine.settings.errors import TaskError


def split_statistics(models, freeze=""):
    """(statistics, seeds): the models' non-trainable variables a forward pass updates (batch-norm statistics),
    and their random seed-generator states (Keras names them so), which the step derives instead. A frozen
    model (a teacher) and the statistics whose <model>/<path> matches --freeze keep their values. A variable that
    several models share is listed once, under the first."""
    pattern = re.compile(freeze) if freeze else None
    statistics, seeds, seen = [], [], set()
    for name, model in models.items():
        if not model.trainable:  # only read: nothing of it changes, nothing is assigned
            continue
        for v in model.non_trainable_variables:
            if id(v) in seen:
                continue
            seen.add(id(v))
            if v.path.endswith("seed_generator_state"):
                seeds.append(v)
            elif not (pattern and pattern.search(f"{name}/{v.path}")):
                statistics.append(v)
    return statistics, seeds


def pass_seed(step, replica, draw=0):
    """The seed of one forward pass: (step, replica) for a step's first, folded with `draw` for its later ones."""
    seed = tf.stack([step, replica])
    return seed if draw == 0 else tf.random.experimental.stateless_fold_in(seed, draw)


def takes_repetition(loss):
    """Whether an update's `loss` is told its repetition, loss(models, batch, seed, repetition): it has a fourth
    positional parameter, or one named `repetition` (keyword-only and **kwargs ones are not passed)."""
    positional = [
        p.name
        for p in inspect.signature(loss).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return "repetition" in positional or len(positional) >= 4


def check_loss(loss, what):
    """An update's loss: a callable of (models, batch, seed) or (models, batch, seed, repetition)."""
    if not callable(loss):
        raise TaskError(f"{what}: loss={loss!r}: must be a function loss(models, batch, seed[, repetition])")
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # a builtin without one: called as it is
        return
    try:
        signature.bind(*range(4 if takes_repetition(loss) else 3))  # as the forward pass will call it
    except TypeError:
        raise TaskError(
            f"{what}: loss{signature} is called as loss(models, batch, seed) or loss(models, batch, seed, repetition)"
        ) from None


def check_aligned(values, plan, said, noun):
    """TaskError `<said>: ...` unless `values` (shifts, gradients) are one tensor per variable of update `plan`, in
    order, each of its variable's shape: one of another shape broadcasts over it (a scalar shifts every weight
    alike), and one too few or too many would pair the rest with the wrong variables."""
    order = f"(step.variables({plan.name!r}), in order)"
    if len(values) != len(plan.variables):
        raise TaskError(
            f"{said}: {len(values)} {noun}s for the {len(plan.variables)} variables update {plan.name!r} trains {order}"
        )
    for i, (value, v) in enumerate(zip(values, plan.variables)):
        path = getattr(v, "path", v.name)
        # A tensor's (or IndexedSlices') own static shape: no op is added to the step to read it.
        shape = None if value is None else value.shape if hasattr(value, "shape") else tf.convert_to_tensor(value).shape
        if value is None or shape != v.shape:
            has = "is None" if value is None else f"has shape {shape}"
            raise TaskError(
                f"{said}: {noun} {i} {has}, where its variable {path} has {v.shape}: each {noun} is of its variable's "
                f"shape {order}"
            )


def stateless_forward(
    task, models, batch, statistics, values, seeds, step, replica, draw=0, run=None, weights=(), repetition=0
):
    """The task's training forward pass with nothing assigned, starting from `values` of `statistics`: returns (outputs,
    new values of `statistics`, the losses the pass added: activity regularizers and `add_loss` in a model's call).

    Each seed generator draws from (its own seed, `step`, `replica`, `draw`): every replica of a mirrored or
    multi-worker job gets its own dropout masks, every forward pass of a step (`draw`: its updates, their
    repetitions) its own, and a resumed run draws exactly the masks an uninterrupted one would have.
    (Parameter-server workers all count as replica 0; they differ by the step they read.) `run(models, batch, seed)`
    replaces the task's forward (an update's loss; `seed` its own noise's, apart from the masks'); `weights`:
    (variable, value) pairs the pass reads instead of the variables (SAM's ascent point).
    """
    mapping = [*zip(statistics, values), *weights]
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
            seed = pass_seed(step, -1 - replica, draw)
            outputs = run(models, batch, seed, repetition) if takes_repetition(run) else run(models, batch, seed)
    return outputs, [scope.get_current_value(v) for v in statistics], list(scope.losses)


@tf.autograph.experimental.do_not_convert
def weight_penalty(params, values=None):
    """The sum of the weight regularizers (kernel_regularizer, bias_regularizer) of the trained variables `params`
    (Keras variables), in float32; None where none has one. Evaluated on the variables themselves (or `values`),
    so a tape differentiates it. A frozen variable's penalty is a constant of the loss, left out as Keras leaves
    out a non-trainable layer's."""
    values = [v.value for v in params] if values is None else values
    terms = [tf.cast(v.regularizer(x), tf.float32) for v, x in zip(params, values) if getattr(v, "regularizer", None)]
    return tf.add_n(terms) if terms else None


def owners(models):
    """{id(variable): the model it is named by} of every variable of `models`: a variable that several models share
    (an encoder inside a classifier) is the first one's that holds it, and is trained, counted and averaged once."""
    found = {}
    for name, model in models.items():
        for v in model.variables:
            found.setdefault(id(v), name)
    return found


def accumulation_warning(models, statistics, accumulate):
    """The warning line for --grad_accum_steps with statistics a forward pass updates (batch norm), or None."""
    if accumulate == 1 or not statistics:
        return None
    owner = owners(models)
    names = [f"{owner[id(v)]}/{v.path}" for v in statistics]
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


def checked_loss(per_example, batch, what):
    """The per-example loss as float32; TaskError naming the update (`what`) when it is not one float per example of
    the replica's `batch`: a mean would be logged and trained 1/batch of its size, a loss per class `classes` times."""
    per_example = tf.convert_to_tensor(per_example)
    if not per_example.dtype.is_floating:
        raise TaskError(f"{what}: its loss is {per_example.dtype.name}, not a float: no gradient flows through it")
    size = next(iter(batch.values())).shape[0]
    shape = per_example.shape
    if shape.rank != 1 or (size is not None and shape[0] is not None and shape[0] != size):
        raise TaskError(
            f"{what}: its loss has shape {shape.as_list()}, not one value per example of the replica's batch "
            f"([{size}]): the engine sums it over the global batch; never average or keep other axes"
        )
    return tf.cast(per_example, tf.float32)


_SAID = set()  # (update, variables) no gradient reaches, said once in this process


def forward_backward(setup, plan, batch, step, replica, draw, loss, shift, values, repetition=0):
    """One replica's loss and gradients of `plan`'s update over its batch, before the all-reduce; returns (loss,
    grads, the statistics' new values). `values` of the statistics, or None to read them; `shift`: weights + shift."""
    loop, task, scale = setup.loop, setup.task, plan.loss_scale.scale if setup.float16 else None
    variables, global_batch, accumulate = plan.variables, loop.global_batch_size, loop.grad_accum_steps
    params = [v.value for v in variables]
    at = params if shift is None else [p + tf.cast(s, p.dtype) for p, s in zip(params, shift)]
    weights = () if shift is None else tuple(zip(variables, at))
    values = [v.value for v in setup.statistics] if values is None else values
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
                task, setup.models, part, setup.statistics, values, setup.seeds, step, replica * accumulate + k,
                draw, loss, weights, repetition,
            )  # fmt: skip
            per_example = checked_loss(task.loss(outputs, part) if loss is None else outputs, part, plan.what)
            # Divide by the GLOBAL batch: the SUM all-reduce then gives the mean over all replicas'
            # examples, the same number one device computes, whatever the replica count.
            part_loss = tf.reduce_sum(per_example) / global_batch
            if pass_losses:
                # A pass's own losses are its estimate over the examples it saw (Keras divides an activity
                # penalty by that batch): the mean over the step's num_replicas x accumulate equal passes is the
                # estimate over the global batch, one device's number.
                pass_total = tf.add_n([tf.cast(x, tf.float32) for x in pass_losses])
                part_loss += pass_total / (setup.num_replicas * accumulate)
            penalty = weight_penalty(variables, None if shift is None else at) if k == 0 else None
            if penalty is not None:
                # The weights' penalty is every replica's whole term, once per step: the SUM all-reduce would
                # count it once per replica.
                part_loss += penalty / setup.num_replicas
            scaled = part_loss * scale if scale is not None else part_loss
        found = tape.gradient(scaled, at)
        if all(g is None for g in found):  # a constant, or a loss of other variables: it would train nothing
            raise TaskError(
                f"{plan.what}: its loss does not depend on the variables it trains ({plan.names[0]}"
                f"{f' and {len(plan.names) - 1} more' if plan.names[1:] else ''}): no gradient reaches them"
            )
        unreached = tuple(name for name, g in zip(plan.names, found) if g is None)
        if unreached and (plan.what, unreached) not in _SAID:  # said once, at the first trace: later ones say it again
            _SAID.add((plan.what, unreached))
            print(
                f"warning: {plan.what}: no gradient reaches {unreached[0]}"
                f"{f' and {len(unreached) - 1} more' if unreached[1:] else ''} (its loss does not depend on them): "
                "they train with zero gradients; freeze them (--freeze, model.trainable = False) or leave them out of "
                "the update (Update(trains=...))",
                flush=True,
            )
        part_grads = [tf.zeros_like(p) if g is None else tf.convert_to_tensor(g) for p, g in zip(at, found)]
        grads = part_grads if grads is None else [g + d for g, d in zip(grads, part_grads)]
        total += part_loss
    return total, grads, values
