"""Every setting of a run, its default and its unit, in one frozen dataclass.

`launch.py` turns each field into an absl flag of the same name; tests and
notebooks build a `Config` directly. `validate` checks everything that can be
checked without TensorFlow, so bad input fails before anything is written.
"""

import dataclasses
import importlib.util
import math

STRATEGIES = ("one_device", "mirrored", "multi_worker", "parameter_server", "tpu")
CLUSTER_RESOLVERS = ("tf_config", "slurm", "kubernetes", "tpu")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "adamw", "lamb")
LR_SCHEDULES = ("constant", "cosine")
LR_SCALINGS = ("none", "linear")
MODES = ("train", "eval", "continuous_eval", "export", "tune", "ensemble")
ON_NAN = ("stop", "rollback")
BUNDLED_DATASETS = ("digits", "synthetic")


class ConfigError(ValueError):
    """Bad user input: the message names the flag (or file) and the value."""


def _setting(default, help_text):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class Config:
    # What to do and where.
    mode: str = _setting("train", "what to run: " + "|".join(MODES))
    workdir: str = _setting("runs/default", "directory for checkpoints, metrics.jsonl, summary.json, TensorBoard")
    checkpoint: str = _setting("", "eval, export: checkpoint path to use; empty: the latest in --workdir")
    export_dir: str = _setting("", "export: where to write the SavedModel; empty: <workdir>/export/<step>")
    eval_timeout: float = _setting(600.0, "continuous_eval: stop after this many seconds without a new checkpoint")

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
    collective_timeout: float = _setting(600.0, "seconds a multi-worker collective waits for a peer before it fails")
    connect_timeout: float = _setting(300.0, "seconds to wait for every task of a cluster to come up at start")
    local_workers: int = _setting(0, "start this many worker processes on this machine (TF_CONFIG on localhost)")
    num_ps: int = _setting(1, "parameter_server: parameter-server tasks (for --local_workers and Slurm)")
    slurm_port_base: int = _setting(8888, "slurm: first port of the tasks' servers on each node")
    kubernetes_selector: str = _setting("", "kubernetes: label selector of the worker pods, e.g. job-name=w")
    tf_data_service: str = _setting("", "grpc://host:port of a tf.data service dispatcher to preprocess on")

    # Model (models/<model>.py). Each family reads only its own fields.
    model: str = _setting("mlp", "model family, found as models/<model>.py")
    hidden_sizes: tuple = _setting((512, 512), "mlp: widths of the hidden layers")
    resnet_depth: int = _setting(20, "resnet: number of layers, 6n+2 (20, 32, 44, 56, 110)")
    resnet_width: int = _setting(16, "resnet: channels of the first stage; stages use 1x, 2x, 4x")
    transformer_layers: int = _setting(2, "transformer: number of encoder blocks")
    transformer_dim: int = _setting(64, "transformer: model width (token embedding size)")
    transformer_heads: int = _setting(4, "transformer: attention heads; must divide transformer_dim")
    transformer_mlp_dim: int = _setting(128, "transformer: hidden width of each block's MLP")
    dropout: float = _setting(0.0, "dropout rate in the models that use it, 0 = off")

    # Data.
    dataset: str = _setting("digits", "digits (bundled), synthetic, or any tensorflow-datasets name")
    data_dir: str = _setting("", "tensorflow-datasets data directory; empty: tfds's default (~/tensorflow_datasets)")
    train_split: str = _setting("train", "split to train on")
    eval_split: str = _setting("test", "split to evaluate on; every example is counted exactly once")
    shuffle_buffer: int = _setting(10_000, "training shuffle buffer, in examples")
    synthetic_shape: tuple = _setting((28, 28, 1), "synthetic: shape of one input example")
    synthetic_classes: int = _setting(10, "synthetic: number of classes")
    synthetic_examples: int = _setting(4096, "synthetic: examples in the training pool (the eval pool is a quarter)")

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
        "a non-finite loss in float32/bfloat16: stop, or rollback to the last checkpoint "
        "and skip the offending batches",
    )

    # Optimizer and learning rate.
    optimizer: str = _setting("adamw", "sgd|adamw|lamb (engine-owned update rules)")
    learning_rate: float = _setting(1e-3, "peak learning rate (before --lr_scaling)")
    momentum: float = _setting(0.9, "sgd: momentum, 0 = plain SGD")
    nesterov: bool = _setting(False, "sgd: Nesterov momentum")
    beta_1: float = _setting(0.9, "adamw, lamb: first-moment decay")
    beta_2: float = _setting(0.999, "adamw, lamb: second-moment decay")
    epsilon: float = _setting(1e-7, "adamw, lamb: added to the second-moment root")
    weight_decay: float = _setting(0.0, "decoupled weight decay per step, times the learning rate; kernels only")
    warmup_steps: int = _setting(0, "linear warmup from 0 to the peak learning rate, in steps")
    lr_schedule: str = _setting("constant", "after warmup: constant|cosine (cosine decays to 0 at train_steps)")
    lr_scaling: str = _setting("none", "none|linear: linear multiplies the learning rate by global/base batch")
    base_batch_size: int = _setting(256, "batch size --learning_rate was tuned for (with --lr_scaling=linear)")
    clip_norm: float = _setting(0.0, "clip the all-reduced gradients to this global norm; 0 = off")
    clip_value: float = _setting(0.0, "clip each all-reduced gradient element to [-v, v]; 0 = off")

    # Tuning and ensembles.
    tune_space: str = _setting("", "tune: search-space file, one 'flag type range' line per flag (experiments/*.space)")
    tune_trials: int = _setting(20, "tune: complete or pruned trials the study runs to; a resumed study runs the rest")
    tune_objective: str = _setting("accuracy", "tune: eval metric on --validation_split to optimize: accuracy|loss")
    tune_direction: str = _setting("", "tune: max|min the objective; empty: max for accuracy, min for loss")
    tune_sampler: str = _setting("tpe", "tune: random|tpe (Bayesian, tree-structured Parzen)|gp (needs PyTorch)")
    tune_pruner: str = _setting(
        "hyperband",
        "tune: stops bad trials from their --eval_every evaluations: none|median|successive_halving|hyperband",
    )
    tune_startup_trials: int = _setting(
        5, "tune: trials drawn at random (and never pruned by median) before the search learns"
    )
    tune_timeout: float = _setting(0.0, "tune: seconds after which no new trial starts (a running one ends); 0 = none")
    tune_storage: str = _setting(
        "", "tune: SQLAlchemy URL of the study, to share one across machines; empty: sqlite <workdir>/study.db"
    )
    tune_study: str = _setting("tune", "tune: name of the study in --tune_storage")
    validation_split: str = _setting(
        "validation", "tune, ensemble: split that scores trials and fits ensemble weights; never the test split"
    )
    members: str = _setting("", "ensemble: comma-separated workdirs of trained runs (different models)")
    ensemble_search: str = _setting(
        "nelder_mead", "ensemble: how weights on the simplex are fitted on validation: nelder_mead|random"
    )
    ensemble_samples: int = _setting(2000, "ensemble, random: weight vectors drawn uniformly from the simplex")

    # Numerics.
    precision: str = _setting("float32", "float32|mixed_float16|mixed_bfloat16")
    initial_loss_scale: float = _setting(2.0**15, "mixed_float16: starting dynamic loss scale")
    loss_scale_growth_interval: int = _setting(2000, "mixed_float16: double the scale after this many finite steps")
    jit_compile: bool = _setting(False, "compile the replica step with XLA")
    seed: int = _setting(0, "seed for initialization, shuffling and dropout")
    deterministic: bool = _setting(False, "enable TensorFlow op determinism: same flags, same numbers")

    @property
    def per_eval_batch_size(self):
        return self.eval_batch_size or self.global_batch_size


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
    _choice(config, "mode", MODES)
    if not config.workdir:
        _fail("workdir", config.workdir, "must name a directory")
    _choice(config, "strategy", STRATEGIES, allow_empty=True)
    _choice(config, "cluster_resolver", CLUSTER_RESOLVERS, allow_empty=True)
    _choice(config, "precision", PRECISIONS)
    _choice(config, "optimizer", OPTIMIZERS)
    _choice(config, "lr_schedule", LR_SCHEDULES)
    _choice(config, "lr_scaling", LR_SCALINGS)
    _choice(config, "on_nan", ON_NAN)
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
        "base_batch_size",
        "initial_loss_scale",
        "loss_scale_growth_interval",
        "shuffle_buffer",
        "synthetic_classes",
        "synthetic_examples",
        "resnet_width",
        "transformer_layers",
        "transformer_dim",
        "transformer_heads",
        "transformer_mlp_dim",
        "keep_checkpoints",
        "eval_timeout",
    )
    _non_negative(
        config,
        "eval_batch_size",
        "eval_every",
        "checkpoint_every",
        "local_workers",
        "momentum",
        "weight_decay",
        "warmup_steps",
        "clip_norm",
        "clip_value",
        "epsilon",
        "seed",
    )
    for name in ("beta_1", "beta_2", "dropout"):
        if not 0 <= getattr(config, name) < 1:
            _fail(name, getattr(config, name), "must be in [0, 1)")
    profile = config.profile_steps
    if profile and not (len(profile) == 2 and 0 <= profile[0] < profile[1] <= config.train_steps):
        _fail("profile_steps", profile, f"must be A,B with 0 <= A < B <= --train_steps={config.train_steps}")
    if config.clip_norm and config.clip_value:
        _fail("clip_value", config.clip_value, "choose one of --clip_norm and --clip_value, not both")
    if config.local_workers and config.strategy not in ("multi_worker", "parameter_server"):
        _fail("local_workers", config.local_workers, "needs --strategy=multi_worker or --strategy=parameter_server")
    if config.strategy == "parameter_server" and config.precision == "mixed_float16":
        _fail(
            "precision",
            config.precision,
            "is not supported with --strategy=parameter_server: asynchronous "
            "workers cannot share one dynamic loss scale; use mixed_bfloat16 or float32",
        )
    if config.strategy == "tpu" and not config.tpu:
        _fail("tpu", config.tpu, "--strategy=tpu needs --tpu=NAME_OR_ADDRESS ('local' on a TPU VM)")
    if config.warmup_steps >= config.train_steps and config.lr_schedule == "cosine":
        _fail("warmup_steps", config.warmup_steps, f"must be less than --train_steps={config.train_steps}")
    if not config.hidden_sizes or min(config.hidden_sizes) <= 0:
        _fail("hidden_sizes", config.hidden_sizes, "must be a list of positive widths, e.g. 1024,1024")
    if not config.synthetic_shape or min(config.synthetic_shape) <= 0:
        _fail("synthetic_shape", config.synthetic_shape, "must be positive dimensions, e.g. 28,28,1")
    if (config.resnet_depth - 2) % 6 or config.resnet_depth < 8:
        _fail("resnet_depth", config.resnet_depth, "must be 6n+2 with n >= 1 (8, 14, 20, 32, 44, 56, 110)")
    if config.transformer_dim % config.transformer_heads:
        _fail("transformer_heads", config.transformer_heads, f"must divide --transformer_dim={config.transformer_dim}")
    if importlib.util.find_spec(f"models.{config.model}") is None or config.model.startswith("_"):
        _fail("model", config.model, f"no such model: models/{config.model}.py does not exist")
    _check_dataset_name(config.dataset)
    _choice(config, "tune_objective", ("accuracy", "loss"))
    _choice(config, "tune_direction", ("max", "min"), allow_empty=True)
    _choice(config, "tune_sampler", ("random", "tpe", "gp"))
    _choice(config, "tune_pruner", ("none", "median", "successive_halving", "hyperband"))
    _choice(config, "ensemble_search", ("nelder_mead", "random"))
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
        _fail("members", config.members, "--mode=ensemble needs at least two comma-separated workdirs")
    if config.mode == "ensemble" and config.validation_split == config.eval_split:
        _fail("validation_split", config.validation_split, "must differ from --eval_split, the split it reports on")
    return config


def members(config):
    """--members as a list of workdirs."""
    return [m for m in config.members.split(",") if m]


def _check_dataset_name(name):
    if name in BUNDLED_DATASETS:
        return
    import tensorflow_datasets as tfds  # deferred: importing it costs a second

    try:
        tfds.builder_cls(name.split(":")[0].split("/")[0])
    except Exception:  # tfds raises several kinds for a name it cannot resolve
        _fail("dataset", name, "unknown dataset: not digits, synthetic, nor a tensorflow-datasets name")


def check_batch(config, num_replicas):
    """The batch checks that need the replica count (known once the strategy exists)."""
    for name in ("global_batch_size", "eval_batch_size"):
        value = getattr(config, name)
        if value and value % num_replicas:
            _fail(name, value, f"must be divisible by the number of replicas ({num_replicas})")
