"""Input pipelines: the bundled digits and any tensorflow-datasets name, or synthetic data.

Every pipeline is a function of `tf.distribute.InputContext`, for
`strategy.distribute_datasets_from_function`: each input pipeline (one per
worker) reads the same shuffled stream and keeps every n-th example, so the
examples of one global step are exactly those one device would see.
Training batches are per replica with static shapes; evaluation pads with
weight-0 examples so every real example is counted exactly once.
"""

import contextlib
import dataclasses
import fcntl
import math
import os

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

import engine.digits  # noqa: F401  (registers the bundled `digits` builder with tfds)
from engine.config import ConfigError

AUTOTUNE = tf.data.AUTOTUNE
_CACHE_LIMIT_BYTES = 1 << 30  # keep decoded training data in memory below this size


@dataclasses.dataclass(frozen=True)
class Data:
    train_fn: object  # InputContext -> infinite dataset of (images, labels), per-replica batches
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
    bytes_per_example: int
    shuffle: bool = True  # synthetic data is random already: its batches are built once and cached


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

    def train_fn(ctx, start_batch=0):
        """Per-replica batches from global batch `start_batch` on: the data position is a pure function of
        the number of batches consumed, so a restored run continues exactly where it stopped."""
        batch = ctx.get_per_replica_batch_size(config.global_batch_size)
        pipelines, index = ctx.num_input_pipelines, ctx.input_pipeline_id
        local_replicas = ctx.num_replicas_in_sync // pipelines
        if not train.shuffle:  # synthetic: each pipeline builds its batches once, then cycles through them
            ds = train.make().shard(pipelines, index).map(_preprocess).batch(batch, drop_remainder=True)
            per_epoch = (train.examples - index + pipelines - 1) // pipelines // batch
            return ds.cache().repeat().skip(start_batch * local_replicas % per_epoch).prefetch(AUTOTUNE)
        ds = _shuffled_stream(train, config, start_example=start_batch * config.global_batch_size)
        # Every pipeline reads the same stream and keeps every n-th example (shard after the shuffle).
        ds = ds.shard(pipelines, index).map(_preprocess, num_parallel_calls=AUTOTUNE)
        return ds.batch(batch, drop_remainder=True).prefetch(AUTOTUNE)

    def eval_fn(ctx):
        ds = evals.make().shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        ds = ds.map(lambda x, y: (*_preprocess(x, y), tf.constant(1.0)), num_parallel_calls=AUTOTUNE)
        padding = tf.data.Dataset.from_tensors((tf.zeros(shape), tf.constant(0, tf.int64), tf.constant(0.0)))
        ds = ds.concatenate(padding.repeat())
        ds = ds.batch(ctx.get_per_replica_batch_size(config.per_eval_batch_size), drop_remainder=True)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return ds.take(eval_steps * local_replicas).prefetch(AUTOTUNE)

    return Data(train_fn, eval_fn, eval_steps, evals.examples, train.examples, tuple(shape), classes)


def _shuffled_stream(split, config, start_example):
    """The endless stream of training examples, shuffled per epoch, from example `start_example` on."""
    n = split.examples
    if n * split.bytes_per_example < _CACHE_LIMIT_BYTES:
        # The split fits in memory: hold it as one element and give epoch e the stateless permutation
        # seeded by (seed, e), so any position is reached by skipping within one epoch only.
        whole = split.make().batch(n).cache()
        epoch, offset = divmod(start_example, n)

        def one_epoch(e):
            order = tf.random.experimental.stateless_shuffle(tf.range(n), seed=tf.stack([config.seed, e]))
            return whole.flat_map(
                lambda x, y: tf.data.Dataset.from_tensor_slices((tf.gather(x, order), tf.gather(y, order)))
            )

        return tf.data.Dataset.range(epoch, 2**62).flat_map(one_epoch).skip(offset)
    # Larger than memory: a shuffle buffer, reshuffled each epoch; resuming replays the stream up to the
    # position (reading, not training on, the examples before it).
    ds = split.make().shuffle(min(config.shuffle_buffer, n), seed=config.seed, reshuffle_each_iteration=True)
    return ds.repeat().skip(start_example)


def _preprocess(image, label):
    if image.dtype == tf.uint8:
        image = tf.cast(image, tf.float32) / 255.0
    return tf.cast(image, tf.float32), tf.cast(label, tf.int64)


def _synthetic(config):
    """A learnable random task: the label is the argmax of a fixed random projection of the input."""
    shape = tuple(config.synthetic_shape)
    size = int(np.prod(shape))
    projection = tf.random.stateless_normal((size, config.synthetic_classes), seed=[config.seed, 7])

    def example(index, stream):
        image = tf.random.stateless_uniform(
            shape, seed=tf.stack([tf.constant(config.seed, tf.int64), 2 * index + stream])
        )
        logits = tf.linalg.matvec(projection, tf.reshape(image, [-1]) - 0.5, transpose_a=True)
        return image, tf.argmax(logits, output_type=tf.int64)

    def pool(stream, examples):
        return _Split(
            lambda: tf.data.Dataset.range(examples).map(lambda i: example(i, stream)),
            examples,
            bytes_per_example=4 * size,
            shuffle=False,
        )

    evals = max(1, config.synthetic_examples // 4)
    return pool(0, config.synthetic_examples), pool(1, evals), shape, config.synthetic_classes


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

    def split_fn(flag):
        split = getattr(config, flag)
        try:
            size = info.splits[split].num_examples
        except (KeyError, ValueError, AssertionError) as e:
            raise ConfigError(
                f"--{flag}={split}: not a split of {config.dataset} (splits: {', '.join(info.splits.keys())}; {e})"
            ) from None
        return _Split(
            lambda: builder.as_dataset(split=split, as_supervised=True, shuffle_files=False),
            size,
            bytes_per_example=int(np.prod(shape)),
        )

    return split_fn("train_split"), split_fn("eval_split"), shape, classes


def _prepared_builder(config):
    data_dir = os.path.expanduser(config.data_dir) if config.data_dir else None
    try:
        builder = tfds.builder(config.dataset, data_dir=data_dir)
    except Exception as e:  # tfds raises several kinds for names and configs it cannot resolve
        raise ConfigError(f"--dataset={config.dataset}: {_first_line(e)}") from None
    with _prepare_lock(builder.data_dir):
        try:
            builder.download_and_prepare()
        except Exception as e:  # network, disk and checksum failures all end here
            raise ConfigError(
                f"--dataset={config.dataset}: could not download and prepare it into "
                f"{builder.data_dir} ({_first_line(e)}); without a network, put a prepared "
                "copy under --data_dir"
            ) from None
    return builder


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


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
