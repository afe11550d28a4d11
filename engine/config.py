"""Every setting of a run, its default and its unit, in one frozen dataclass.

`launch.py` turns each field into an absl flag of the same name; tests and
notebooks build a `Config` directly. `validate` checks everything that can be
checked without TensorFlow, so bad input fails before anything is written.
"""

import dataclasses
import importlib.util
import math

STRATEGIES = ("one_device", "mirrored", "multi_worker", "tpu")
CLUSTER_RESOLVERS = ("tf_config",)
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "adamw", "lamb")
LR_SCHEDULES = ("constant", "cosine")
LR_SCALINGS = ("none", "linear")
MODES = ("train", "eval", "continuous_eval", "export")
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
    strategy: str = _setting("", "one_device|mirrored|multi_worker|tpu; empty: mirrored over all GPUs, else one device")
    num_cpu_devices: int = _setting(
        1, "split the host CPU into this many logical devices (mirrored on a CPU-only machine)"
    )
    tpu: str = _setting("", "TPU name or grpc:// address for --strategy=tpu; 'local' on a TPU VM")
    cluster_resolver: str = _setting("", "where the cluster comes from: tf_config; empty: TF_CONFIG when it is set")
    collective_timeout: float = _setting(600.0, "seconds a multi-worker collective waits for a peer before it fails")

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
    raise ConfigError(f"--{flag}={_show(value)}: {why}")


def _show(value):
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return value


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
    if config.clip_norm and config.clip_value:
        _fail("clip_value", config.clip_value, "choose one of --clip_norm and --clip_value, not both")
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
    return config


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
