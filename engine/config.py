"""Every setting of a run, its default and its unit, in one frozen dataclass.

`launch.py` turns each field into an absl flag of the same name; tests and
notebooks build a `Config` directly. `validate` checks everything that can be
checked without TensorFlow, so bad input fails before anything is written.
"""

import dataclasses
import importlib.util
import json
import math
import os
import re

import models
import tasks
from engine import sources

STRATEGIES = ("one_device", "mirrored", "multi_worker", "parameter_server", "tpu")
CLUSTER_RESOLVERS = ("tf_config", "slurm", "kubernetes", "tpu")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "adamw", "lamb")
LR_SCHEDULES = ("constant", "cosine")
LR_SCALINGS = ("none", "linear")
MODES = ("train", "eval", "continuous_eval", "export", "sample", "tune", "ensemble")
ON_NAN = ("stop", "rollback")
BUNDLED_DATASETS = ("digits", *sources.available())
INT64_LIMIT = 2**63  # every integer setting reaches TensorFlow as an int64
SEED_LIMIT = 2**32  # keras.utils.set_random_seed also seeds NumPy's legacy generator, which takes 32 bits
# Logical CPU devices emulate replicas for testing: each adds a copy of every variable and a thread to every step
# (measured on 2 cores: 64 take 2.7 s to the first step and 18x the all-reduce time of 8; 100,000 hang).
MAX_CPU_DEVICES = 64
# --local_workers starts a TensorFlow process per task of its cluster, each with its own runtime and copy of the
# model: at most this many, and no more than this machine's memory holds at their size at start (the RSS of a
# process after its first op, measured with TensorFlow 2.21 on CPU).
MAX_LOCAL_TASKS = 64
LOCAL_TASK_BYTES = 600 * 10**6


class ConfigError(ValueError):
    """Bad user input: the message names the flag (or file) and the value."""


class Switch(str):
    """The type of a setting that is "auto" (the engine chooses), "true" or "false". A bool given for it (an
    older run's config.json, a notebook's True) means "true" or "false"."""

    VALUES = ("auto", "true", "false")


TFDS_NAMES = "tensorflow-datasets"  # the --dataset kind of every name that is not a bundled source
# The settings that select what a run reads: a setting's readers are values of these (applies() below).
SELECTORS = ("model", "task", "dataset", "optimizer", "precision", "mode")


def _setting(default, help_text, readers=None):
    """A field of every run. `readers`, {selecting setting: values}, says which runs read it (--momentum:
    {"optimizer": ("sgd",)}); None: every run does. A file that reads it too adds itself in its READS."""
    metadata = {"help": help_text}
    if readers:
        metadata["readers"] = frozenset((selector, value) for selector, values in readers.items() for value in values)
    return dataclasses.field(default=default, metadata=metadata)


_TUNE = {"mode": ("tune",)}
_ENSEMBLE = {"mode": ("ensemble",)}


