"""The engine's settings, each with its default, its unit and who reads it, and the Config that adds the
settings every model family, task and bundled source declares in its own file (engine/settings/declared.py).

No TensorFlow here: launch.py reads this before TensorFlow starts, to turn each field into a flag.
`readers` and `applies` answer whether a setting means anything to a run.
"""

import dataclasses
import functools

from engine.settings import plugins, sections
from engine.settings.declared import declared_settings, packages
from engine.settings.plugins import ROOT

STRATEGIES = ("one_device", "mirrored", "multi_worker", "parameter_server", "tpu")
CLUSTER_RESOLVERS = ("tf_config", "slurm", "kubernetes", "tpu")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "adamw", "lamb")
MOMENT_DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("constant", "cosine")
LR_SCALINGS = ("none", "linear")
MODES = ("train", "eval", "continuous_eval", "export", "sample", *plugins.RESEARCH_MODES)
ON_NAN = ("stop", "rollback")
BUNDLED_DATASETS = tuple(plugins.names("dataset"))  # digits, the default, among them
INT64_LIMIT = 2**63  # every integer setting reaches TensorFlow as an int64
SEED_LIMIT = 2**32  # keras.utils.set_random_seed also seeds NumPy's legacy generator, which takes 32 bits
# Logical CPU devices emulate replicas for testing: each adds a copy of every variable and a thread to every step,
# so many of them take long to start and to all-reduce, and far more hang (measured: bench/RESULTS.md, section
# "How many logical CPU devices").
MAX_CPU_DEVICES = 64
MAX_IMAGE_SIZE = 16384  # pixels a side of a decoded image: 3.2 GB as float32 RGB
# --local_workers starts a TensorFlow process per task of its cluster, each with its own runtime and copy of the
# model: at most this many, and no more than this machine's memory holds at their size at start (the RSS of a
# process after its first op, measured with TensorFlow 2.21 on CPU).
MAX_LOCAL_TASKS = 64
LOCAL_TASK_BYTES = 600 * 10**6


class Switch(str):
    """The type of a setting that is "auto" (the engine chooses), "true" or "false". A bool given for it (an
    older run's config.json, a notebook's True) means "true" or "false"."""

    VALUES = ("auto", "true", "false")


# The modes that read a setting of the loop or of evaluation from their own command line: training's (a tuner's
# trials train), evaluation's (eval_split, eval_batch_size; a sidecar stops after --train_steps). Export and sample
# evaluate nothing, on one device (ONE_DEVICE_MODES): the cluster's settings are no part of them.
TRAINING_MODES = ("train", "tune")
EVALUATING_MODES = (*TRAINING_MODES, "eval", "continuous_eval")
STEPPING_MODES = (*EVALUATING_MODES, "ensemble")  # those that run a step of a batch (the ensemble's evaluation too)
ONE_DEVICE_MODES = ("export", "sample")
# Where a run executes: the strategy and its cluster (also what a tuner cannot vary between trials).
CLUSTER = (  # in the order --help lists them; read by no mode of ONE_DEVICE_MODES
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
)

TFDS_NAMES = "tensorflow-datasets"  # the --dataset kind of every name that is not a bundled source
# The settings that select what a run reads: a setting's readers are values of these (applies() below).
SELECTORS = (
    "model",
    "task",
    "dataset",
    "optimizer",
    "lr_scaling",
    "precision",
    "mode",
    "strategy",
    "cluster_resolver",
)  # and actions


def _setting(section, default, help_text, readers=None, shared=()):
    """A field of every run, in `section` (engine/settings/sections.py) and read too by the `shared` sections (the
    schedule
    reads --train_steps). `readers`, {selecting setting: values}, says which runs read it (--momentum:
    {"optimizer": ("sgd",)}); None: every run does. A file that reads it too adds itself in its READS."""
    metadata = {"help": help_text, "section": section, "shared": frozenset(shared)}
    if readers:
        metadata["readers"] = frozenset((selector, value) for selector, values in readers.items() for value in values)
    return dataclasses.field(default=default, metadata=metadata)


# A setting of each section, declared as `name: type = _<section>(default, help[, readers][, shared=...])`.
_run, _loop, _data, _models, _optimization, _numerics, _cluster = (
    functools.partial(_setting, name) for name in sections.SECTIONS
)


