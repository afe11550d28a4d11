"""A train step as a sequence of updates: what each trains, with which optimizer, clipped how, how often.

A task's `updates()` returns them in order (the default: one update, "train", of every trained variable with
the run's optimizer). Each update is one loss over its own forward pass, its variables, its optimizer (rule,
settings, slots and update count), its loss scale in float16 and its clipping; engine/numerics/replica.py runs each as
the
engine's own step: the loss over the GLOBAL batch, one all-reduce, unscale, finite check, clip, masked apply.
A penalty through the input is part of an update's loss (a nested tape inside it). A step the updates cannot say
(SAM's ascent point) a task writes as `replica_step(step, batch)` from the
primitives of engine/numerics/replica.py's ReplicaStep.
"""

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping

import tensorflow as tf

from engine.numerics import optim, precision
from engine.numerics.forward import check_loss
from engine.settings import sections
from engine.settings.errors import ConfigError, TaskError

DEFAULT = "train"  # the one update of a task that defines none; its metrics and checkpoint keep the plain names


@dataclasses.dataclass(frozen=True)
class Update:
    """One update of the step.

    name: its metrics are <name>/loss, <name>/grad_norm, <name>/learning_rate, <name>/loss_scale.
    loss: loss(models, batch, seed) -> per-example float32 losses of the replica's batch, computed in the step's
        training forward pass; `seed` ([2] int64) is this pass's own (seed, step, replica, pass): draw the task's
        noise from it (tf.random.stateless_normal(shape, seed=seed)). None: the task's forward and loss.
    trains: a tuple of model names, or a regex over <model>/<variable path>; (): every trained variable.
    optimizer: settings of this update's optimizer over the run's ({"optimizer": "adamw", "beta_1": 0.5, ...}).
    groups: optimizer groups inside the update, as Task.optimizer_groups.
    clip_norm, clip_value: None: the run's --clip_norm and --clip_value.
    every: applied at the steps whose count of steps before it is a multiple of `every` (its gradients are taken
        at every step, so every replica all-reduces alike; nothing of it changes at the other steps).
    repeat: applied this many times per step, in turn, each time a fresh forward pass over the step's batch (or,
        with `fresh`, a batch of its own). Its loss, when it takes a fourth parameter (`repetition`), is told which.
    fresh: each repetition reads a batch of its own (the WGAN-GP critic's): a step then reads `repeat` batches, the
        first of which every other update uses; the data position counts them all, so a resumed run reads on
        exactly.
    shares: it may train variables an update before it trains too: each keeps its own optimizer slots and update
        count, and the variables' moving averages (--ema_decay) move at each of their applications. Refused unless
        said, as that is seldom what a task means.
    """

    name: str
    loss: Callable | None = None
    trains: str | tuple = ()
    optimizer: dict = dataclasses.field(default_factory=dict)
    groups: tuple = ()
    clip_norm: float | None = None
    clip_value: float | None = None
    every: int = 1
    repeat: int = 1
    fresh: bool = False
    shares: bool = False


@dataclasses.dataclass(frozen=True)
class Clipping:
    clip_norm: float
    clip_value: float