@dataclasses.dataclass(frozen=True)
class _RunSettings:
    """The settings every run has; Config below adds each model family's, task's and bundled source's own."""

    # What to do and where.
    mode: str = _setting("train", "what to run: " + "|".join(MODES))
    workdir: str = _setting("runs/default", "directory for checkpoints, metrics.jsonl, summary.json, TensorBoard")
    checkpoint: str = _setting(
        "", "eval, export: checkpoint path to use; empty: the latest in --workdir", {"mode": ("eval", "export")}
    )
    export_dir: str = _setting(
        "", "export: where to write the SavedModel; empty: <workdir>/export/<step>", {"mode": ("export",)}
    )
    eval_timeout: float = _setting(
        600.0, "continuous_eval: stop after this many seconds without a new checkpoint", {"mode": ("continuous_eval",)}
    )

    # Distribution.
    strategy: str = _setting(
        "", "one_device|mirrored|multi_worker|parameter_server|tpu; empty: mirrored over all GPUs, else one device"
    )
    num_cpu_devices: int = _setting(
        1, "split the host CPU into this many logical devices (mirrored on a CPU-only machine)"
    )
    tpu: str = _setting("", "TPU name or grpc:// address for --strategy=tpu; 'local' on a TPU VM")
    cluster_resolver: str = _setting(
        "", "where a cluster comes from: tf_config|slurm|kubernetes|tpu; empty: TF_CONFIG when it is set"
    )
    collective_timeout: float = _setting(
        10.0,
        "multi-worker and parameter servers: seconds a peer may go silent (no heartbeat, no answer) before the "
        "job stops, naming it as lost",
    )
    connect_timeout: float = _setting(
        300.0, "seconds to wait at start for every task of a cluster to come up, or for a TPU to answer"
    )
    local_workers: int = _setting(0, "start this many worker processes on this machine (TF_CONFIG on localhost)")
    local_cluster_network: str = _setting(
        "loopback",
        "the network of --local_workers' tasks: loopback (a network namespace of their own, holding only loopback; "
        "Linux) or host (this machine's: their servers listen on every interface, unauthenticated)",
    )
    num_ps: int = _setting(1, "parameter_server: parameter-server tasks (for --local_workers and Slurm)")
    slurm_port_base: int = _setting(8888, "slurm: first port of the tasks' servers on each node")
    kubernetes_selector: str = _setting("", "kubernetes: label selector of the worker pods, e.g. job-name=w")
    tf_data_service: str = _setting("", "grpc://host:port of a tf.data service dispatcher to preprocess on")

    # Task (tasks/<task>.py): what is trained, its loss and its metrics.
    task: str = _setting("classification", "what to train, found as tasks/<task>.py")

    # Model (models/<model>.py). Each family declares its own settings in its file (SETTINGS).
    model: str = _setting("", "model family, found as models/<model>.py; empty: the task's own (mlp for most)")
    dropout: float = _setting(0.0, "dropout rate in the models that use it, 0 = off")

    # Data.
    dataset: str = _setting(
        "", "a bundled dataset (digits, synthetic, ...), or any tensorflow-datasets name; empty: the task's own"
    )
    data_dir: str = _setting(
        "",
        "tensorflow-datasets directory, outside --workdir: prepared datasets, tfds's download cache (downloads/) "
        "and the preparation lock (<dataset>/.prepare.lock); empty: $TFDS_DATA_DIR or ~/tensorflow_datasets",
    )
    train_split: str = _setting("train", "split to train on")
    eval_split: str = _setting("test", "split to evaluate on; every example is counted exactly once")
    shuffle_buffer: int = _setting(10_000, "training shuffle buffer, in examples")
    interleave_files: int = _setting(
        16,
        "streamed splits (files too large for memory): files each input pipeline reads at once, example by "
        "example, shuffled together; a restart reads at most that many files before its position",
    )
    image_size: int = _setting(
        0,
        "encoded images (JPEG, PNG; any size): train on random-resized crops of this many pixels a side, "
        "flipped at random; evaluate on the centre crop; 0 = images must already have one shape",
        {"dataset": (TFDS_NAMES,)},  # and the sources that decode images (their READS)
    )

    # Batch and steps.
    global_batch_size: int = _setting(128, "examples per step over all replicas")
    eval_batch_size: int = _setting(0, "examples per evaluation step over all replicas; 0 = global_batch_size")
    train_steps: int = _setting(1000, "optimizer steps to train for")
    steps_per_loop: int = _setting(100, "steps per host round trip, run inside one tf.function")
    eval_every: int = _setting(0, "evaluate every this many steps; 0 = only at the end")
    checkpoint_every: int = _setting(
        500, "save a checkpoint every this many steps (and at the end); 0 = only at the end"
    )
    keep_checkpoints: int = _setting(3, "how many recent checkpoints to keep")
    profile_steps: tuple = _setting(
        (), "A,B: write a TensorBoard profiler trace of steps A+1..B to <workdir>/profile; empty = off"
    )
    on_nan: str = _setting(
        "stop",
        "a non-finite loss in float32/bfloat16 (float16: steps skipped at the loss scale's floor): stop, or "
        "rollback to the last checkpoint, discarding every step since it and reading on past their batches",
    )

    grad_accum_steps: int = _setting(
        1, "split each replica's batch into this many microbatches whose gradients add up before the one all-reduce"
    )

    # Starting from another run.
    init_checkpoint: str = _setting(
        "", "start from these weights (a workdir's latest checkpoint, or a checkpoint path), matched by variable path"
    )
    freeze: str = _setting(
        "",
        "regular expression: variables whose <model name>/<path> it matches (model/mlp/dense/) stay fixed, "
        "batch-norm statistics included",
    )

    # Optimizer and learning rate.
    optimizer: str = _setting("adamw", "sgd|adamw|lamb (engine-owned update rules)")
    learning_rate: float = _setting(1e-3, "peak learning rate (before --lr_scaling)")
    momentum: float = _setting(0.9, "sgd: momentum, 0 = plain SGD", {"optimizer": ("sgd",)})
    nesterov: bool = _setting(False, "sgd: Nesterov momentum", {"optimizer": ("sgd",)})
    beta_1: float = _setting(0.9, "adamw, lamb: first-moment decay", {"optimizer": ("adamw", "lamb")})
    beta_2: float = _setting(0.999, "adamw, lamb: second-moment decay", {"optimizer": ("adamw", "lamb")})
    epsilon: float = _setting(1e-7, "adamw, lamb: added to the second-moment root", {"optimizer": ("adamw", "lamb")})
    weight_decay: float = _setting(0.0, "decoupled weight decay per step, times the learning rate; kernels only")
    warmup_steps: int = _setting(0, "linear warmup from 0 to the peak learning rate, in steps")
    lr_schedule: str = _setting("constant", "after warmup: constant|cosine (cosine decays to 0 at train_steps)")
    lr_scaling: str = _setting("none", "none|linear: linear multiplies the learning rate by global/base batch")
    base_batch_size: int = _setting(256, "batch size --learning_rate was tuned for (with --lr_scaling=linear)")
    clip_norm: float = _setting(0.0, "clip the all-reduced gradients to this global norm; 0 = off")
    clip_value: float = _setting(0.0, "clip each all-reduced gradient element to [-v, v]; 0 = off")
    ema_decay: float = _setting(
        0.0, "keep an exponential moving average of the weights with this decay per step, used to evaluate and export"
    )

    # Tuning and ensembles.
    tune_space: str = _setting(
        "", "tune: search-space file, one 'flag type range' line per flag (experiments/*.space)", _TUNE
    )
    tune_trials: int = _setting(
        20, "tune: complete or pruned trials the study runs to; a resumed study runs the rest", _TUNE
    )
    tune_objective: str = _setting(
        "", "tune: metric the task reports on --validation_split to optimize; empty: the task's objective", _TUNE
    )
    tune_direction: str = _setting(
        "", "tune: max|min the objective; empty: the task's direction (another --tune_objective must say it)", _TUNE
    )
    tune_sampler: str = _setting("tpe", "tune: random|tpe (Bayesian, tree-structured Parzen)|gp (needs PyTorch)", _TUNE)
    tune_pruner: str = _setting(
        "hyperband",
        "tune: stops bad trials from their --eval_every evaluations: none|median|successive_halving|hyperband",
        _TUNE,
    )
    tune_startup_trials: int = _setting(
        5, "tune: trials drawn at random (and never pruned by median) before the search learns", _TUNE
    )
    tune_timeout: float = _setting(
        0.0, "tune: seconds after which no new trial starts (a running one ends); 0 = none", _TUNE
    )
    tune_storage: str = _setting(
        "", "tune: SQLAlchemy URL of the study, to share one across machines; empty: sqlite <workdir>/study.db", _TUNE
    )
    tune_study: str = _setting("tune", "tune: name of the study in --tune_storage", _TUNE)
    validation_split: str = _setting(
        "validation",
        "tune, ensemble: split that scores trials and fits ensemble weights; never the test split",
        {"mode": ("tune", "ensemble")},
    )
    members: str = _setting(
        "", "ensemble: comma-separated workdirs of trained runs and .npz files of other models' predictions", _ENSEMBLE
    )
    ensemble_search: str = _setting(
        "nelder_mead", "ensemble: how weights on the simplex are fitted on validation: nelder_mead|random", _ENSEMBLE
    )
    ensemble_samples: int = _setting(
        2000, "ensemble, random: weight vectors drawn uniformly from the simplex", _ENSEMBLE
    )
    ensemble_mean: str = _setting(
        "arithmetic", "ensemble: how members' probabilities combine: arithmetic|geometric (normalized)", _ENSEMBLE
    )

    # Numerics.
    precision: str = _setting("float32", "float32|mixed_float16|mixed_bfloat16")
    initial_loss_scale: float = _setting(
        2.0**15, "mixed_float16: starting dynamic loss scale", {"precision": ("mixed_float16",)}
    )
    loss_scale_growth_interval: int = _setting(
        2000, "mixed_float16: double the scale after this many finite steps", {"precision": ("mixed_float16",)}
    )
    jit_compile: Switch = _setting(
        "auto",
        "compile the replica step with XLA: true, false, or auto (the engine chooses from the model, the precision "
        "and the device, and the run's first line says what and why)",
    )
    seed: int = _setting(0, "seed for initialization, shuffling and dropout")
    deterministic: bool = _setting(False, "enable TensorFlow op determinism: same flags, same numbers")
    run_eagerly: bool = _setting(False, "run the loop and step without graphs (print and pdb work in a task); slow")

    @property
    def per_eval_batch_size(self):
        return self.eval_batch_size or self.global_batch_size