@dataclasses.dataclass(frozen=True)
class _RunSettings(sections.Sectioned):
    """The settings every run has; Config below adds each model family's, task's and bundled source's own."""

    # What to do and where.
    mode: str = _run("train", "what to run: " + "|".join(MODES))
    workdir: str = _run("runs/default", "directory for checkpoints, metrics.jsonl, summary.json, TensorBoard")
    checkpoint: str = _run(
        "",
        "eval, export, sample: checkpoint path to use; empty: the latest in --workdir",
        {"mode": ("eval", "export", "sample")},
    )
    export_dir: str = _run(
        "", "export: where to write the SavedModel; empty: <workdir>/export/<step>", {"mode": ("export",)}
    )
    eval_timeout: float = _run(
        600.0, "continuous_eval: stop after this many seconds without a new checkpoint", {"mode": ("continuous_eval",)}
    )

    # Distribution.
    strategy: str = _cluster(
        "",
        "one_device|mirrored|multi_worker|parameter_server|tpu; empty: the cluster's (multi_worker or "
        "parameter_server) where TF_CONFIG or --cluster_resolver gives one (tpu for --cluster_resolver=tpu), else "
        "mirrored over several GPUs or over --num_cpu_devices above 1, else one device",
    )
    num_cpu_devices: int = _cluster(
        1,
        "split the host CPU into this many logical devices (mirrored on a CPU-only machine)",
        {"strategy": ("mirrored", "")},  # one device, workers and servers take one each
    )
    tpu: str = _cluster(
        "",
        "TPU name or grpc:// address for --strategy=tpu; 'local' on a TPU VM",
        {"strategy": ("tpu",), "cluster_resolver": ("tpu",)},
    )
    cluster_resolver: str = _cluster(
        "", "where a cluster comes from: tf_config|slurm|kubernetes|tpu; empty: TF_CONFIG when it is set"
    )
    collective_timeout: float = _cluster(
        10.0,
        "multi-worker and parameter servers: seconds a peer may go silent (no heartbeat, no answer) before the "
        "job stops, naming it as lost",
    )
    connect_timeout: float = _cluster(
        300.0, "seconds to wait at start for every task of a cluster to come up, or for a TPU to answer"
    )
    local_workers: int = _cluster(0, "start this many worker processes on this machine (TF_CONFIG on localhost)")
    local_cluster_network: str = _cluster(
        "loopback",
        "the network of --local_workers' tasks: loopback (a network namespace of their own, holding only loopback; "
        "Linux) or host (this machine's: their servers listen on every interface, unauthenticated)",
    )
    num_ps: int = _cluster(
        1,
        "parameter_server: parameter-server tasks (for --local_workers and Slurm)",
        {"strategy": ("parameter_server",)},
    )
    slurm_port_base: int = _cluster(
        8888, "slurm: first port of the tasks' servers on each node", {"cluster_resolver": ("slurm",)}
    )
    kubernetes_selector: str = _cluster(
        "", "kubernetes: label selector of the worker pods, e.g. job-name=w", {"cluster_resolver": ("kubernetes",)}
    )
    tf_data_service: str = _cluster(  # it carries the training batches alone
        "", "grpc://host:port of a tf.data service dispatcher to preprocess on", {"mode": TRAINING_MODES}
    )

    # Task (tasks/<task>.py): what is trained, its loss and its metrics.
    task: str = _run("classification", "what to train, found as tasks/<task>.py")

    # Model (models/<model>.py). Each family declares its own settings in its file (SETTINGS).
    model: str = _run("", "model family, found as models/<model>.py; empty: the task's own (mlp for most)")
    dropout: float = _models(0.0, "dropout rate in the models that use it, 0 = off", {"model": ()})  # their READS

    # Data.
    dataset: str = _data(
        "",
        "a source of sources/ (--help lists them; those reading your files as "
        + ", ".join(f"{name}:{argument}" for name, (argument, _) in plugins.file_sources().items())
        + ") or any tensorflow-datasets name; empty: the task's own",
    )
    data_dir: str = _data(
        "",
        "tensorflow-datasets directory, outside --workdir: prepared datasets, tfds's download cache (downloads/) "
        "and the preparation lock (<dataset>/.prepare.lock); empty: $TFDS_DATA_DIR or ~/tensorflow_datasets",
    )
    train_split: str = _data("train", "split to train on")
    eval_split: str = _data(
        "test", "split to evaluate on; every example is counted exactly once", {"mode": STEPPING_MODES}
    )
    shuffle_buffer: int = _data(10_000, "training shuffle buffer, in examples")
    interleave_files: int = _data(
        16,
        "streamed splits (files too large for memory): files each input pipeline reads at once, example by "
        "example, shuffled together; a restart reads at most that many files before its position",
    )
    image_size: int = _data(
        0,
        "encoded images (JPEG, PNG; any size): train on random-resized crops of this many pixels a side, "
        "flipped at random; evaluate on the centre crop; 0 = images must already have one shape",
        {"dataset": (TFDS_NAMES,)},  # and the sources that decode images (their READS)
    )

    # Batch and steps.
    global_batch_size: int = _data(
        128, "examples per step over all replicas", {"mode": STEPPING_MODES}, shared=("loop", "optimization")
    )
    eval_batch_size: int = _data(
        0, "examples per evaluation step over all replicas; 0 = global_batch_size", {"mode": EVALUATING_MODES}
    )
    train_steps: int = _loop(
        1000,
        "optimizer steps to train for",
        {"mode": (*TRAINING_MODES, "continuous_eval")},  # the step a sidecar stops after
        shared=("optimization",),
    )
    steps_per_loop: int = _loop(100, "steps per host round trip, run inside one tf.function", {"mode": TRAINING_MODES})
    eval_every: int = _loop(0, "evaluate every this many steps; 0 = only at the end", {"mode": TRAINING_MODES})
    checkpoint_every: int = _loop(
        500, "save a checkpoint every this many steps (and at the end); 0 = only at the end", {"mode": TRAINING_MODES}
    )
    keep_checkpoints: int = _loop(3, "how many recent checkpoints to keep", {"mode": TRAINING_MODES})
    profile_steps: tuple = _loop(
        (),
        "A,B: write a TensorBoard profiler trace of steps A+1..B to <workdir>/profile; empty = off",
        {"mode": TRAINING_MODES},
    )
    save_initial: bool = _loop(
        False,
        "save a checkpoint of step 0 before the first step, kept beside --keep_checkpoints' newest: the initial "
        "weights, to hold a fork's step against",
        {"mode": TRAINING_MODES},
    )
    actions: str = _loop(
        "",
        "comma-separated actions after each round beside the engine's own, each engine/run/actions/<name>.py "
        "(listed under Actions); a task may name its own in ACTIONS",
        {"mode": TRAINING_MODES},
    )
    on_nan: str = _loop(
        "stop",
        "a non-finite loss in float32/bfloat16 (float16: steps skipped at the loss scale's floor): stop, or "
        "rollback to the last checkpoint, discarding every step since it and reading on past their batches",
        {"mode": TRAINING_MODES},
    )

    grad_accum_steps: int = _loop(
        1, "split each replica's batch into this many microbatches whose gradients add up before the one all-reduce"
    )

    # Starting from another run.
    init_checkpoint: str = _models(
        "", "start from these weights (a workdir's latest checkpoint, or a checkpoint path), matched by variable path"
    )
    freeze: str = _models(
        "",
        "regular expression: variables whose <model name>/<path> it matches (model/mlp/dense/) stay fixed, "
        "batch-norm statistics included",
    )

    # Optimizer and learning rate.
    optimizer: str = _optimization("adamw", "sgd|adamw|lamb (engine-owned update rules)")
    learning_rate: float = _optimization(1e-3, "peak learning rate (before --lr_scaling)")
    momentum: float = _optimization(0.9, "sgd: momentum, 0 = plain SGD", {"optimizer": ("sgd",)})
    nesterov: bool = _optimization(False, "sgd: Nesterov momentum", {"optimizer": ("sgd",)})
    beta_1: float = _optimization(0.9, "adamw, lamb: first-moment decay", {"optimizer": ("adamw", "lamb")})
    beta_2: float = _optimization(0.999, "adamw, lamb: second-moment decay", {"optimizer": ("adamw", "lamb")})
    epsilon: float = _optimization(
        1e-7, "adamw, lamb: added to the second-moment root", {"optimizer": ("adamw", "lamb")}
    )
    first_moment_dtype: str = _optimization(
        "float32",
        "adamw, lamb: float32|bfloat16: the dtype the first moment is stored in (bfloat16: half its memory and "
        "traffic, as MaxText's mu_dtype; the update computes in float32 and the second moment stays float32)",
        {"optimizer": ("adamw", "lamb")},
    )
    weight_decay: float = _optimization(
        0.0,
        "decoupled weight decay per step, times the learning rate; kernels and embeddings only, never biases or "
        "normalization weights",
    )
    warmup_steps: int = _optimization(0, "linear warmup from 0 to the peak learning rate, in steps")
    lr_schedule: str = _optimization("constant", "after warmup: constant|cosine (cosine decays to 0 at train_steps)")
    lr_scaling: str = _optimization("none", "none|linear: linear multiplies the learning rate by global/base batch")
    base_batch_size: int = _optimization(
        256, "batch size --learning_rate was tuned for (with --lr_scaling=linear)", {"lr_scaling": ("linear",)}
    )
    clip_norm: float = _optimization(0.0, "clip the all-reduced gradients to this global norm; 0 = off")
    clip_value: float = _optimization(0.0, "clip each all-reduced gradient element to [-v, v]; 0 = off")
    ema_decay: float = _optimization(
        0.0, "keep an exponential moving average of the weights with this decay per step, used to evaluate and export"
    )

    # Numerics.
    precision: str = _numerics("float32", "float32|mixed_float16|mixed_bfloat16")
    initial_loss_scale: float = _numerics(
        2.0**15, "mixed_float16: starting dynamic loss scale", {"precision": ("mixed_float16",)}
    )
    loss_scale_growth_interval: int = _numerics(
        2000, "mixed_float16: double the scale after this many finite steps", {"precision": ("mixed_float16",)}
    )
    jit_compile: Switch = _numerics(
        "auto",
        "compile the replica step and the evaluation's forward pass with XLA: true, false, or auto (the engine "
        "chooses from the model, the precision and the device, and the run's first line says what and why)",
        {"mode": STEPPING_MODES},
    )
    compile_cache: str = _numerics(
        "",
        "directory that keeps XLA's compiled steps for the next run of the same command on this machine, which skips "
        "the compile (a run resumed from a checkpoint included); empty: none. On a disk that does not fill: a "
        "failed write fails the step",
        {"mode": STEPPING_MODES},
    )
    seed: int = _run(0, "seed for initialization, shuffling and dropout", shared=("data",))
    deterministic: bool = _numerics(False, "enable TensorFlow op determinism: same flags, same numbers")
    run_eagerly: bool = _numerics(False, "run the loop and step without graphs (print and pdb work in a task); slow")

    @property
    def per_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.global_batch_size

    @property
    def dataset_name(self) -> str:
        """The dataset the run reads: --dataset, or its task's own where that is empty (a Config not validated)."""
        return self.dataset or plugins.default_dataset(self.task)