class Plan:
    """One update as built for a run: its Keras variables (in the run's order), their <model>/<path> names, its
    optimizer and loss scale (tf.Modules, checkpointed by the update's name), the moving averages of its
    variables, its clipping, and the prefix of its metrics ("" for a run's only update)."""

    def __init__(self, update, variables, names, averages, optimization, numerics, prefix, what):
        self.update, self.name, self.prefix = update, update.name, prefix
        self.variables, self.names, self.averages = variables, names, averages
        self.ema_decay, self.what = optimization.ema_decay, what
        # Its clipping and optimizer settings over the run's, checked as the flags are (engine/numerics/optim.py).
        clipping = {k: getattr(update, k) for k in ("clip_norm", "clip_value") if getattr(update, k) is not None}
        self.settings = optim.checked_settings(optimization, {**update.optimizer, **clipping}, what)
        self.optimizer = optim.Optimizer(self.settings, [v.value for v in variables], names, update.groups, what)
        # Created in every precision so a checkpoint fits any of them; only float16 uses it.
        self.loss_scale = precision.LossScale(numerics.initial_loss_scale, numerics.loss_scale_growth_interval)
        self.clipping = Clipping(self.settings.clip_norm, self.settings.clip_value)

    @tf.autograph.experimental.do_not_convert
    def targets(self, statistics, float16):
        """The variables one apply assigns, by name: its weights, slots and count, the `statistics` a forward
        pass updates, its moving averages, and its loss scale in float16."""
        targets = {
            "params": [v.value for v in self.variables],
            "slots": self.optimizer.slots,
            "iterations": self.optimizer.iterations,
            "statistics": [v.value for v in statistics],
            "ema": list(self.averages),
        }
        if float16:
            targets["loss_scale"] = {"scale": self.loss_scale.scale, "good_steps": self.loss_scale.good_steps}
        return targets

    @tf.autograph.experimental.do_not_convert
    def new_values(self, grads, finite, when, new_statistics, statistics, float16, asynchronous, step):
        """({name: value} of every variable one apply assigns (targets), its learning rates), from `grads` (the
        all-reduced, clipped gradients), `finite` (theirs), `when` (None, or whether the update is due) and the
        statistics `new_statistics` of `statistics` the step's forward passes left (None: unchanged); pure. Asynchronous
        (parameter servers): the changes, to add."""
        # Every variable read once.
        current = tf.nest.map_structure(tf.convert_to_tensor, self.targets(statistics, float16))
        iterations = current["iterations"]
        new_params, new_slots, rates = self.optimizer.updates(
            current["params"], current["slots"], iterations, grads, step
        )
        # --ema_decay warmed up by the update count t, as TensorFlow's ExponentialMovingAverage(num_updates) and
        # Model Garden do: min(D, (1 + t) / (10 + t)). A fixed D from the first update would leave D**t of the
        # initial weights in the average that evaluation and export use.
        t = tf.cast(iterations + 1, tf.float32)
        decay = tf.minimum(self.ema_decay, (1.0 + t) / (10.0 + t))
        updated = {
            "params": new_params,
            "slots": new_slots,
            "iterations": iterations + 1,
            "statistics": current["statistics"] if new_statistics is None else new_statistics,
            "ema": [decay * average + (1.0 - decay) * p for average, p in zip(current["ema"], new_params)],
        }
        scale = current.pop("loss_scale", None)
        # float16: a non-finite step is routine (the scale was too high) and changes nothing but the scale: no
        # weight, slot, update count, statistic or average. float32 and bfloat16: a non-finite step is divergence,
        # and the loop stops or rolls back to the last checkpoint at the round's end, before anything is saved.
        # Masking every value there would make each update wait for the global norm, a measurable share of the
        # step (bench/RESULTS.md, "2026-11-30: end to end", the table of the step's parts).
        keep = finite if scale is not None else None
        if when is not None:  # an update not due at this step (Update.every, a custom step's `when`)
            keep = when if keep is None else keep & when
        values = updated if keep is None else tf.nest.map_structure(lambda u, c: tf.where(keep, u, c), updated, current)
        if scale is not None:
            grown = dict(zip(("scale", "good_steps"), self.loss_scale.next_state(finite)))
            if when is not None:
                grown = {k: tf.where(when, v, scale[k]) for k, v in grown.items()}
            values, current = {**values, "loss_scale": grown}, {**current, "loss_scale": scale}
        if asynchronous:
            values = tf.nest.map_structure(lambda v, c: v - c, values, current)
        return values, rates

    def effective(self):
        """The settings this update trains with, as config.json and summary.json record them: its rule and the rule's
        settings, its schedule and clipping (the run's where it sets none), how often it applies."""
        names = ("optimizer", "learning_rate", *optim.rule_settings(self.settings.optimizer), "weight_decay")
        names += ("warmup_steps", "lr_schedule", "lr_scaling", "clip_norm", "clip_value")
        # And what its rate reads beside them: without its batches the peak of --lr_scaling=linear is unknown.
        names += ("base_batch_size",) if self.settings.lr_scaling == "linear" else ()
        names += tuple(name for name, (_, reads) in optim.RATE_READS.items() if reads(self.settings))
        settings = {name: getattr(self.settings, name) for name in names}
        update = self.update
        return {**settings, "every": update.every, "repeat": update.repeat, "fresh": update.fresh}

    @property
    def rate_names(self):
        """The learning rates it logs: learning_rate, learning_rate/<group regex>, under its prefix."""
        return [self.prefix + name for name in self.optimizer.rate_names]

    @property
    def metric_names(self):
        """The step's outputs of this update beside `loss`, `finite` and `stop`."""
        own = [f"{self.prefix}loss", f"{self.prefix}finite"] if self.prefix else []
        return [*own, f"{self.prefix}grad_norm", f"{self.prefix}loss_scale", *self.rate_names]