_TYPES = {bool: bool, int: int, float: float, str: str, tuple: tuple}


def declared_settings(packages, root, engine_names):
    """The settings each model family, task and bundled source declares in its own file, and who else reads them.

    A file declares its own settings as `SETTINGS = {"name": (default, "help")}`, `(default, "help", (low, high))`
    for a number's range, or `(default, "help", "required")` for a string that must be given: --resnet_depth is
    resnet's, read by runs of --model=resnet. A file that reads a setting another file declares (shakespeare
    reads language_model's --sequence_length, folder the engine's --image_size) names it in its own
    `READS = ("name", ...)`, so a run that selects it depends on that setting too. `packages` is
    ((selecting setting, directory, module names), ...); `engine_names` the engine's own settings.

    Returns (fields for the Config, {setting: {(selecting setting, module) of each READS}}, errors): a name two
    files declare, or that a READS names and nobody declares, is a fork's mistake, one line naming the files,
    which validate() refuses, so every command fails with it instead of importing a broken Config."""
    owners = dict.fromkeys(engine_names, "engine/config.py")
    fields, reads, errors = [], {}, []
    files = [
        (flag, module, os.path.join(directory, f"{module}.py"))
        for flag, directory, names in packages
        for module in names
    ]
    for flag, module, path in files:
        where = os.path.relpath(path, root)
        declared = models.read_constant(path, "SETTINGS", {})
        if not isinstance(declared, dict):
            errors.append(f"{where}: SETTINGS must be a dict of name: (default, help), not {type(declared).__name__}")
            continue
        for name, declaration in declared.items():
            if name in owners:
                errors.append(
                    f"{where}: declares the setting {name}, which {owners[name]} declares already: rename one of them"
                )
                continue
            if not (isinstance(declaration, tuple) and 2 <= len(declaration) <= 3 and type(declaration[0]) in _TYPES):
                errors.append(
                    f'{where}: SETTINGS[{name!r}] must be (default, "help"[, range or "required"]) with a '
                    "bool, int, float, str or tuple default"
                )
                continue
            owners[name] = where
            default, help_text, *bounds = declaration
            metadata = {"help": f"{module}: {help_text}", "bounds": bounds[0] if bounds else None}
            metadata.update(owner=(flag, module), readers=frozenset({(flag, module)}))
            fields.append((name, _TYPES[type(default)], dataclasses.field(default=default, metadata=metadata)))
    for flag, module, path in files:
        where = os.path.relpath(path, root)
        named = models.read_constant(path, "READS", ())
        if not (isinstance(named, (tuple, list)) and all(isinstance(name, str) for name in named)):
            errors.append(f"{where}: READS must be a tuple of setting names, not {named!r}")
            continue
        for name in named:
            if name not in owners:
                errors.append(f"{where}: READS {name}, which no file declares")
                continue
            reads.setdefault(name, set()).add((flag, module))
    return fields, reads, errors


