"""Input pipelines: the bundled sources (engine/sources/), the bundled digits and any tensorflow-datasets name.

Every pipeline is a function of `tf.distribute.InputContext`, for
`strategy.distribute_datasets_from_function`. Training reads one global stream of
examples, shuffled per epoch; global batch k is examples [k*G, (k+1)*G) of that stream,
and each input pipeline (one per worker) takes every n-th of them, so a step sees exactly
the examples one device would. The stream is a pure function of the batch index, so a
restored run starts at its data position and reads what an uninterrupted one would.
Evaluation pads with weight-0 examples so every real example is counted exactly once.

A tensorflow-datasets dataset is prepared once into --data_dir (tfds's default when empty), outside --workdir:
the prepared files, tfds's download cache (<data_dir>/downloads) and the lock that lets one process of a job
prepare it (<data_dir>/<dataset>/.prepare.lock).
"""

import contextlib
import dataclasses
import fcntl
import importlib
import math
import os
import socket
import urllib.parse
import urllib.request

import tensorflow as tf
import tensorflow_datasets as tfds

import engine.digits  # noqa: F401  (registers the bundled `digits` builder with tfds)
import tasks
from engine import sources
from engine.config import ConfigError, check_memory, first_line

AUTOTUNE = tf.data.AUTOTUNE
_IN_MEMORY_LIMIT_BYTES = 1 << 30  # splits below this are held as tensors and batched with one gather


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a source: `examples` dicts of features, in a fixed order."""

    examples: int
    make: object  # () -> dataset of example dicts, in order
    fetch: object = None  # int64 indices [n] -> {feature: [n, ...]}: random access, when held in memory


def in_memory(arrays):
    """A Split of {feature: tensor of examples x ...} held in memory: batches are gathered, not iterated."""
    examples = int(next(iter(arrays.values())).shape[0])
    return Split(
        examples,
        lambda: tf.data.Dataset.from_tensor_slices(arrays),
        lambda indices: {name: tf.gather(values, indices) for name, values in arrays.items()},
    )


@dataclasses.dataclass(frozen=True)
class Source:
    """What a dataset gives: its splits, the spec of one example ({feature: tf.TensorSpec}, static shapes) and
    what it knows about them (`num_classes` of a `label`, a text's `vocabulary`, ...). An evaluation example may
    carry a float32 `weight`, how much it counts in the means (default 1)."""

    train: Split
    evals: Split
    spec: dict
    info: dict


@dataclasses.dataclass(frozen=True)
class Data:
    # (InputContext, start_batch, stream) -> endless dataset of per-replica batches: {feature: tensor} after the
    # task's `prepare`, plus `index`, each example's position in the global training stream (seeds per example).
    train_fn: object
    # InputContext -> finite dataset of eval_steps batches: the prepared features, `index` (the position in the
    # split) and `weight` (1 for an example, 0 for padding).
    eval_fn: object
    eval_steps: int  # evaluation steps that cover every evaluation example once
    eval_examples: int
    train_examples: int
    task: object  # the run's tasks/<name>.py Task
    spec: dict  # {feature: tf.TensorSpec} of one prepared example


def task_class(config):
    """tasks/<config.task>.py's Task class."""
    return importlib.import_module(f"tasks.{config.task}").Task


def load(config, split=None):
    """The Data for `config` (evaluating `split`, default --eval_split); raises ConfigError for an unknown split
    or an unusable dataset."""
    cls = task_class(config)
    source = load_source(config, cls.features, split)
    task = cls(config, source.spec, source.info)
    train, evals = source.train, source.evals
    if train.examples < config.global_batch_size:
        raise ConfigError(
            f"--global_batch_size={config.global_batch_size}: larger than the "
            f"{train.examples} examples of --train_split={config.train_split}"
        )
    eval_steps = math.ceil(evals.examples / config.per_eval_batch_size)

    def prepare(batch):
        # The task sees its features; the engine's own (index, weight) pass around it.
        own = {k: batch[k] for k in ("index", "weight") if k in batch}
        return {**task.prepare({k: v for k, v in batch.items() if k not in own}), **own}

    one = tf.data.Dataset.from_tensors({k: tf.zeros([1, *s.shape], s.dtype) for k, s in source.spec.items()})
    task.spec = {k: tf.TensorSpec(s.shape[1:], s.dtype) for k, s in one.map(prepare).element_spec.items()}
    input_spec = task.spec.get(task.input)
    try:
        outputs = task.outputs
    except NotImplementedError:  # a task that builds its own models
        outputs = None
    check_memory(config, tuple(input_spec.shape) if input_spec else None, outputs)

    def train_fn(ctx, start_batch=0, stream=0):
        """Per-replica batches from global batch `start_batch` on. `stream` > 0 gives an independent order (each
        parameter-server worker reads its own)."""
        ds = batches(ctx, start_batch, stream)
        if config.tf_data_service:
            # The service's workers build the batches; each is built once (dynamic sharding), but they
            # arrive in the order the service's workers finish them, not always the stream's.
            ds = ds.apply(
                tf.data.experimental.service.distribute(
                    processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
                    service=config.tf_data_service,
                    job_name=f"train-{ctx.input_pipeline_id}-{stream}-{start_batch}",
                )
            )
        return ds.prefetch(AUTOTUNE)

    def batches(ctx, start_batch, stream):
        per_replica = ctx.get_per_replica_batch_size(config.global_batch_size)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        if train.fetch is None:
            ds = _streamed(train, config, start_example=start_batch * config.global_batch_size, stream=stream)
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            return ds.batch(per_replica, drop_remainder=True).map(prepare, num_parallel_calls=AUTOTUNE)
        n = train.examples

        def global_batch(k):
            # This pipeline's share of global batch k: every n-th position of the stream.
            positions = k * config.global_batch_size + tf.range(
                ctx.input_pipeline_id, config.global_batch_size, ctx.num_input_pipelines, dtype=tf.int64
            )
            epoch, within = positions // n, positions % n
            seeds = tf.stack(
                [
                    tf.fill(tf.shape(epoch), tf.constant(config.seed, tf.int64)),
                    epoch,
                    tf.fill(tf.shape(epoch), tf.cast(stream, tf.int64)),
                ],
                axis=1,
            )
            # Epoch e's permutation, element by element. The raw op: tf.random.experimental.index_shuffle
            # mis-pads a batch of seeds.
            order = tf.raw_ops.RandomIndexShuffle(index=within, seed=seeds, max_index=n - 1, rounds=4)
            batch = prepare({**train.fetch(order), "index": positions})
            if local_replicas == 1:
                return batch
            return {k: tf.reshape(v, [local_replicas, per_replica, *v.shape[1:]]) for k, v in batch.items()}

        # One gather per global batch instead of per-example work: the host stays off the critical path.
        ds = tf.data.Dataset.range(start_batch, 2**62).map(global_batch, num_parallel_calls=AUTOTUNE)
        # Several replicas here take consecutive elements: split the batch. (Unbatching copies each slice: about
        # 1 ms a step for a 256 x 784 batch on 2 cores, so one replica skips it.)
        return ds if local_replicas == 1 else ds.unbatch()

    def eval_fn(ctx):
        # An example counts once unless its source says how much it counts (a text window: its characters).
        ds = evals.make().enumerate().map(lambda i, x: {"weight": tf.constant(1.0), **x, "index": i})
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        padding = {k: tf.zeros(s.shape, s.dtype) for k, s in source.spec.items()}
        padding.update(index=tf.constant(-1, tf.int64), weight=tf.constant(0.0))
        ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat())
        ds = ds.batch(ctx.get_per_replica_batch_size(config.per_eval_batch_size), drop_remainder=True)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return ds.take(eval_steps * local_replicas).map(prepare, num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)

    return Data(train_fn, eval_fn, eval_steps, evals.examples, train.examples, task, task.spec)


