"""Engine-owned optimizers and the learning-rate schedule.

Each rule is a pure function from (parameter, gradient, slots) to their new
values, so the step can apply every update masked by the all-reduced finite
flag (float16's skipped steps). The rules reproduce Keras 3's SGD, AdamW and Lamb (tests check parity).
Keras's own optimizers cannot be used in the step: they all-reduce again inside
`apply_gradients` and cannot skip a step for every replica at once.
"""

import dataclasses
import math
import re

import tensorflow as tf

from engine.settings import checks, sections
from engine.settings.errors import ConfigError, TaskError
from engine.settings.fields import FIELD_BY_NAME, MOMENT_DTYPES, applies, readers
from engine.settings.identity import KINDS, holds
from engine.settings.unread import read_by

# Learning-rate schedules after warmup, by --lr_schedule name: a function of the part of the decay that remains,
# from 1 at the end of warmup to 0 at --train_steps, giving the multiple of the peak rate. A fork adds its schedule
# here (and its name to engine/settings/fields.py's LR_SCHEDULES).
SCHEDULES = {
    "constant": None,
    # 0.5 (1 + cos(pi progress)) written as sin^2 of what remains: 1 + cos cancels in float32 near the end (the
    # last step of 100,000 had rate 0), where the sine of a small angle keeps its digits.
    "cosine": lambda remaining: tf.square(tf.sin(0.5 * math.pi * remaining)),
}


@tf.autograph.experimental.do_not_convert
def learning_rate(optimization, step):
    """Learning rate of the updates of the step that follows `step` steps: scaled peak, linear warmup, decay.
    `optimization`: the run's config.optimization (or a Config, whose section it reads)."""
    hp = sections.section(optimization, "optimization")
    peak = hp.learning_rate
    if hp.lr_scaling == "linear":
        peak *= hp.global_batch_size / hp.base_batch_size  # Goyal et al.: lr grows with the batch
    step = tf.cast(step, tf.float32)
    lr = tf.constant(peak, tf.float32)
    if hp.warmup_steps:
        lr *= tf.minimum(1.0, (step + 1.0) / hp.warmup_steps)
    decay = SCHEDULES[hp.lr_schedule]
    if decay is not None:  # of the decay's steps, the part that remains: 1 at its start, 0 at train_steps
        remaining = (hp.train_steps - step) / (hp.train_steps - hp.warmup_steps)
        lr *= decay(tf.clip_by_value(remaining, 0.0, 1.0))
    return lr


def _sgd(param, grad, slots, lr, t, hp):
    if not slots:
        return param - lr * grad, []
    (velocity,) = slots
    velocity = hp.momentum * velocity - lr * grad
    if hp.nesterov:
        return param + hp.momentum * velocity - lr * grad, [velocity]
    return param + velocity, [velocity]


def _moments(grad, slots, hp):
    m, v = slots
    return m + (grad - m) * (1.0 - hp.beta_1), v + (tf.square(grad) - v) * (1.0 - hp.beta_2)


def _adamw(param, grad, slots, lr, t, hp):
    m, v = _moments(grad, slots, hp)
    alpha = lr * tf.sqrt(1.0 - hp.beta_2**t) / (1.0 - hp.beta_1**t)
    return param - alpha * m / (tf.sqrt(v) + hp.epsilon), [m, v]


def _lamb(param, grad, slots, lr, t, hp):
    m, v = _moments(grad, slots, hp)
    update = (m / (1.0 - hp.beta_1**t)) / (tf.sqrt(v / (1.0 - hp.beta_2**t)) + hp.epsilon)
    param_norm, update_norm = tf.norm(param), tf.norm(update)
    # Layer-wise trust ratio; 1 where either norm is zero (fresh biases, zero updates).
    trust = tf.where((param_norm > 0) & (update_norm > 0), param_norm / update_norm, 1.0)
    return param - trust * lr * update, [m, v]


# The update rules by --optimizer name, and how many slots each keeps per parameter: a fork adds its rule here
# (and its name to engine/settings/fields.py's OPTIMIZERS). Rules and schedules run as written, without autograph (see
# engine/numerics/replica.py): a choice on a tensor is tf.where or tf.cond, not `if`.
RULES = {"sgd": _sgd, "adamw": _adamw, "lamb": _lamb}
SLOTS = {"sgd": 1, "adamw": 2, "lamb": 2}


def _slots(hp):
    return 0 if hp.optimizer == "sgd" and not hp.momentum else SLOTS[hp.optimizer]


def slot_dtypes(hp, dtype):
    """The dtype each slot of a parameter of `dtype` is stored in: its own, but an Adam rule's first moment in
    --first_moment_dtype. Its second moment stays: bfloat16's 8 bits of mantissa would round v's small steps
    (1 - beta_2 of it) away, and the step divides by its root."""
    dtypes = [dtype] * _slots(hp)
    if dtypes and hp.optimizer in ("adamw", "lamb") and hp.first_moment_dtype != "float32":
        dtypes[0] = tf.dtypes.as_dtype(hp.first_moment_dtype)
    return dtypes


