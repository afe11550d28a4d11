"""The checks of a run's settings that need neither TensorFlow nor this machine, by section, in the order
engine/settings/config.py's validate runs them: each raises ConfigError naming the flag and its value.
"""

import dataclasses
import math
import re
import struct

from engine.settings import plugins
from engine.settings.errors import ConfigError, counted
from engine.settings.fields import (
    BUNDLED_DATASETS,
    CLUSTER_RESOLVERS,
    DECLARED_FIELDS,
    FIELD_BY_NAME,
    INT64_LIMIT,
    LR_SCALINGS,
    LR_SCHEDULES,
    MAX_CPU_DEVICES,
    MAX_IMAGE_SIZE,
    MODES,
    MOMENT_DTYPES,
    ON_NAN,
    OPTIMIZERS,
    PRECISIONS,
    REFUSED_UNLESS_READ,
    SEED_LIMIT,
    STRATEGIES,
    Switch,
    applies,
    show,
)
from engine.settings.unread import read_by


def fail(flag, value, why):
    raise ConfigError(f"--{flag}={show(value)}: {why}")


def _choice(config, name, choices, allow_empty=False):
    value = getattr(config, name)
    if allow_empty and value == "":
        return
    if value not in choices:
        fail(name, value, "must be one of " + ", ".join(choices))


def _positive(config, *names):
    for name in names:
        value = getattr(config, name)
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            fail(name, value, "must be a positive number")


def _non_negative(config, *names):
    for name in names:
        value = getattr(config, name)
        if not value >= 0 or (isinstance(value, float) and not math.isfinite(value)):
            fail(name, value, "must be zero or positive")


# ---- The run and its loop ------------------------------------------------------------------------------------


def check_choices(config):
    """Every setting that names one of a fixed set of choices."""
    _choice(config, "mode", MODES)
    if not config.workdir.strip():  # " " made a folder named so, wherever the run started
        fail("workdir", config.workdir, "must name a directory")
    _choice(config, "strategy", STRATEGIES, allow_empty=True)
    _choice(config, "cluster_resolver", CLUSTER_RESOLVERS, allow_empty=True)
    _choice(config, "local_cluster_network", ("loopback", "host"))
    _choice(config, "precision", PRECISIONS)
    _choice(config, "optimizer", OPTIMIZERS)
    _choice(config, "first_moment_dtype", MOMENT_DTYPES)
    _choice(config, "lr_schedule", LR_SCHEDULES)
    _choice(config, "lr_scaling", LR_SCALINGS)
    _choice(config, "on_nan", ON_NAN)
    for name in (n for n in config.actions.split(",") if n):
        if name not in plugins.names("actions"):
            fail(
                "actions",
                config.actions,
                f"{name} is not a file of engine/run/actions/ ({', '.join(plugins.names('actions'))})",
            )


def check_types(config):
    """Returns the config with a bool given for a Switch as its word; refuses any other Switch value and an
    integer TensorFlow's int64 cannot hold."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type is Switch and isinstance(value, bool):
            config = dataclasses.replace(config, **{field.name: show(value)})
        elif field.type is Switch and value not in Switch.VALUES:
            fail(field.name, value, "must be auto, true or false")
        if field.type in (int, tuple) and max(value if field.type is tuple else (value,), default=0) >= INT64_LIMIT:
            fail(field.name, value, "must be less than 2**63 (TensorFlow's int64)")
    return config


def check_signs(config):
    """The engine's numbers that must be positive, then those that may be zero."""
    _positive(
        config,
        "num_cpu_devices",
        "collective_timeout",
        "connect_timeout",
        "num_ps",
        "slurm_port_base",
        "global_batch_size",
        "train_steps",
        "steps_per_loop",
        "learning_rate",
        "grad_accum_steps",
        "base_batch_size",
        "initial_loss_scale",
        "loss_scale_growth_interval",
        "shuffle_buffer",
        "interleave_files",
        "keep_checkpoints",
        "eval_timeout",
        "epsilon",  # an Adam step divides by the second-moment root plus it: 0 divides by 0 on a zero gradient
    )
    _non_negative(
        config,
        "eval_batch_size",
        "eval_every",
        "checkpoint_every",
        "local_workers",
        "weight_decay",
        "warmup_steps",
        "clip_norm",
        "clip_value",
        "seed",
        "image_size",
    )


