"""Input pipelines: the bundled digits and any tensorflow-datasets name, or synthetic data.

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
import math
import os
import socket
import urllib.parse
import urllib.request

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

import engine.digits  # noqa: F401  (registers the bundled `digits` builder with tfds)
from engine.config import ConfigError, check_memory, first_line

AUTOTUNE = tf.data.AUTOTUNE
_IN_MEMORY_LIMIT_BYTES = 1 << 30  # splits below this are held as tensors and batched with one gather


@dataclasses.dataclass(frozen=True)
class Data:
    train_fn: object  # (InputContext, start_batch) -> endless dataset of per-replica (images, labels) batches
    eval_fn: object  # InputContext -> finite dataset of (images, labels, weights), eval_steps batches
    eval_steps: int  # evaluation steps that cover every evaluation example once
    eval_examples: int
    train_examples: int
    input_shape: tuple
    num_classes: int


@dataclasses.dataclass(frozen=True)
class _Split:
    make: object  # () -> dataset of (image, label), unbatched, in a fixed order
    examples: int
    arrays: tuple = None  # (images, labels) tensors when the split is held in memory


def load(config):
    """The Data for `config`; raises ConfigError for an unknown split or an unusable dataset."""
    if config.dataset == "synthetic":
        train, evals, shape, classes = _synthetic(config)
    else:
        train, evals, shape, classes = _tfds(config)
    if train.examples < config.global_batch_size:
        raise ConfigError(
            f"--global_batch_size={config.global_batch_size}: larger than the "
            f"{train.examples} examples of --train_split={config.train_split}"
        )
    eval_steps = math.ceil(evals.examples / config.per_eval_batch_size)

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
        if train.arrays is None:
            ds = _streamed(train, config, start_example=start_batch * config.global_batch_size, stream=stream)
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).map(_preprocess, num_parallel_calls=AUTOTUNE)
            return ds.batch(per_replica, drop_remainder=True)
        images, labels = train.arrays
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
            x, y = _preprocess(tf.gather(images, order), tf.gather(labels, order))
            if local_replicas == 1:
                return x, y
            return tf.reshape(x, [local_replicas, per_replica, *x.shape[1:]]), tf.reshape(y, [local_replicas, -1])

        # One gather per global batch instead of per-example work: the host stays off the critical path.
        ds = tf.data.Dataset.range(start_batch, 2**62).map(global_batch, num_parallel_calls=AUTOTUNE)
        # Several replicas here take consecutive elements: split the batch. (Unbatching copies each slice: about
        # 1 ms a step for a 256 x 784 batch on 2 cores, so one replica skips it.)
        return ds if local_replicas == 1 else ds.unbatch()

    def eval_fn(ctx):
        ds = evals.make().shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        ds = ds.map(lambda x, y: (*_preprocess(x, y), tf.constant(1.0)), num_parallel_calls=AUTOTUNE)
        padding = tf.data.Dataset.from_tensors((tf.zeros(shape), tf.constant(0, tf.int64), tf.constant(0.0)))
        ds = ds.concatenate(padding.repeat())
        ds = ds.batch(ctx.get_per_replica_batch_size(config.per_eval_batch_size), drop_remainder=True)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return ds.take(eval_steps * local_replicas).prefetch(AUTOTUNE)

    return Data(train_fn, eval_fn, eval_steps, evals.examples, train.examples, tuple(shape), classes)


def _streamed(split, config, start_example, stream):
    """A split too large for memory: a shuffle buffer, reshuffled each epoch. Resuming replays the stream
    up to the position (reading, not training on, the examples before it)."""
    ds = split.make().shuffle(
        min(config.shuffle_buffer, split.examples), seed=config.seed * 1000 + stream, reshuffle_each_iteration=True
    )
    return ds.repeat().skip(start_example)


def _preprocess(image, label):
    if image.dtype == tf.uint8:
        image = tf.cast(image, tf.float32) / 255.0
    return tf.cast(image, tf.float32), tf.cast(label, tf.int64)


def _in_memory(arrays, examples):
    return _Split(lambda: tf.data.Dataset.from_tensor_slices(arrays), examples, arrays)


def _synthetic(config):
    """A learnable random task, generated once with stateless ops: the label is the argmax of a fixed
    random projection of the input."""
    shape = tuple(config.synthetic_shape)
    projection = tf.random.stateless_normal((int(np.prod(shape)), config.synthetic_classes), seed=[config.seed, 7])

    def pool(stream, examples):
        images = tf.random.stateless_uniform((examples, *shape), seed=[config.seed, stream])
        labels = tf.argmax(
            tf.reshape(images, [examples, -1]) @ projection - tf.reduce_mean(projection, 0) * 0.5, axis=-1
        )
        return _in_memory((images, labels), examples)

    evals = pool(2, max(1, config.synthetic_examples // 4))
    return pool(1, config.synthetic_examples), evals, shape, config.synthetic_classes


def _tfds(config):
    builder = _prepared_builder(config)
    info = builder.info
    if "image" not in info.features or "label" not in info.features:
        raise ConfigError(
            f"--dataset={config.dataset}: needs 'image' and 'label' features (it has {', '.join(info.features.keys())})"
        )
    shape = info.features["image"].shape
    if None in shape:
        raise ConfigError(f"--dataset={config.dataset}: images have no fixed shape ({shape})")
    classes = info.features["label"].num_classes
    check_memory(config, shape, classes)

    def split_fn(flag):
        split = getattr(config, flag)
        try:
            size = info.splits[split].num_examples
        except (KeyError, ValueError, AssertionError) as e:
            raise ConfigError(
                f"--{flag}={split}: not a split of {config.dataset} (splits: {', '.join(info.splits.keys())}; {e})"
            ) from None
        if size * int(np.prod(shape)) < _IN_MEMORY_LIMIT_BYTES:
            arrays = builder.as_dataset(split=split, as_supervised=True, shuffle_files=False, batch_size=-1)
            return _in_memory(arrays, size)
        return _Split(lambda: builder.as_dataset(split=split, as_supervised=True, shuffle_files=False), size)

    return split_fn("train_split"), split_fn("eval_split"), shape, classes


def _prepared_builder(config):
    data_dir = os.path.expanduser(config.data_dir) if config.data_dir else None
    try:
        builder = tfds.builder(config.dataset, data_dir=data_dir)
    except Exception as e:  # tfds raises several kinds for names and configs it cannot resolve
        raise ConfigError(f"--dataset={config.dataset}: {first_line(e)}") from None
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