def rule_settings(rule):
    """The settings update rule `rule` ("sgd") reads of its own, in the order engine/settings/fields.py declares
    them: those declared with `readers={"optimizer": (..., rule)}`."""
    return [name for name in FIELD_BY_NAME if ("optimizer", rule) in (readers(name) or ())]


# The optimization settings an update's or a group's own value would be read by nothing: {name: whose it is}. A
# group's clipping too: clipping is of an update's whole gradient.
RUNS_ALONE = {"ema_decay": "the run's (--ema_decay: one moving average of every trained variable)"}
UPDATES_ALONE = {
    "clip_norm": "an update's (--clip_norm, or Update(clip_norm=...): clipping is of its whole gradient)",
    "clip_value": "an update's (--clip_value, or Update(clip_value=...): clipping is of its whole gradient)",
}


# The run-wide settings the learning rate reads too (engine/settings/fields.py's `shared`): an update's or a group's own
# value changes its rate alone, and only where its rate reads it; the run trains the flags' steps on the flags' batch
# whatever it says. {name: (where its rate reads it, in words; whether the rate of settings `hp` does)}.
RATE_READS = {
    "global_batch_size": ("--lr_scaling=linear", lambda hp: hp.lr_scaling == "linear"),
    "train_steps": (
        "--lr_schedule=" + "|".join(name for name, decay in SCHEDULES.items() if decay),
        lambda hp: SCHEDULES[hp.lr_schedule] is not None,  # a schedule that decays to 0 at it
    ),
}


def checked_settings(optimization, overrides, what, group=False):
    """The run's optimizer settings (config.optimization) with `overrides` (an optimizer group's, an update's),
    checked like flags: a fork's typo, or a setting that is not its to set (RUNS_ALONE, a `group`'s UPDATES_ALONE),
    is one clear line naming `what` it came from."""
    hp = sections.section(optimization, "optimization")
    unknown = set(overrides) - set(sections.every_setting(hp))
    if unknown:
        raise ConfigError(f"{what}: no setting {', '.join(sorted(unknown))}")
    fixed = {**RUNS_ALONE, **(UPDATES_ALONE if group else {})}
    for name in sorted(set(overrides) & set(fixed)):
        if overrides[name] != getattr(hp, name):  # the value it has already (a copy of the run's settings) is no change
            raise TaskError(f"{what}: {name}={overrides[name]!r}: the setting is {fixed[name]}; nothing reads it here")
    for name in sorted(set(overrides) - set(hp.names)):
        try:
            getattr(hp, name)
        except AttributeError as e:  # another section's setting, which no optimizer reads
            raise ConfigError(f"{what}: {e}") from None
    for name, value in overrides.items():
        kind = FIELD_BY_NAME[name].type
        if not holds(value, kind):
            raise TaskError(f"{what}: {name}={value!r}: must be {KINDS[kind]}")
        # A group may stand still (learning rate 0), unlike a run: every number zero or more, rules by name.
        if name == "optimizer" and value not in RULES:
            raise TaskError(f"{what}: optimizer={value}: must be one of {', '.join(RULES)}")
        if name == "first_moment_dtype" and value not in MOMENT_DTYPES:
            raise TaskError(f"{what}: first_moment_dtype={value}: must be one of {', '.join(MOMENT_DTYPES)}")
        if isinstance(value, (int, float)) and not (value >= 0 and math.isfinite(value)):
            raise TaskError(f"{what}: {name}={value}: must be zero or positive")
    checked = hp.replace(**overrides)
    # Then every check a flag of the run gets (a rate in [0, 1), clip_norm and clip_value not both, a decay the
    # learning rate cannot push past 1), on the run's settings with these: as the flags are refused, so are they.
    whole = sections.whole(checked)
    try:
        probe = dataclasses.replace(whole, learning_rate=whole.learning_rate or 1.0)  # a group may stand still
        checks.check_choices(whole)  # a schedule's name, a scaling's
        checks.check_signs(probe)
        checks.check_limits(probe)
        checks.check_training(whole)  # a warmup that ends before --train_steps
    except ConfigError as e:
        raise TaskError(f"{what}: {str(e).removeprefix('--')}") from None
    _refuse_unread(optimization, overrides, whole, what)
    return checked


def _refuse_unread(optimization, overrides, whole, what):
    """Refuses a setting of `overrides` (a group's, an update's) that its rule or scaling does not read, as the flag
    would be (momentum under adamw, base_batch_size without lr_scaling=linear), and a run-wide one its rate does not
    read (RATE_READS): it would train as if it were not there. A value the run has already is no change."""
    hp = sections.section(optimization, "optimization")
    for name in sorted(overrides):
        if overrides[name] == getattr(hp, name):
            continue
        if not applies(name, whole):
            raise TaskError(f"{what}: {name}={overrides[name]!r}: nothing here reads it ({read_by(name)})")
        if name in RATE_READS and not RATE_READS[name][1](whole):
            raise TaskError(
                f"{what}: {name}={overrides[name]!r}: nothing here reads it (its learning rate does, with "
                f"{RATE_READS[name][0]}; the run's is --{name}={getattr(hp, name)})"
            )