def _packages():
    return [
        (flag, os.path.dirname(os.path.abspath(package.__file__)), package.available())
        for flag, package in (("model", models), ("task", tasks), ("dataset", sources))
    ]


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FIELDS, _READS, DECLARATION_ERRORS = declared_settings(
    _packages(), _ROOT, {f.name for f in dataclasses.fields(_RunSettings)}
)
Config = dataclasses.make_dataclass("Config", _FIELDS, bases=(_RunSettings,), frozen=True)
Config.__module__ = __name__
Config.__doc__ = """Every setting of a run: the engine's (_RunSettings) and those the chosen model, task and source
declare. Frozen; build one with validate(Config(...))."""
_DECLARED = [f for f in dataclasses.fields(Config) if "bounds" in f.metadata]
# What the memory estimate reads: the one whose default shrinks the estimate most is named when it is too large.
MEMORY_SETTINGS = tuple(f.name for f in _DECLARED if f.type in (int, tuple)) + ("global_batch_size", "eval_batch_size")


def _check_declared(config):
    """The declared settings of the chosen model, task and source: numbers positive (or in their declared range),
    lists of positive integers, "required" strings given. What only the module can judge (a depth of 6n+2) it
    raises when it builds."""
    for field in _DECLARED:
        if not applies(field.name, config):
            continue
        value, bounds = getattr(config, field.name), field.metadata["bounds"]
        if field.type is tuple and not (value and min(value) > 0):
            _fail(field.name, value, "must be a list of positive integers, e.g. 64,64")
        if field.type is str and bounds == "required" and not value:
            flag, module = field.metadata["owner"]
            _fail(field.name, value, f"--{flag}={module} needs it ({field.metadata['help'].split(': ', 1)[1]})")
        if field.type in (int, float) and bounds and not bounds[0] <= value <= bounds[1]:
            _fail(field.name, value, f"must be in [{bounds[0]}, {bounds[1]}]")
        if field.type in (int, float) and not bounds and not (value > 0 and math.isfinite(value)):
            _fail(field.name, value, "must be a positive number")


def _fail(flag, value, why):
    raise ConfigError(f"--{flag}={show(value)}: {why}")