def _streamed(split, config, start_example, stream):
    """A split too large for memory: a shuffle buffer, reshuffled each epoch. Resuming replays the stream
    up to the position (reading, not training on, the examples before it)."""
    ds = split.make().shuffle(
        min(config.shuffle_buffer, split.examples), seed=config.seed * 1000 + stream, reshuffle_each_iteration=True
    )
    ds = ds.repeat().skip(start_example).enumerate(start_example)
    return ds.map(lambda i, x: {**x, "index": i})


def load_source(config, features, split=None):
    """The Source `config.dataset` names, keeping `features` (all when empty); its eval split is `split`, else
    --eval_split."""
    name = config.dataset or tasks.default_dataset(config.task)
    kind = name.partition(":")[0]  # KIND:ARGUMENT, e.g. npz:PATH, is engine/sources/KIND.py's to read
    if kind in sources.available():
        source = importlib.import_module(f"engine.sources.{kind}").load(config, split or config.eval_split)
    else:
        source = _tfds(config, name, features, split or config.eval_split)
    missing = [f for f in features if f not in source.spec]
    if missing:
        raise ConfigError(
            f"--dataset={name}: --task={config.task} needs the features {', '.join(features)} "
            f"(it has {', '.join(source.spec)})"
        )
    for feature, spec in source.spec.items():
        if not spec.shape.is_fully_defined():
            raise ConfigError(f"--dataset={name}: {feature} has no fixed shape ({spec.shape})")
    return source