# The last name of a path Keras gives biases and normalization weights, whatever their rank: an attention's bias is
# [heads, head_dim], a norm over two axes has a 2-D gamma, beta or scale.
NOT_DECAYED = ("bias", "beta", "gamma", "scale")


def decays(param, path):
    """Whether --weight_decay decays the parameter at `path`: kernels and embeddings (rank 2 or more), never biases
    or normalization weights."""
    return len(param.shape) >= 2 and path.rsplit("/", 1)[-1] not in NOT_DECAYED


class Optimizer(tf.Module):
    """Slots and update counter of one of the rules above. Create under `strategy.scope()`.

    `paths` name the parameters: slots are checkpointed by them. `groups` (a task's optimizer_groups):
    ((regex, {setting: value}), ...); a parameter whose path matches a group's regex (the first that does) is
    updated with those settings instead of the run's (its own learning rate, rule, weight decay). `what`: whose
    optimizer it is, as a refusal of a group's settings names it.
    """

    def __init__(self, optimization, params, paths, groups=(), what=""):
        super().__init__(name="optimizer")
        optimization = sections.section(optimization, "optimization")
        where = f"{what}: " if what else ""  # whose groups they are, for a message (an update's, in its task's file)
        group_settings = [
            checked_settings(optimization, o, f"{where}optimizer group {pattern!r}", group=True)
            for pattern, o in groups
        ]
        # Each parameter's settings (0: the run's, k: the k-th group's), and the name its learning rate is logged
        # under: the run's `learning_rate`, a group's `learning_rate/<its regex>`.
        chosen = [
            next((k for k, (pattern, _) in enumerate(groups, 1) if re.search(pattern, path)), 0) for path in paths
        ]
        names = ["learning_rate", *(f"learning_rate/{pattern}" for pattern, _ in groups)]
        self.settings = [[optimization, *group_settings][k] for k in chosen]
        self.rate_of = [names[k] for k in chosen]
        # The rates `updates` returns: those some parameter trains with, the run's first, then the groups' in order.
        self.rate_names = [names[k] for k in sorted(set(chosen))]
        for pattern, _ in groups:  # a typo in a group's regex would otherwise train with the run's settings, silently
            if not any(re.search(pattern, path) for path in paths):
                print(f"warning: optimizer group {pattern!r} matches no trained variable (e.g. {paths[0]})", flush=True)
        # Counts applied updates only: a skipped (non-finite) step leaves it unchanged.
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="iterations")
        self.slots_by_path = {
            path: [
                tf.Variable(tf.zeros(p.shape, dtype), trainable=False, name=f"slot{k}")
                for k, dtype in enumerate(slot_dtypes(hp, p.dtype))
            ]
            for path, p, hp in zip(paths, params, self.settings)
        }
        self.paths = list(paths)
        self.decays = [decays(p, path) for p, path in zip(params, paths)]

    @property
    def slots(self):
        """The slot variables, one list per parameter in the order given."""
        return [self.slots_by_path[path] for path in self.paths]

    @tf.autograph.experimental.do_not_convert
    def updates(self, params, slots, iterations, grads, step=None):
        """New parameter and slot values for one step from the values given; pure, nothing is read or assigned.

        `slots` is shaped like `self.slots`; `iterations` this optimizer's applied updates (Adam's bias correction
        counts them); `step` the run's steps before this one, which the learning-rate schedule is a function of:
        an update applied several times a step (repeat), at every k-th step (every) or skipped (float16) follows
        the run's schedule as its every other update does (None: the optimizer used alone, its own count).
        Returns (new_params, new_slots, {name: learning rate} of `rate_names`): the rates the parameters were
        updated with, and no other (a run's own rate is not logged where every parameter trains in a group).
        """
        t = tf.cast(iterations + 1, tf.float32)
        step = iterations if step is None else step
        rates = {}
        new_params, new_slots = [], []
        for param, grad, param_slots, decayed, hp, name in zip(
            params, grads, slots, self.decays, self.settings, self.rate_of
        ):
            if name not in rates:
                rates[name] = learning_rate(hp, step)
            lr = rates[name]
            if decayed and hp.weight_decay:
                param -= param * hp.weight_decay * lr  # decoupled (Loshchilov & Hutter), as Keras
            # Every rule computes in the parameter's dtype; a slot stored narrower is rounded when it is stored.
            stored = [s.dtype for s in param_slots]
            param_slots = [tf.cast(s, param.dtype) for s in param_slots]
            param, param_slots = RULES[hp.optimizer](param, tf.cast(grad, param.dtype), param_slots, lr, t, hp)
            new_params.append(param)
            new_slots.append([tf.cast(s, dtype) for s, dtype in zip(param_slots, stored)])
        return new_params, new_slots, {name: rates[name] for name in self.rate_names}