def show(value):
    """A setting as it is written on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def first_line(error):
    """The first line of an error's message (a TensorFlow error's own message, without its context)."""
    text = getattr(error, "message", None) or str(error)
    return (text.strip().splitlines() or [type(error).__name__])[0]


def _choice(config, name, choices, allow_empty=False):
    value = getattr(config, name)
    if allow_empty and value == "":
        return
    if value not in choices:
        _fail(name, value, "must be one of " + ", ".join(choices))


def _positive(config, *names):
    for name in names:
        value = getattr(config, name)
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            _fail(name, value, "must be a positive number")


def _non_negative(config, *names):
    for name in names:
        value = getattr(config, name)
        if not value >= 0 or (isinstance(value, float) and not math.isfinite(value)):
            _fail(name, value, "must be zero or positive")


def validate(config):
    """Raises ConfigError naming the first bad setting; returns the config."""
    if DECLARATION_ERRORS:  # two files declare one setting: every command stops on it, naming both
        raise ConfigError(DECLARATION_ERRORS[0])
    _choice(config, "mode", MODES)
    if not config.workdir:
        _fail("workdir", config.workdir, "must name a directory")
    _choice(config, "strategy", STRATEGIES, allow_empty=True)
    _choice(config, "cluster_resolver", CLUSTER_RESOLVERS, allow_empty=True)
    _choice(config, "local_cluster_network", ("loopback", "host"))
    _choice(config, "precision", PRECISIONS)
    _choice(config, "optimizer", OPTIMIZERS)
    _choice(config, "lr_schedule", LR_SCHEDULES)
    _choice(config, "lr_scaling", LR_SCALINGS)
    _choice(config, "on_nan", ON_NAN)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type is Switch and isinstance(value, bool):
            config = dataclasses.replace(config, **{field.name: show(value)})
        elif field.type is Switch and value not in Switch.VALUES:
            _fail(field.name, value, "must be auto, true or false")
        if field.type in (int, tuple) and max(value if field.type is tuple else (value,), default=0) >= INT64_LIMIT:
            _fail(field.name, value, "must be less than 2**63 (TensorFlow's int64)")
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
    if config.seed >= SEED_LIMIT:
        _fail(
            "seed",
            config.seed,
            "must be in [0, 2**32): keras.utils.set_random_seed seeds NumPy with it, which takes 32 bits",
        )
    if config.num_cpu_devices > MAX_CPU_DEVICES:
        _fail(
            "num_cpu_devices",
            config.num_cpu_devices,
            f"must be at most {MAX_CPU_DEVICES}: logical CPU devices emulate replicas, each with a copy of every "
            "variable and a thread in every step",
        )
    if config.train_steps * config.global_batch_size >= INT64_LIMIT:
        _fail(
            "train_steps",
            config.train_steps,
            f"times --global_batch_size={config.global_batch_size} must be less than 2**63: the data stream "
            "numbers its examples in int64",
        )
    if config.slurm_port_base > 65535:
        _fail("slurm_port_base", config.slurm_port_base, "must be a port, in [1, 65535]")
    for name in ("beta_1", "beta_2", "dropout", "ema_decay", "momentum"):
        if not 0 <= getattr(config, name) < 1:
            _fail(name, getattr(config, name), "must be in [0, 1)")
    peak = config.learning_rate * (
        config.global_batch_size / config.base_batch_size if config.lr_scaling == "linear" else 1
    )
    if config.weight_decay * peak >= 1:  # the decay takes weight_decay x the rate of each kernel, per step
        _fail(
            "weight_decay",
            config.weight_decay,
            f"times the peak learning rate ({peak:g}) must be less than 1: each step would take every kernel "
            "to 0 or past it",
        )
    profile = config.profile_steps
    if profile and not (len(profile) == 2 and 0 <= profile[0] < profile[1] <= config.train_steps):
        _fail("profile_steps", profile, f"must be A,B with 0 <= A < B <= --train_steps={config.train_steps}")
    if config.clip_norm and config.clip_value:
        _fail("clip_value", config.clip_value, "choose one of --clip_norm and --clip_value, not both")
    if config.on_nan == "rollback" and not config.checkpoint_every:
        _fail(
            "on_nan",
            config.on_nan,
            "needs --checkpoint_every > 0 (0 saves only at the end, so a rollback would discard every step since the "
            "run started); set --checkpoint_every to the most steps a rollback may discard",
        )
    _check_strategy(config)
    if config.warmup_steps >= config.train_steps and config.lr_schedule == "cosine":
        _fail("warmup_steps", config.warmup_steps, f"must be less than --train_steps={config.train_steps}")
    if config.task not in tasks.available():
        _fail("task", config.task, f"must name a file in tasks/ ({', '.join(tasks.available())})")
    if not config.dataset:
        config = dataclasses.replace(config, dataset=tasks.default_dataset(config.task))
    if not config.model:
        config = dataclasses.replace(config, model=tasks.default_model(config.task))
    if config.freeze:
        try:
            re.compile(config.freeze)
        except re.error as e:
            _fail("freeze", config.freeze, f"not a regular expression ({e})")
    if config.model not in models.available():
        _fail("model", config.model, f"must name a file in models/ ({', '.join(models.available())})")
    _check_dataset_name(config.dataset)
    _check_declared(config)
    for name in REFUSED_UNLESS_READ:
        if getattr(config, name) != _SETTINGS[name].default and not applies(name, config):
            _fail(name, getattr(config, name), f"--dataset={config.dataset} does not read it ({_read_by(name)})")
    check_memory(config)
    if config.tune_objective and not re.fullmatch(r"[\w.\-/]+", config.tune_objective):
        _fail("tune_objective", config.tune_objective, "must name a metric the task reports (e.g. accuracy, loss)")
    _choice(config, "tune_direction", ("max", "min"), allow_empty=True)
    _choice(config, "tune_sampler", ("random", "tpe", "gp"))
    _choice(config, "tune_pruner", ("none", "median", "successive_halving", "hyperband"))
    _choice(config, "ensemble_search", ("nelder_mead", "random"))
    _choice(config, "ensemble_mean", ("arithmetic", "geometric"))
    _positive(config, "tune_trials", "ensemble_samples")
    _non_negative(config, "tune_startup_trials", "tune_timeout")
    if config.mode in ("tune", "ensemble") and config.validation_split.split("[")[0] == "test":
        _fail("validation_split", config.validation_split, "tuning and ensemble fitting never look at the test split")
    if config.mode == "tune" and not config.tune_space:
        _fail("tune_space", "", "--mode=tune needs a search-space file, e.g. experiments/digits_mlp.space")
    if config.mode == "tune" and config.tune_pruner != "none" and not 0 < config.eval_every < config.train_steps:
        _fail(
            "eval_every",
            config.eval_every,
            f"--tune_pruner={config.tune_pruner} judges trials by evaluations "
            f"before the end: must be in [1, --train_steps={config.train_steps})",
        )
    if config.mode == "tune" and config.tune_sampler == "gp" and importlib.util.find_spec("torch") is None:
        _fail("tune_sampler", "gp", "Optuna's Gaussian-process sampler needs PyTorch (pip install torch); or use tpe")
    if config.mode == "ensemble" and len(members(config)) < 2:
        _fail("members", config.members, "--mode=ensemble needs at least two comma-separated members")
    if config.mode == "ensemble" and config.validation_split == config.eval_split:
        _fail("validation_split", config.validation_split, "must differ from --eval_split, the split it reports on")
    return config


def _check_strategy(config):
    """The refusals that depend on the strategy, judged on the one the run will use (planned_strategy), whether
    --strategy, TF_CONFIG or --cluster_resolver chose it."""
    if config.local_workers and config.strategy not in ("multi_worker", "parameter_server"):
        _fail("local_workers", config.local_workers, "needs --strategy=multi_worker or --strategy=parameter_server")
    if config.local_workers:
        _check_local_tasks(config)
    name, origin = _plan(config)
    said = origin if config.strategy else f"the {name} strategy ({origin})"  # the flag, or what chose it
    if name == "parameter_server" and config.precision == "mixed_float16":
        _fail(
            "precision",
            config.precision,
            f"is not supported with {said}: asynchronous "
            "workers cannot share one dynamic loss scale; use mixed_bfloat16 or float32",
        )
    if config.mode == "tune" and name in ("multi_worker", "parameter_server"):  # else each process would tune
        _fail(
            "strategy",
            config.strategy,
            f"--mode=tune runs its trials in one process (one_device, mirrored or tpu), not with {said}: on "
            "several machines start one tuner on each, sharing a study through --tune_storage",
        )
    if name == "tpu" and not config.tpu:
        _fail("tpu", config.tpu, f"{said} needs --tpu=NAME_OR_ADDRESS ('local' on a TPU VM)")
    if name == "tpu" and config.precision == "mixed_float16":
        # An explicit --strategy=tpu keeps the words it has always been refused with.
        computes = "TPUs compute" if config.strategy else f"{said} computes"
        _fail("precision", config.precision, f"{computes} in bfloat16, not float16: use --precision=mixed_bfloat16")


def _check_local_tasks(config):
    """--local_workers starts every task of its cluster here: no more than MAX_LOCAL_TASKS, nor than fit in memory."""
    total = memory_bytes()
    limit = max(1, min(MAX_LOCAL_TASKS, total // LOCAL_TASK_BYTES))
    why = (
        f"at most {limit} fit (each is a TensorFlow process of about {_bytes(LOCAL_TASK_BYTES)}, this machine has "
        f"{_bytes(total)}; the launcher's cap is {MAX_LOCAL_TASKS})"
    )
    if config.local_workers > limit:
        _fail("local_workers", config.local_workers, f"starts {config.local_workers} TensorFlow processes here; {why}")
    if config.strategy == "parameter_server" and 1 + config.local_workers + config.num_ps > limit:
        count = 1 + config.local_workers + config.num_ps
        _fail(
            "num_ps",
            config.num_ps,
            f"with --local_workers={config.local_workers} starts {count} TensorFlow processes here (a chief, "
            f"{config.local_workers} workers, {config.num_ps} parameter servers); {why}",
        )


def _plan(config):
    """(strategy name or None, what chose it): see planned_strategy."""
    if config.strategy:
        return config.strategy, f"--strategy={config.strategy}"
    from engine.launcher import tf_config  # deferred: the launcher imports this module

    cluster = (tf_config() or {}).get("cluster")
    if cluster and "ps" in cluster:
        return "parameter_server", "TF_CONFIG has a 'ps' job"
    if cluster:
        return "multi_worker", "TF_CONFIG has a cluster"
    if config.cluster_resolver in ("tf_config", "slurm", "kubernetes"):
        return "multi_worker", f"--cluster_resolver={config.cluster_resolver}"
    if config.cluster_resolver == "tpu":
        return "tpu", "--cluster_resolver=tpu"
    if config.num_cpu_devices > 1:
        return "mirrored", f"--num_cpu_devices={config.num_cpu_devices}"
    return None, "the devices"


def planned_strategy(config):
    """The strategy a run of `config` will use, as its flags and environment decide it: --strategy; else a cluster
    in TF_CONFIG (parameter_server when it has a 'ps' job, else multi_worker); else --cluster_resolver's (tpu, or
    multi_worker); else mirrored over --num_cpu_devices; None where only the devices decide (mirrored over several
    GPUs, else one_device), which needs TensorFlow: engine/distribute.py's strategy_name completes this.
    Every check that depends on the strategy reads this one answer, before anything starts."""
    return _plan(config)[0]


def _read_by(name):
    """A setting's readers in words: read by --dataset=folder, ... and tensorflow-datasets names."""
    names = sorted(f"--{selector}={value}" for selector, value in readers(name) if value != TFDS_NAMES)
    if ("dataset", TFDS_NAMES) in readers(name):
        names.append("tensorflow-datasets names")
    return "read by " + (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0])