def check_limits(config):
    """The upper bounds of the engine's numbers: the seed's 32 bits, the logical devices, an image's side, the
    stream's int64, a port, the rates below 1."""
    if config.seed >= SEED_LIMIT:
        fail(
            "seed",
            config.seed,
            "must be in [0, 2**32): keras.utils.set_random_seed seeds NumPy with it, which takes 32 bits",
        )
    if config.num_cpu_devices > MAX_CPU_DEVICES:
        fail(
            "num_cpu_devices",
            config.num_cpu_devices,
            f"must be at most {MAX_CPU_DEVICES}: logical CPU devices emulate replicas, each with a copy of every "
            "variable and a thread in every step",
        )
    if config.image_size > MAX_IMAGE_SIZE:  # larger, its shape overflowed TensorFlow's (a traceback)
        fail(
            "image_size",
            config.image_size,
            f"must be at most {MAX_IMAGE_SIZE} pixels a side (an image of that size is 3.2 GB as float32 RGB)",
        )
    if config.train_steps * config.global_batch_size >= INT64_LIMIT:
        fail(
            "train_steps",
            config.train_steps,
            f"times --global_batch_size={config.global_batch_size} must be less than 2**63: the data stream "
            "numbers its examples in int64",
        )
    if config.slurm_port_base > 65535:
        fail("slurm_port_base", config.slurm_port_base, "must be a port, in [1, 65535]")
    if config.initial_loss_scale < 1:
        fail(
            "initial_loss_scale",
            config.initial_loss_scale,
            "must be at least 1, the dynamic loss scale's floor (below it float16's small gradients only underflow)",
        )
    for name in ("beta_1", "beta_2", "dropout", "ema_decay", "momentum"):
        if not 0 <= getattr(config, name) < 1:
            fail(name, getattr(config, name), "must be in [0, 1)")
    _check_float32(config)


def _check_float32(config):
    """The step computes in float32: a value that rounds there to what check_limits refuses is refused as it is."""
    # A beta of 1 - 1e-8 is 1.0 there (Adam's bias correction 1 - beta**t divides by 0, or never moves a weight); an
    # epsilon of 1e-50 is 0 (below float32's smallest normal number, flushed to 0 on a CPU: 0 / 0 on a zero
    # gradient); a learning rate or loss scale of 1e39 is inf (an initial scale of inf halves to inf: every step is
    # skipped, and the run ends as if it had trained).
    for name in ("beta_1", "beta_2"):
        if _float32(getattr(config, name)) >= 1:
            fail(
                name,
                getattr(config, name),
                f"rounds to 1 in float32, which the step computes in: at most {_BELOW_1:.8g}",
            )
    for name in ("learning_rate", "epsilon", "initial_loss_scale"):
        value = getattr(config, name)
        if not FLOAT32_TINY <= _float32(value) <= FLOAT32_MAX:
            fail(
                name,
                value,
                f"is {_float32(value):g} in float32, which the step computes in: must be in "
                f"[{FLOAT32_TINY:.8g}, {FLOAT32_MAX:.8g}]",
            )


FLOAT32_TINY = 2.0**-126  # float32's smallest normal number: below it a CPU flushes a value to 0
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127
_BELOW_1 = 1 - 2.0**-24  # the largest float32 below 1, 0.99999994