_FIELDS, _READS, DECLARATION_ERRORS = declared_settings(
    packages(), ROOT, {f.name for f in dataclasses.fields(_RunSettings)}, sections.RESERVED
)
Config = dataclasses.make_dataclass("Config", _FIELDS, bases=(_RunSettings,), frozen=True)
Config.READ_BY = _READS  # who reads a declared setting besides its owner: their config.own(...) shows it
Config.__module__ = __name__
Config.__doc__ = """Every setting of a run: the engine's (_RunSettings) and those the chosen model, task and source
declare. Frozen; build one with validate(Config(...))."""
FIELD_BY_NAME = {f.name: f for f in dataclasses.fields(Config)}
DECLARED_FIELDS = [f for f in dataclasses.fields(Config) if "bounds" in f.metadata]
# What the memory estimate reads: the one whose default shrinks the estimate most is named when it is too large.
MEMORY_SETTINGS = tuple(f.name for f in DECLARED_FIELDS if f.type in (int, tuple)) + (
    "global_batch_size",
    "eval_batch_size",
)


def show(value):
    """A setting as it is written on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def readers(name):
    """The runs that read setting `name`, as {(selecting setting, value)}: what its declaration says (the
    declaring file, or engine/settings/fields.py's `readers=`) and every file whose READS names it; None: every run."""
    declared = FIELD_BY_NAME[name].metadata.get("readers")
    return None if declared is None else declared | _READS.get(name, set())


def dataset_kind(dataset):
    """The source a --dataset value selects: a bundled one by its name (tfrecord:GLOB is tfrecord's), any other
    name tensorflow-datasets'."""
    kind = dataset.partition(":")[0]
    return kind if kind in BUNDLED_DATASETS else TFDS_NAMES


# The settings only --mode=sample reads, which a task that generates declares (tasks/language_model.py): no train,
# eval or tune run of that task reads them.
SAMPLING = ("sample_length", "sample_prompt", "sample_temperature", "sample_top_k")


def applies(name, config):
    """Whether setting `name` affects a run of `config`: every run's, or one of its readers is selected
    (--resnet_depth means nothing to an MLP, --sequence_length much to any run on shakespeare)."""
    if not read_in_mode(name, config.mode):
        return False
    who = readers(name)
    if who is None:
        return True
    selected = {(selector, getattr(config, selector)) for selector in SELECTORS}
    selected.add(("dataset", dataset_kind(config.dataset)))
    selected.update(("actions", name) for name in plugins.named_actions(config))
    return bool(who & selected)


def read_in_mode(name, mode):
    """Whether a run of --mode=`mode` may read setting `name` at all: the sample_* settings only --mode=sample, an
    action's own only training (the actions run after its rounds), the cluster's no mode that runs on one device."""
    if name in SAMPLING:
        return mode == "sample"
    if FIELD_BY_NAME[name].metadata.get("owner", (None,))[0] == "actions":
        return mode in TRAINING_MODES
    return not (name in CLUSTER and mode in ONE_DEVICE_MODES)


# The engine's settings a data source reads: refused, naming the source, on a dataset that does not read them.
REFUSED_UNLESS_READ = ("image_size",)