def _check(update, task_file):
    if not isinstance(update, Update):
        raise ConfigError(f"{task_file}: updates() returned {update!r}, not an engine.api.Update")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", update.name or ""):
        raise ConfigError(f"{task_file}: update name {update.name!r}: use letters, digits, '_', '.' or '-'")
    for field in ("every", "repeat"):
        value = getattr(update, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TaskError(f"{task_file}: update {update.name!r}: {field}={value!r}: must be an integer of 1 or more")
    if isinstance(update.trains, str):
        try:
            re.compile(update.trains)
        except re.error as e:
            raise TaskError(
                f"{task_file}: update {update.name!r}: trains={update.trains!r}: not a regular expression ({e})"
            ) from None
    elif not isinstance(update.trains, (tuple, list, set, frozenset)) or not all(
        isinstance(name, str) for name in update.trains
    ):
        raise TaskError(f"{task_file}: update {update.name!r}: trains={update.trains!r}: model names, or a regex")
    what = f"{task_file}: update {update.name!r}"
    if not isinstance(update.optimizer, Mapping):
        raise TaskError(f"{what}: optimizer={update.optimizer!r}: a dict of settings, as {{'optimizer': 'sgd'}}")
    _check_groups(update.groups, f"{what}: groups")
    if update.loss is not None:
        check_loss(update.loss, what)


def _check_groups(groups, what):
    """Optimizer groups, ((regex, {setting: value}), ...): TaskError naming `what` for anything else (a single pair
    without its enclosing tuple, the commonest slip)."""
    pairs = isinstance(groups, (tuple, list)) and all(
        isinstance(g, (tuple, list)) and len(g) == 2 and isinstance(g[0], str) and isinstance(g[1], Mapping)
        for g in groups
    )
    if not pairs:
        raise TaskError(
            f"{what}={groups!r}: must be pairs of (regex, {{setting: value}}), as ((r'^head/', {{'learning_rate': "
            "1e-4}),)"
        )


def _say_overrides(update, optimization, task_file):
    """A warning for each setting an update fixes over a value the run was given (not its default): --optimizer=sgd
    on a task whose updates train with adamw would otherwise be ignored in silence."""
    given_values = optimization.values()
    defaults = {f.name: f.default for f in dataclasses.fields(sections.whole(optimization))}
    for name, value in update.optimizer.items():
        given = given_values.get(name)
        if name in given_values and given != defaults[name] and given != value:
            print(
                f"warning: {task_file}: update {update.name!r} trains with {name}={value}, not --{name}={given}",
                flush=True,
            )


def _selected(update, names, task_file, frozen=()):
    """Indices of the names (<model>/<path>) the update trains; ConfigError for a model name in `trains` that no
    trained variable is of (a misspelt name beside right ones would train nothing of it, unsaid). A model --freeze
    keeps fixed whole (`frozen`: the names it keeps) is not misspelt: the update trains the others."""
    if not (isinstance(update.trains, str) and update.trains):
        trained = list(dict.fromkeys(name.split("/", 1)[0] for name in names))
        fixed = {name.split("/", 1)[0] for name in frozen}
        unknown = [model for model in update.trains if model not in trained and model not in fixed]
        if unknown:
            raise ConfigError(
                f"{task_file}: update {update.name!r} trains={update.trains!r}: no trained model {unknown[0]!r} (the "
                f"models trained: {', '.join(trained)})"
            )
    return _chosen(update, names)


def _chosen(update, names):
    """Indices of the names (<model>/<path>) that the update's `trains` selects."""
    if isinstance(update.trains, str) and update.trains:
        return [i for i, name in enumerate(names) if re.search(update.trains, name)]
    models = tuple(update.trains)
    return [i for i, name in enumerate(names) if not models or name.split("/", 1)[0] in models]


def _check_not_frozen(update, kept, task_file, freeze):
    """ConfigError naming --freeze (`freeze`, as given) where it keeps fixed (`kept`, their names) what `update` would
    train: the flag left it nothing, not the task."""
    if kept:
        more = f" and {len(kept) - 1} more" if kept[1:] else ""
        raise ConfigError(
            f"--freeze={freeze}: keeps fixed every variable that update {update.name!r} of {task_file} trains "
            f"({kept[0]}{more}): it would train nothing; freeze fewer variables"
        )


def build_plans(task, weights, optimization, numerics, task_file):
    """The task's updates built for the run: [Plan], in the order they apply. `weights`: the run's trained variables,
    their <model>/<path> names and their moving averages (--ema_decay, else []); `optimization` and `numerics`: the
    run's sections (config.optimization, config.numerics), each update's settings before its own; `task_file`: the
    task's file, as its messages name it."""
    params, names, averages = weights.variables, weights.names, weights.averages
    optimization, numerics = sections.section(optimization, "optimization"), sections.section(numerics, "numerics")
    updates = task.updates()
    if updates is None or isinstance(updates, (Update, str, bytes, Mapping)) or not isinstance(updates, Iterable):
        raise TaskError(f"{task_file}: updates() returned {updates!r}, not a tuple of engine.api.Update")
    _check_groups(task.optimizer_groups, f"{task_file}: optimizer_groups")
    updates = tuple(updates) or (Update(DEFAULT, groups=task.optimizer_groups),)
    for update in updates:
        _check(update, task_file)
    taken = [u.name for u in updates]
    if len(set(taken)) != len(taken):
        raise ConfigError(f"{task_file}: two updates are named alike ({', '.join(taken)})")
    plans, covered = [], {}
    for update in updates:
        chosen = _selected(update, names, task_file, weights.frozen)
        if not chosen:
            kept = [weights.frozen[i] for i in _chosen(update, weights.frozen)]
            _check_not_frozen(update, kept, task_file, weights.freeze)
            raise ConfigError(
                f"{task_file}: update {update.name!r} trains={update.trains!r} matches no trained variable "
                f"(e.g. {names[0]})"
            )
        shared = [i for i in chosen if i in covered]
        if shared and not update.shares:
            raise TaskError(
                f"{task_file}: updates {covered[shared[0]]!r} and {update.name!r} both train {names[shared[0]]}"
                f"{f' and {len(shared) - 1} more' if shared[1:] else ''}: each would keep its own optimizer slots and "
                f"move its moving average again; say Update({update.name!r}, ..., shares=True) if that is meant"
            )
        covered.update({i: update.name for i in chosen if i not in covered})
        plans.append(
            Plan(
                update,
                [params[i] for i in chosen],
                [names[i] for i in chosen],
                [averages[i] for i in chosen] if averages else [],
                optimization,
                numerics,
                "" if len(updates) == 1 else f"{update.name}/",
                f"{task_file}: update {update.name!r}",
            )
        )
    for update in updates:
        _say_overrides(update, optimization, task_file)
    left = [names[i] for i in range(len(names)) if i not in covered]
    if left:
        print(f"warning: {task_file}: no update trains {left[0]}" + (f" and {len(left) - 1} more" if left[1:] else ""))
    return plans


def effective_settings(plans):
    """{update: the settings it trains with (Plan.effective)} of a run of several updates, as config.json and
    summary.json record them; None for a run of one, whose settings are the run's own."""
    return {plan.name: plan.effective() for plan in plans} if len(plans) > 1 else None


def decaying_rates(plans, train_steps):
    """{logged name: schedule} of the learning rates that decay to 0 at `train_steps` (optim.RATE_READS): the run's,
    an update's or a group's own schedule alike; one that sets its own train_steps ends there, whatever the run's."""
    reads = optim.RATE_READS["train_steps"][1]
    return {
        plan.prefix + name: hp.lr_schedule
        for plan in plans
        for hp, name in zip(plan.optimizer.settings, plan.optimizer.rate_of)
        if reads(hp) and hp.train_steps == train_steps
    }


def batches_per_step(plans):
    """The training batches a step reads: one, or the most repetitions of an update that reads a fresh batch each."""
    return max([plan.update.repeat for plan in plans if plan.update.fresh], default=1)


def checkpointed(plans):
    """The optimizers' and loss scales' part of a checkpoint: a one-update run keeps the names of the runs before
    updates existed (optimizer, loss_scale), so their checkpoints restore; several go by update name."""
    if len(plans) == 1:
        return {"optimizer": plans[0].optimizer, "loss_scale": plans[0].loss_scale}
    return {
        "optimizers": {p.name: p.optimizer for p in plans},
        "loss_scales": {p.name: p.loss_scale for p in plans},
    }