def _tfds(config, name, features, eval_split):
    builder = _prepared_builder(config, name)
    info = builder.info
    keep = list(features or info.features.keys())
    absent = [f for f in keep if f not in info.features]
    if absent:
        raise ConfigError(
            f"--dataset={name}: --task={config.task} needs the features {', '.join(keep)} "
            f"(it has {', '.join(info.features.keys())})"
        )
    spec = {f: tf.TensorSpec(info.features[f].shape, info.features[f].tf_dtype) for f in keep}
    for feature, feature_spec in spec.items():
        if not feature_spec.shape.is_fully_defined():
            raise ConfigError(f"--dataset={name}: {feature} has no fixed shape ({feature_spec.shape})")
    example_bytes = sum(s.shape.num_elements() * s.dtype.size for s in spec.values())
    known = {}
    if "label" in info.features and hasattr(info.features["label"], "num_classes"):
        known["num_classes"] = info.features["label"].num_classes

    def split_fn(flag, split):
        try:
            size = info.splits[split].num_examples
        except (KeyError, ValueError, AssertionError) as e:
            raise ConfigError(
                f"--{flag}={split}: not a split of {name} (splits: {', '.join(info.splits.keys())}; {e})"
            ) from None

        def make():
            ds = builder.as_dataset(split=split, shuffle_files=False)
            return ds.map(lambda x: {f: x[f] for f in keep})

        if size * example_bytes < _IN_MEMORY_LIMIT_BYTES:
            arrays = builder.as_dataset(split=split, shuffle_files=False, batch_size=-1)
            return in_memory({f: arrays[f] for f in keep})
        return Split(size, make)

    return Source(split_fn("train_split", config.train_split), split_fn("eval_split", eval_split), spec, known)


def _prepared_builder(config, name):
    data_dir = os.path.expanduser(config.data_dir) if config.data_dir else None
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises several kinds for names and configs it cannot resolve
        raise ConfigError(f"--dataset={name}: {first_line(e)}") from None
    # What builder.is_prepared() reads, without its warning about the folder it expected.
    if not tf.io.gfile.exists(os.path.join(builder.data_dir, tfds.core.constants.DATASET_INFO_FILENAME)):
        _check_reachable(config, builder)
    with _prepare_lock(builder.data_dir):
        try:
            builder.download_and_prepare()
        except Exception as e:  # network, disk and checksum failures all end here
            raise ConfigError(
                f"--dataset={config.dataset}: could not download and prepare it into "
                f"{builder.data_dir} ({first_line(e)}); without a network, put a prepared "
                "copy under --data_dir"
            ) from None
    return builder


def _check_reachable(config, builder):
    """Refuses in seconds to download a dataset when its download hosts (or the proxy to them) do not answer:
    tfds would retry each file with backoff for minutes (urllib3: 10 tries) before failing."""
    proxies = urllib.request.getproxies()
    addresses = set()
    for url in builder.url_infos or ():
        parts = urllib.parse.urlsplit(url)
        proxy = proxies.get(parts.scheme)
        via = urllib.parse.urlsplit(proxy) if proxy and not urllib.request.proxy_bypass(parts.hostname) else parts
        addresses.add((via.hostname, via.port or (443 if via.scheme == "https" else 80), via is not parts))
    for host, port, is_proxy in sorted(addresses):
        try:
            socket.create_connection((host, port), timeout=3).close()
        except OSError as e:
            where = config.data_dir or tfds.core.constants.DATA_DIR
            raise ConfigError(
                f"--dataset={config.dataset}: not prepared in --data_dir={where} ({builder.data_dir}) and the "
                f"network is unreachable ({'proxy ' if is_proxy else ''}{host}:{port}: {e.strerror or e}); prepare "
                "it on a machine with a network and copy it there"
            ) from None


@contextlib.contextmanager
def _prepare_lock(directory):
    # Workers of one job on one machine (or sharing a POSIX file system) prepare a dataset once.
    if "://" in directory:
        yield
        return
    parent = os.path.dirname(directory.rstrip("/"))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--data_dir={parent}: cannot create it ({e.strerror})") from None
    with open(os.path.join(parent, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