def members(config):
    """--members as a list of workdirs."""
    return [m for m in config.members.split(",") if m]


def _check_dataset_name(name):
    if name.partition(":")[0] in BUNDLED_DATASETS:  # a bundled source, or one that reads its argument (npz:PATH)
        return
    import tensorflow_datasets as tfds  # deferred: importing it costs a second

    try:
        tfds.builder_cls(name.split(":")[0].split("/")[0])
    except Exception:  # tfds raises several kinds for a name it cannot resolve
        _fail(
            "dataset",
            name,
            f"unknown dataset: not bundled ({', '.join(BUNDLED_DATASETS)}) nor a tensorflow-datasets name",
        )


def memory_estimate(config, input_shape=None, num_classes=None):
    """{part: bytes} a run needs at least, from its settings: the model (models.size) with its gradients and
    optimizer slots, the activations of a training batch and of an evaluation batch, synthetic data. A synthetic
    dataset's shape is its settings'; another's unknown shape counts as one value and two classes."""
    if config.dataset == "synthetic":
        input_shape, num_classes = config.synthetic_shape, config.synthetic_classes
    input_shape, num_classes = input_shape or (1, 1, 1), num_classes or 2
    features = math.prod(input_shape)
    parameters, activations = models.size(config, input_shape, num_classes)
    slots = {"sgd": 1 if config.momentum else 0, "adamw": 2, "lamb": 2}[config.optimizer]
    parts = {
        "model, gradients and optimizer slots": 4 * parameters * (2 + slots),
        # The forward pass's activations are kept for the backward pass, which adds their gradients.
        "training batch": 4 * config.global_batch_size * (features + 2 * activations),
        "evaluation batch": 4 * config.per_eval_batch_size * (features + activations),
    }
    if config.dataset == "synthetic":  # both pools, float32 images and int64 labels, and the labelling projection
        examples = config.synthetic_examples + max(1, config.synthetic_examples // 4)
        parts["synthetic data"] = examples * (4 * features + 8) + 4 * features * num_classes
    return parts


def check_memory(config, input_shape=None, num_classes=None):
    """Refuses a run whose memory_estimate exceeds this machine's memory, naming the setting whose default would
    shrink it most (--model when none would: the model does not fit even at its defaults). Host memory: an
    accelerator's is smaller, so a run refused here could not run there either."""
    total = memory_bytes()
    parts = memory_estimate(config, input_shape, num_classes)
    need = sum(parts.values())
    if need <= total:
        return
    default = Config()

    def with_default(name):
        changed = dataclasses.replace(config, **{name: getattr(default, name)})
        return sum(memory_estimate(changed, input_shape, num_classes).values())

    culprit = min(MEMORY_SETTINGS, key=with_default)
    if with_default(culprit) >= need:
        culprit = "model"
    details = ", ".join(f"{part} {_bytes(size)}" for part, size in parts.items() if size)
    _fail(
        culprit,
        getattr(config, culprit),
        f"needs about {_bytes(need)} of memory ({details}), more than this machine's {_bytes(total)}",
    )


def memory_bytes():
    """This machine's memory, or its container's limit where that is lower (a Kubernetes pod's, say)."""
    import psutil  # deferred: only validation needs it

    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():  # v2 writes "max" for none
            total = min(total, int(limit))
    return total


def _bytes(count):
    units = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
    if count >= 1000 ** len(units):
        return f"over 1000 {units[-1]}"
    power = min(int(math.log10(max(count, 1)) // 3), len(units) - 1)
    value = count / 1000**power
    return f"{value:.3g} {units[power]}"


def check_batch(config, num_replicas):
    """The batch checks that need the replica count (known once the strategy exists)."""
    for name in ("global_batch_size", "eval_batch_size"):
        value = getattr(config, name)
        if value and value % num_replicas:
            _fail(name, value, f"must be divisible by the number of replicas ({num_replicas})")
    per_replica = config.global_batch_size // num_replicas
    if per_replica % config.grad_accum_steps:
        _fail(
            "grad_accum_steps",
            config.grad_accum_steps,
            f"must divide each replica's batch ({per_replica} = --global_batch_size={config.global_batch_size} "
            f"over {num_replicas} replica{'s' if num_replicas > 1 else ''})",
        )


# ---- A run's saved settings (workdir/config.json) ----------------------------------------------------------------

# (The sample_* settings are language_model's own, declared in its file: how a trained run is sampled.)
# Where and how a run executes, not what it computes: a run resumes under other values (another strategy or
# cluster size gives the same numbers, tests/test_parity.py), and evaluation takes them from its own command line.
# Where a run executes: the strategy and its cluster (also what a tuner cannot vary between trials).
CLUSTER_SETTINGS = frozenset(
    {
        "strategy",
        "num_cpu_devices",
        "tpu",
        "cluster_resolver",
        "collective_timeout",
        "connect_timeout",
        "local_workers",
        "local_cluster_network",
        "num_ps",
        "slurm_port_base",
        "kubernetes_selector",
    }
)
EXECUTION_SETTINGS = CLUSTER_SETTINGS | frozenset(
    {
        "mode",
        "workdir",
        "checkpoint",
        "export_dir",
        "eval_timeout",
        "sample_length",
        "sample_prompt",
        "sample_temperature",
        "sample_top_k",
        "tf_data_service",
        "data_dir",
        "jit_compile",
        "deterministic",
        "run_eagerly",
    }
)
# When things happen and what is logged: never part of a run's identity.
CADENCE_SETTINGS = frozenset(
    {
        "steps_per_loop",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "profile_steps",
        "on_nan",
        "eval_batch_size",
    }
)
# Settings an evaluation of a trained run takes from its command line when given there (not the default), else
# from the run; --eval_split and --eval_batch_size always come from the command line (default: the test split).
EVALUATION_SETTINGS = ("data_dir", "global_batch_size", "train_steps")
# The settings that make a run's numbers what they are (model, data, optimizer, schedule, seed, batch,
# precision, the split it reports on): a workdir holds one run, so these never change within it. train_steps is
# handled apart: raising it continues a run.
IDENTITY_SETTINGS = tuple(
    f.name
    for f in dataclasses.fields(Config)
    if f.name not in EXECUTION_SETTINGS | CADENCE_SETTINGS | {"train_steps", "members", "validation_split"}
    and not f.name.startswith(("tune_", "ensemble_"))
)

_KINDS = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    tuple: "a list of integers",
    Switch: "auto, true or false",
}


def _is(value, kind):
    if kind is Switch:  # an older run saved jit_compile as a JSON bool
        return isinstance(value, bool) or value in Switch.VALUES
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is tuple:
        return isinstance(value, list) and all(_is(v, int) for v in value)
    return isinstance(value, (int, float) if kind is float else kind)


def from_json(saved, where):
    """A Config from the JSON a run saved, checked like flags; ConfigError `<where>: ...` for anything a flag could
    not hold. Settings this engine no longer has are dropped (a model they changed fails to restore, loudly);
    settings the file lacks take their defaults."""
    if not isinstance(saved, dict):
        raise ConfigError(f"{where}: must be a JSON object of settings, not {type(saved).__name__}")
    kinds = {f.name: f.type for f in dataclasses.fields(Config)}
    values = {}
    for name, value in saved.items():
        if name not in kinds:
            continue
        if not _is(value, kinds[name]):
            raise ConfigError(f"{where}: {name}={json.dumps(value)}: must be {_KINDS[kinds[name]]}")
        values[name] = tuple(value) if kinds[name] is tuple else float(value) if kinds[name] is float else value
    run = Config(**values)
    if not run.dataset and run.task in tasks.available():
        run = dataclasses.replace(run, dataset=tasks.default_dataset(run.task))
    for name in REFUSED_UNLESS_READ:  # an older engine ignored it there: the run is what it was without it
        if not applies(name, run):
            values.pop(name, None)
    try:
        return validate(Config(**values))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_run_config(workdir):
    """The Config a train run saved in workdir/config.json (checked like flags), or None when there is none."""
    import tensorflow as tf  # deferred: this module is read before TensorFlow starts

    path = os.path.join(workdir, "config.json")
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path) as f:
            saved = json.loads(f.read())
    except (tf.errors.OpError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({first_line(e)})") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return from_json(saved, path)


def readers(name):
    """The runs that read setting `name`, as {(selecting setting, value)}: what its declaration says (the
    declaring file, or engine/config.py's `readers=`) and every file whose READS names it; None: every run."""
    declared = _SETTINGS[name].metadata.get("readers")
    return None if declared is None else declared | _READS.get(name, set())


def dataset_kind(dataset):
    """The source a --dataset value selects: a bundled one by its name (tfrecord:GLOB is tfrecord's), any other
    name tensorflow-datasets'."""
    kind = dataset.partition(":")[0]
    return kind if kind in BUNDLED_DATASETS else TFDS_NAMES


def applies(name, config):
    """Whether setting `name` affects a run of `config`: every run's, or one of its readers is selected
    (--resnet_depth means nothing to an MLP, --sequence_length much to any run on shakespeare)."""
    who = readers(name)
    if who is None:
        return True
    selected = {(selector, getattr(config, selector)) for selector in SELECTORS}
    selected.add(("dataset", dataset_kind(config.dataset)))
    return bool(who & selected)


_SETTINGS = {f.name: f for f in dataclasses.fields(Config)}
# The engine's settings a data source reads: refused, naming the source, on a dataset that does not read them.
REFUSED_UNLESS_READ = ("image_size",)


def identity_changes(saved, config):
    """The identity settings that matter to both runs and differ: [(name, value in `saved`, value in `config`)]."""
    return [
        (name, getattr(saved, name), getattr(config, name))
        for name in IDENTITY_SETTINGS
        if getattr(saved, name) != getattr(config, name) and applies(name, saved) and applies(name, config)
    ]


def for_evaluation(config, saved, where):
    """The Config that evaluates or exports the run `saved`: its settings; the command line's execution settings,
    split and eval batch; the command line's non-default EVALUATION_SETTINGS. A non-default identity setting that
    differs from the run's (and matters to its model) is refused: it would rebuild another model than the one
    trained."""
    # validate() gave an empty --dataset and --model the command line's task's own: that is none given either.
    default = dataclasses.replace(
        Config(), dataset=tasks.default_dataset(config.task), model=tasks.default_model(config.task)
    )
    values = {}
    for field in dataclasses.fields(Config):
        name = field.name
        given, theirs = getattr(config, name), getattr(saved, name)
        if name in ("eval_split", "eval_batch_size"):
            values[name] = given
        elif name == "seed" and config.mode == "sample":  # the draws' seed; the weights come from the checkpoint
            values[name] = given
        elif name in EVALUATION_SETTINGS:
            values[name] = given if given != getattr(default, name) else theirs
        elif name in IDENTITY_SETTINGS:
            if given != getattr(default, name) and given != theirs and applies(name, saved):
                raise ConfigError(
                    f"--{name}={show(given)}: {where} was trained with --{name}={show(theirs)}; drop the flag "
                    "(the run is rebuilt from its config.json)"
                )
            values[name] = theirs
        else:
            values[name] = given
    return validate(Config(**values))