def _float32(value):
    """`value` as float32 holds it: rounded to the nearest, +-inf past its largest."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


# ---- Optimizer, schedule and the loop's policies ---------------------------------------------------------------


def check_training(config):
    """What the optimizer, its schedule, the profiler and the NaN policy need of the other settings (an update's and
    an optimizer group's settings too: engine/numerics/optim.py checked_settings)."""
    if config.warmup_steps and config.warmup_steps >= config.train_steps:  # its peak at the last step, or never
        fail("warmup_steps", config.warmup_steps, f"must be less than --train_steps={config.train_steps}")
    scale = config.global_batch_size / config.base_batch_size if config.lr_scaling == "linear" else 1
    peak = config.learning_rate * scale
    if _float32(peak) == math.inf:  # every step's update non-finite, blamed on the loss at the first step
        fail(
            "learning_rate",
            config.learning_rate,
            f"scaled by --lr_scaling=linear (x{scale:g}, --global_batch_size={config.global_batch_size} / "
            f"--base_batch_size={config.base_batch_size}) is {peak:g}: inf in float32, which the step computes in",
        )
    if config.weight_decay * peak >= 1:  # the decay takes weight_decay x the rate of each kernel, per step
        fail(
            "weight_decay",
            config.weight_decay,
            f"times the peak learning rate ({peak:g}) must be less than 1: each step would take every kernel "
            "to 0 or past it",
        )
    profile = config.profile_steps
    if profile and not (len(profile) == 2 and 0 <= profile[0] < profile[1] <= config.train_steps):
        fail("profile_steps", profile, f"must be A,B with 0 <= A < B <= --train_steps={config.train_steps}")
    if config.optimizer == "sgd" and config.nesterov and not config.momentum:  # its look-ahead is the momentum's
        fail("nesterov", config.nesterov, "needs --momentum above 0: with --momentum=0 it would train as plain SGD")
    if config.clip_norm and config.clip_value:
        fail("clip_value", config.clip_value, "choose one of --clip_norm and --clip_value, not both")
    if config.on_nan == "rollback" and not config.checkpoint_every:
        fail(
            "on_nan",
            config.on_nan,
            "needs --checkpoint_every > 0 (0 saves only at the end, so a rollback would discard every step since the "
            "run started); set --checkpoint_every to the most steps a rollback may discard",
        )


# ---- Devices and clusters (the strategy a run plans, and what it refuses: engine/settings/strategy.py) -------------


def check_batch(config, num_replicas, training=True):
    """The batch checks that need the replica count (known once the strategy exists). A run that does not train
    (an evaluation) reads only the evaluation's batch: --eval_batch_size, else --global_batch_size."""
    evaluated = "eval_batch_size" if config.eval_batch_size else "global_batch_size"
    for name in ("global_batch_size", "eval_batch_size") if training else (evaluated,):
        value = getattr(config, name)
        if value and value % num_replicas:
            why = "" if training or config.eval_batch_size else ", as the evaluation's batch (give --eval_batch_size)"
            fail(name, value, f"must be divisible by the number of replicas ({num_replicas}){why}")
    if not training:
        return
    per_replica = config.global_batch_size // num_replicas
    if per_replica % config.grad_accum_steps:
        fail(
            "grad_accum_steps",
            config.grad_accum_steps,
            f"must divide each replica's batch ({per_replica} = --global_batch_size={config.global_batch_size} "
            f"over {counted(num_replicas, 'replica')})",
        )


# ---- The task, its model and its data ---------------------------------------------------------------------------


# The settings whose empty value means the task's own (resolve_task): its file's DATASET and MODEL.
TASKS_OWN = ("dataset", "model")


def resolve_task(config):
    """Returns the config with an empty --dataset and --model made the task's own, once the task and --freeze are
    known good; refuses a model that is not a file of models/."""
    if config.task not in plugins.names("task"):
        fail("task", config.task, f"must name a file in tasks/ ({', '.join(plugins.names('task'))})")
    if not config.dataset:
        config = dataclasses.replace(config, dataset=plugins.default_dataset(config.task))
    if not config.model:
        config = dataclasses.replace(config, model=plugins.default_model(config.task))
    if config.freeze:
        try:
            re.compile(config.freeze)
        except re.error as e:
            fail("freeze", config.freeze, f"not a regular expression ({e})")
    if config.model not in plugins.names("model"):
        fail("model", config.model, f"must name a file in models/ ({', '.join(plugins.names('model'))})")
    return config


def check_data(config):
    """The dataset's name, the declared settings of the chosen model, task and source, and the engine's settings
    a source reads given to a dataset that does not read them."""
    _check_dataset_name(config.dataset)
    _check_declared(config)
    for name in REFUSED_UNLESS_READ:
        if getattr(config, name) != FIELD_BY_NAME[name].default and not applies(name, config):
            fail(name, getattr(config, name), f"--dataset={config.dataset} does not read it ({read_by(name)})")


def _check_dataset_name(name):
    kind, colon, _ = name.partition(":")
    if kind in BUNDLED_DATASETS:  # a bundled source, or one that reads its argument (npz:PATH)
        files = plugins.file_sources()
        if colon and kind not in files:  # it would be read without it
            takes = ", ".join(f"{source}:{argument}" for source, (argument, _) in files.items())
            fail(
                "dataset",
                name,
                f"{plugins.file('dataset', kind)} takes no argument after its name (those that do: {takes})",
            )
        return
    import tensorflow_datasets as tfds  # deferred: importing it costs a second

    try:
        tfds.builder_cls(name.split(":")[0].split("/")[0])
    except Exception:  # tfds raises several kinds for a name it cannot resolve
        fail(
            "dataset",
            name,
            f"unknown dataset: not bundled ({', '.join(BUNDLED_DATASETS)}) nor a tensorflow-datasets name",
        )


def _check_declared(config):
    """The declared settings of the chosen model, task, source, action or mode: numbers positive (or in their declared
    range: (low, high), or (low, None) for no upper bound), lists of positive integers, "required" strings given, a
    string among its declared choices (a tuple of strings; "" among them: it may be empty). What only the module can
    judge (a depth of 6n+2) it raises when it builds. Every value is checked whether or not this run reads it (a
    value its owner would refuse is refused here too); "required" only where it is read."""
    for field in DECLARED_FIELDS:
        value, bounds = getattr(config, field.name), field.metadata["bounds"]
        if field.type is tuple and not (value and min(value) > 0):
            fail(field.name, value, "must be a list of positive integers, e.g. 64,64")
        if field.type is str and bounds == "required" and not value and applies(field.name, config):
            flag, module = field.metadata["owner"]
            fail(field.name, value, f"--{flag}={module} needs it ({field.metadata['help'].split(': ', 1)[1]})")
        if field.type is str and isinstance(bounds, tuple) and value not in bounds:
            fail(field.name, value, "must be one of " + ", ".join(choice for choice in bounds if choice))
        if field.type in (int, float) and bounds and bounds[1] is None and not (value >= bounds[0] >= 0):
            fail(field.name, value, "must be zero or positive" if bounds[0] == 0 else f"must be at least {bounds[0]}")
        if field.type in (int, float) and bounds and bounds[1] is not None and not bounds[0] <= value <= bounds[1]:
            fail(field.name, value, f"must be in [{bounds[0]}, {bounds[1]}]")
        if field.type in (int, float) and not bounds and not (value > 0 and math.isfinite(value)):
            fail(field.name, value, "must be a positive number")
