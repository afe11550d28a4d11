"""Input pipelines: the bundled sources (engine/sources/), your own files and any tensorflow-datasets name.

Every pipeline is a function of `tf.distribute.InputContext`, for
`strategy.distribute_datasets_from_function`. Training reads one stream of examples per run, a pure
function of the data position (global batches consumed), so a restored run starts at its position in
constant time and reads what an uninterrupted one would. Evaluation pads with weight-0 examples so
every real example is counted exactly once. Splits come in three kinds:

- held in memory (`in_memory`: arrays, or file paths and labels): random access. Global batch k is
  examples [k*G, (k+1)*G) of one global stream, each epoch a permutation by (seed, epoch); each input
  pipeline (one per worker) takes every n-th of them, so a step sees exactly the examples one device
  would, whatever the number of workers, and a pipeline reads only its own examples.
- record files too large for memory (`sharded`: TFRecords, a prepared tensorflow-datasets split): each
  input pipeline owns every n-th file (of a permutation by seed) and reads only those: its stream is
  its files, each epoch in an order by (seed, epoch), --interleave_files at a time interleaved example
  by example and shuffled together. The counts of records per file place any position by arithmetic:
  a restart skips whole epochs and groups of files unread and reads at most one group before its
  position. The stream depends on the number of pipelines, so a resumed run must have as many.
- anything else (`make` only): streamed and replayed up to the position on a restart.

A source may give a per-example `decode` (photos: decode, crop, flip) seeded by the example's stream
position, so a resumed run crops alike; a record file's records are parsed in the same step. An example
that cannot be parsed or decoded stops the run naming its file and record (Data.origin), and so does a
record file that holds fewer or more records than counted: nothing is skipped silently, and the run
resumes from its last checkpoint once the file is fixed or removed. An empty split is refused.

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
import re
import socket
import urllib.parse
import urllib.request

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

import engine.digits  # noqa: F401  (registers the bundled `digits` builder with tfds)
import tasks
from engine import sources
from engine.config import ConfigError, check_memory, first_line

AUTOTUNE = tf.data.AUTOTUNE
_IN_MEMORY_LIMIT_BYTES = 1 << 30  # splits below this are held as tensors and batched with one gather
_RECORD_FRAMING = 16  # bytes a TFRecord adds to each record: length, its CRC, the data's CRC
_CHECK_EVERY = 256  # examples between the decode's markers: a stream whose every example fails stops within them
UNDECODABLE = "undecodable example at stream position"  # the pipeline's error; Data.origin names the file
UNREADABLE = "damaged record file:"  # the pipeline's error naming a truncated, corrupt or changed record file
_CHANGED = (
    "it changed after they were counted (--dataset=tfrecord: keeps its counts in tfrecord_counts.json in "
    "--data_dir: delete it to count them again)"
)


class DecodeError(ConfigError):
    """An example of the data could not be decoded; the message names its file."""


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a source: `examples` dicts of features, in a fixed order."""

    examples: int
    make: object  # () -> dataset of example dicts, in order
    fetch: object = None  # int64 indices [n] -> {feature: [n, ...]}: random access, when held in memory
    files: tuple = ()  # ((path, records), ...): record files, read in shards by input pipeline
    parse: object = None  # a serialized record -> {feature: tensor}, for `files`


def in_memory(arrays):
    """A Split of {feature: tensor of examples x ...} held in memory: batches are gathered, not iterated."""
    examples = int(next(iter(arrays.values())).shape[0])
    return Split(
        examples,
        lambda: tf.data.Dataset.from_tensor_slices(arrays),
        lambda indices: {name: tf.gather(values, indices) for name, values in arrays.items()},
    )


def sharded(files, parse):
    """A Split of TFRecord files, ((path, number of records), ...), each record `parse`d into an example. The
    counts must be exact: they place every position of the stream."""
    files = tuple((str(path), int(records)) for path, records in files)
    make = lambda: file_records(files).map(lambda example: parsed(parse, example))  # noqa: E731
    return Split(sum(records for _, records in files), make, files=files, parse=parse)


def file_records(files, counter=None):
    """{"record", "origin", "damage"} of each counted record of `files` ((path, records), ...), file after file,
    unparsed (`parsed` parses one)."""
    paths, counts = zip(*files)
    ds = tf.data.Dataset.from_tensor_slices((list(paths), tf.constant(counts, tf.int64)))
    return ds.flat_map(lambda path, n: _records(path, n, counter)).map(_record_example)


def _record_example(origin, record, damage):
    return {"record": record, "origin": origin, "damage": damage}


def parsed(parse, example):
    """A record file's example (`file_records`) with its record `parse`d into features; stops on a damaged record,
    naming its file."""
    intact = tf.debugging.Assert(
        tf.equal(example["damage"][0], 0), [UNREADABLE, example["origin"], example["damage"]], summarize=2
    )
    with tf.control_dependencies([intact]):
        record = tf.identity(example["record"])
    return {**parse(record), **{k: v for k, v in example.items() if k not in ("record", "damage")}}


def _fold(seed, *values):
    """A [2] int64 stateless seed mixed with `values` (ints or int tensors), one after the other."""
    for value in values:
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(value, tf.int64))
    return seed


def _permutation(n, seed):
    """A uniform random permutation of range(n) from a [2] int64 seed. (RandomIndexShuffle is far from uniform on
    a few elements, such as a pipeline's files: on 12 it leaves most in place, and it reads 16 bits of a seed word.)"""
    return tf.argsort(tf.random.stateless_uniform([n], seed=seed))


def _records(path, expected, counter=None):
    """(origin, record, damage) of a file's `expected` records: exactly that many, plus one where the file holds
    more, since the stream's arithmetic places every position by the counts. `damage` is [code, expected]: code 0
    for a sound record, 1 for one that could not be read (the file truncated, or a record whose checksum fails:
    it comes empty), 2 for a record beyond the count (the file changed after it was counted). `parsed` stops on
    a damaged one; the damage is carried, not raised, so that the decode's dropped errors
    (`_Pipelines._decoded`) cannot hide it."""
    read = tf.data.TFRecordDataset(path).ignore_errors().take(expected + 1).map(lambda r: (r, True))
    missing = tf.data.Dataset.from_tensors((tf.constant(b""), False)).repeat()  # stand-ins for records it lacks

    def judged(i, item):
        record, real = item
        # Past the count, a real record is one too many; a stand-in, the end where it should be (dropped below).
        code = tf.where(i < expected, tf.where(real, 0, 1), tf.where(real, 2, -1))
        origin = tf.strings.join([path, " record ", tf.strings.as_string(i)])
        return origin, record, tf.stack([tf.cast(code, tf.int64), expected])

    ds = read.concatenate(missing).take(expected + 1).enumerate().map(judged)
    ds = ds.filter(lambda origin, record, damage: damage[0] >= 0)
    if counter is not None:  # bytes read, for the read-amplification count

        def count(origin, record, damage):
            with tf.control_dependencies(
                [counter.assign_add(tf.cast(tf.strings.length(record) + _RECORD_FRAMING, tf.int64))]
            ):
                return origin, tf.identity(record), damage

        ds = ds.map(count)
    return ds


@dataclasses.dataclass(frozen=True)
class Source:
    """What a dataset gives: its splits, the spec of one (decoded) example ({feature: tf.TensorSpec}, static
    shapes) and what it knows about them (`num_classes` of a `label`, a text's `vocabulary`, ...). An evaluation
    example may carry a float32 `weight`, how much it counts in the means (default 1). `decode(example, seed,
    training)` runs on each example before batching (seed: [2] int64, from the run's seed and the example's
    stream position); an example may carry `origin` (its file), named when it cannot be decoded."""

    train: Split
    evals: Split
    spec: dict
    info: dict
    decode: object = None


@dataclasses.dataclass(frozen=True)
class Data:
    # (InputContext, start_batch, stream, counter) -> endless dataset of per-replica batches: {feature: tensor}
    # after the task's `prepare`, plus `index`, each example's position in the training stream (seeds per
    # example). `counter`, an int64 variable, counts the bytes of record files read.
    train_fn: object
    # InputContext -> finite dataset of eval_steps batches: the prepared features, `index` (the position in the
    # split) and `weight` (1 for an example, 0 for padding).
    eval_fn: object
    eval_steps: int  # evaluation steps that cover every evaluation example once
    eval_examples: int
    train_examples: int
    task: object  # the run's tasks/<name>.py Task
    spec: dict  # {feature: tf.TensorSpec} of one prepared example
    sharded: bool = False  # the training stream depends on the number of input pipelines
    train_bytes: int = 0  # record bytes of the training files, when sharded
    origin: object = None  # (position, training, pipelines) -> the file of an example, for a decode failure
    # (batch, pipeline, pipelines) -> input pipeline `pipeline`'s prepared share of global batch `batch` (tensors),
    # gathered from memory inside a step: what train_fn's batch would be. None: the split is not held in memory.
    gather: object = None


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
    if not evals.examples:  # a mean over nothing: NaN, said as if it were a number
        raise ConfigError(
            f"--dataset={config.dataset or tasks.default_dataset(config.task)}: the split "
            f"{split or config.eval_split} it evaluates holds no examples"
        )
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
    pipelines = _Pipelines(config, source)

    def train_fn(ctx, start_batch=0, stream=0, counter=None):
        """Per-replica batches from global batch `start_batch` on. `stream` > 0 gives an independent order (each
        parameter-server worker reads its own)."""
        ds = pipelines.train(ctx, start_batch, stream, counter).map(prepare, num_parallel_calls=AUTOTUNE)
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

    def gather(batch, pipeline, num_pipelines):
        return prepare(pipelines.share(batch, pipeline, num_pipelines))

    def eval_fn(ctx):
        return pipelines.evaluation(ctx, eval_steps).map(prepare, num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)

    return Data(
        train_fn,
        eval_fn,
        eval_steps,
        evals.examples,
        train.examples,
        task,
        task.spec,
        sharded=bool(train.files),
        train_bytes=pipelines.train_bytes,
        origin=pipelines.origin,
        gather=gather if train.fetch is not None and source.decode is None else None,
    )


class _Pipelines:
    """The training and evaluation streams of a source."""

    def __init__(self, config, source):
        self.config, self.source = config, source
        self.train_split, self.evals = source.train, source.evals
        self.train_bytes = sum(tf.io.gfile.stat(path).length for path, _ in self.train_split.files)

    def position(self, ctx, local):
        """The global stream position of this pipeline's `local`-th training example: its share of global
        batch k is every n-th position of that batch, as with random access."""
        share = self.config.global_batch_size // ctx.num_input_pipelines
        return (
            (local // share) * self.config.global_batch_size
            + ctx.input_pipeline_id
            + (local % share) * ctx.num_input_pipelines
        )

    def seeds(self, index, stream):
        # Per example, from the run's seed, the stream and the example's position: a resumed run crops alike.
        return tf.stack([tf.constant(self.config.seed, tf.int64) + tf.cast(stream, tf.int64) * (1 << 32), index])

    # Training.

    def train(self, ctx, start_batch, stream, counter):
        """This pipeline's per-replica batches from global batch `start_batch` on."""
        split, config = self.train_split, self.config
        per_replica = ctx.get_per_replica_batch_size(config.global_batch_size)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        if split.fetch is not None and self.source.decode is None:
            return self._gathered(ctx, start_batch, stream, per_replica, local_replicas)
        ds = self.examples(ctx, start_batch, stream, counter)
        first = start_batch * (config.global_batch_size // ctx.num_input_pipelines)
        ds = self._decoded(ds, True, stream, first, lambda local: self.position(ctx, local))
        return ds.batch(per_replica, drop_remainder=True)

    def examples(self, ctx, start_batch, stream, counter=None):
        """This pipeline's training examples from global batch `start_batch` on, undecoded (a record file's
        unparsed), with `index`."""
        split = self.train_split
        if split.fetch is not None:
            share = self.config.global_batch_size // ctx.num_input_pipelines
            return self._gathered(ctx, start_batch, stream, share, 1).unbatch()
        if split.files:
            return self._sharded(ctx, start_batch, stream, counter)
        return self._replayed(ctx, start_batch, stream)

    def order(self, positions, stream):
        """The examples at global stream `positions`: epoch e's permutation, element by element."""
        n = self.train_split.examples
        epoch, within = positions // n, positions % n
        seeds = tf.stack(
            [
                tf.fill(tf.shape(epoch), tf.constant(self.config.seed, tf.int64)),
                epoch,
                tf.fill(tf.shape(epoch), tf.cast(stream, tf.int64)),
            ],
            axis=-1,
        )
        # The raw op: tf.random.experimental.index_shuffle mis-pads a batch of seeds.
        return tf.raw_ops.RandomIndexShuffle(index=within, seed=seeds, max_index=n - 1, rounds=4)

    def share(self, batch, pipeline, num_pipelines, stream=0):
        """Input pipeline `pipeline`'s share of global batch `batch` (either may be a tensor), gathered from memory:
        the examples at stream positions pipeline, pipeline + n, ... of the batch, with their `index`."""
        positions = batch * self.config.global_batch_size + tf.range(
            pipeline, self.config.global_batch_size, num_pipelines, dtype=tf.int64
        )
        return {**self.train_split.fetch(self.order(positions, stream)), "index": positions}

    def _gathered(self, ctx, start_batch, stream, per_replica, local_replicas):
        def global_batch(k):
            batch = self.share(k, ctx.input_pipeline_id, ctx.num_input_pipelines, stream)
            if local_replicas == 1:
                return batch
            return {k: tf.reshape(v, [local_replicas, per_replica, *v.shape[1:]]) for k, v in batch.items()}

        # One gather per global batch instead of per-example work: the host stays off the critical path.
        ds = tf.data.Dataset.range(start_batch, 2**62).map(global_batch, num_parallel_calls=AUTOTUNE)
        # Several replicas here take consecutive elements: split the batch. (Unbatching copies each slice: about
        # 1 ms a step for a 256 x 784 batch on 2 cores, so one replica skips it.)
        return ds if local_replicas == 1 else ds.unbatch()

    def owned(self, ctx):
        """This pipeline's files, ((path, records), ...): every n-th of a permutation fixed by the seed."""
        files = self.train_split.files
        if len(files) < ctx.num_input_pipelines:
            raise ConfigError(
                f"--dataset={self.config.dataset}: its {len(files)} record files of --train_split="
                f"{self.config.train_split} cannot feed {ctx.num_input_pipelines} input pipelines (workers), "
                "each of which reads its own files; write the split in more files"
            )
        order = np.random.default_rng(self.config.seed).permutation(len(files))
        return [files[i] for i in order[ctx.input_pipeline_id :: ctx.num_input_pipelines]]

    def _sharded(self, ctx, start_batch, stream, counter):
        config = self.config
        files = self.owned(ctx)
        paths = tf.constant([path for path, _ in files])
        counts = tf.constant([records for _, records in files], tf.int64)
        per_epoch = sum(records for _, records in files)
        width = min(config.interleave_files, len(files))
        groups = math.ceil(len(files) / width)
        # Seeds of this pipeline's orders: the run's, its stream's, its own. (A parameter-server worker's stream
        # is a tensor of the traced dataset function: everything below is graph arithmetic.)
        key = _fold(tf.constant([config.seed, 0], tf.int64), stream, ctx.input_pipeline_id)

        def file_order(epoch):
            return _permutation(len(files), _fold(key, epoch))

        def group(epoch, g):
            chosen = file_order(epoch)[g * width : (g + 1) * width]
            ds = tf.data.Dataset.from_tensor_slices((tf.gather(paths, chosen), tf.gather(counts, chosen)))
            ds = ds.interleave(
                lambda path, n: _records(path, n, counter),
                cycle_length=width,
                block_length=1,
                num_parallel_calls=AUTOTUNE,
                deterministic=True,
            )

            # Shuffled within the group, window by window of --shuffle_buffer examples, each window's order a
            # function of (seed, stream, pipeline, epoch, group, window): alike on every restart.
            def shuffle(w, window):
                order = _permutation(tf.shape(window[0])[0], _fold(key, epoch, g, w))
                return tuple(tf.gather(part, order) for part in window)

            return ds.batch(config.shuffle_buffer).enumerate().map(shuffle).unbatch()

        def epoch_stream(epoch, first_group=0):
            return tf.data.Dataset.range(first_group, groups).flat_map(lambda g: group(epoch, g))

        # Where the start lies, by arithmetic on the counts: the epochs and groups before it are never read.
        local = start_batch * (config.global_batch_size // ctx.num_input_pipelines)
        epoch, within = divmod(local, per_epoch)
        sizes = tf.gather(counts, file_order(tf.constant(epoch, tf.int64)))
        sizes = tf.reduce_sum(tf.reshape(tf.pad(sizes, [[0, groups * width - len(files)]]), [groups, width]), axis=1)
        ends = tf.cumsum(sizes)  # where each group of the start epoch ends
        first_group = tf.reduce_sum(tf.cast(ends <= within, tf.int64))
        before = tf.concat([[0], ends], axis=0)[first_group]
        ds = epoch_stream(tf.constant(epoch, tf.int64), first_group).skip(within - before)
        ds = ds.concatenate(tf.data.Dataset.range(epoch + 1, 2**62).flat_map(epoch_stream))
        # Unparsed: the decode step parses (`_decoded`), so a record that does not parse is named like an image
        # that does not decode.
        return ds.enumerate(local).map(
            lambda i, item: {**_record_example(*item), "index": self.position(ctx, i)}, num_parallel_calls=AUTOTUNE
        )

    def _replayed(self, ctx, start_batch, stream):
        """A split with neither random access nor files: a shuffle buffer reshuffled each epoch; a restart
        replays the stream up to its position (reading, not training on, the examples before it)."""
        config, split = self.config, self.train_split
        ds = split.make().shuffle(
            min(config.shuffle_buffer, split.examples), seed=config.seed * 1000 + stream, reshuffle_each_iteration=True
        )
        start = start_batch * config.global_batch_size
        ds = ds.repeat().skip(start).enumerate(start).map(lambda i, x: {**x, "index": i})
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

    # Decoding.

    def _decoded(self, ds, training, stream, first, position, end=None):
        """`ds` with each example decoded (`decode`: a record file's record parsed, then the source's decode). A
        failure stops the pipeline naming the example's position: the decode runs in parallel and its errors are
        dropped, and the positions that come out are checked against `position(first), position(first + 1), ...`
        (up to `end`, exclusive)."""
        split = self.train_split if training else self.evals
        if self.source.decode is None and not split.files:
            return ds.map(lambda x: {k: v for k, v in x.items() if k != "origin"})

        def run(x):
            own = {k: x[k] for k in ("index", "weight") if k in x}
            features = self.decode({k: v for k, v in x.items() if k not in own}, split, stream, x["index"], training)
            return {**features, **own}

        def blank(spec, index):
            return {**{k: tf.zeros([d or 0 for d in s.shape], s.dtype) for k, s in spec.items()}, "index": index}

        # After every _CHECK_EVERY examples, and at the end, a marker that cannot fail: a dropped example shows even
        # where every one fails (an endless stream of failures would hang otherwise).
        raw, decoded = ds.element_spec, ds.map(run).element_spec
        markers = tf.data.Dataset.from_tensors(blank(raw, tf.constant(-1, tf.int64))).repeat()
        pattern = tf.data.Dataset.from_tensor_slices(tf.constant([0] * _CHECK_EVERY + [1], tf.int64)).repeat()
        ds = tf.data.Dataset.choose_from_datasets([ds, markers], pattern, stop_on_empty_dataset=True)
        if end is not None:
            ds = ds.concatenate(tf.data.Dataset.from_tensors(blank(raw, tf.constant(-1, tf.int64))))
        marker = lambda x: x["index"] < 0  # noqa: E731
        ds = ds.enumerate().map(
            lambda slot, x: (slot, tf.cond(marker(x), lambda: blank(decoded, x["index"]), lambda: run(x))),
            num_parallel_calls=AUTOTUNE,
        )

        def check(j, item):
            # The j-th to come out must be the j-th in: else slot j was dropped, an example (markers cannot fail),
            # the (j - markers before it)-th since `first`.
            slot, x = item
            expected = position(first + j - j // (_CHECK_EVERY + 1))
            found = tf.debugging.Assert(tf.equal(slot, j), [UNDECODABLE, expected, "of stream", stream], summarize=1)
            with tf.control_dependencies([found]):
                return {k: tf.identity(v) for k, v in x.items()}

        ds = ds.ignore_errors().enumerate().map(check, num_parallel_calls=AUTOTUNE)
        ds = ds.filter(lambda x: tf.logical_not(marker(x)))
        return ds if end is None else ds.take(end - first)

    def decode(self, example, split, stream, index, training):
        """An example of `split` as the task sees it: its record parsed (a record file's), then the source's decode."""
        if split.files:
            example = parsed(split.parse, example)
        example = {k: v for k, v in example.items() if k != "origin"}
        if self.source.decode is None:
            return example
        return self.source.decode(example, self.seeds(index, stream), training)

    def origin(self, position, stream=0, training=True, pipelines=1):
        """Why the example at `position` (of the training stream read with `pipelines` input pipelines, or
        of the evaluation split) could not be decoded: its file and the decoder's error."""
        config = self.config
        if training:
            pipeline = position % config.global_batch_size % pipelines
            ctx = tf.distribute.InputContext(pipelines, pipeline, pipelines)
            k, within = divmod(position, config.global_batch_size)
            ds = self.examples(ctx, k, stream).skip((within - pipeline) // pipelines)
        else:
            ds = self._unparsed(self.evals).skip(position)
        try:
            example = next(iter(ds.take(1)))
        except tf.errors.OpError as e:  # the file itself cannot be read
            return f"--dataset={config.dataset}: cannot read example {position}: {_op_message(e)}"
        where = example.get("origin")
        where = where.numpy().decode() if where is not None else f"example {position} of the split"
        split = self.train_split if training else self.evals
        features = {k: v for k, v in example.items() if k not in ("index", "weight")}
        if split.files:
            try:  # in a graph, as in the pipeline: its checks' messages read alike
                features = tf.function(lambda example: parsed(split.parse, example))(features)
            except tf.errors.OpError as e:
                damaged = unreadable(e) or f"cannot parse {where}: {_op_message(e)}"
                return f"--dataset={config.dataset}: {damaged}"
        features.pop("origin", None)
        try:
            if self.source.decode is not None:
                self.source.decode(features, self.seeds(tf.constant(position, tf.int64), stream), training)
        except tf.errors.OpError as e:
            return f"--dataset={config.dataset}: cannot decode {where}: {_op_message(e)}"
        return f"--dataset={config.dataset}: the example at position {position} ({where}) was lost before decoding"

    def _unparsed(self, split):
        """The examples of `split` in order, a record file's unparsed (`decode` parses them)."""
        return file_records(split.files) if split.files else split.make()

    # Evaluation.

    def evaluation(self, ctx, eval_steps):
        """This pipeline's share of the evaluation split, in order, padded with weight-0 examples to
        `eval_steps` batches per replica: every example counts exactly once."""
        config, source = self.config, self.source
        # An example counts once unless its source says how much it counts (a text window: its characters).
        ds = self._unparsed(self.evals).enumerate().map(lambda i, x: {"weight": tf.constant(1.0), **x, "index": i})
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        pid, n = ctx.input_pipeline_id, ctx.num_input_pipelines
        mine = len(range(pid, self.evals.examples, n))
        ds = self._decoded(ds, False, 0, 0, lambda local: pid + local * n, end=mine)
        padding = {k: tf.zeros(s.shape, s.dtype) for k, s in source.spec.items()}
        padding.update(index=tf.constant(-1, tf.int64), weight=tf.constant(0.0))
        ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat())
        ds = ds.batch(ctx.get_per_replica_batch_size(config.per_eval_batch_size), drop_remainder=True)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return ds.take(eval_steps * local_replicas)


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


def _op_message(error):
    """A TensorFlow error's first line without the function node and op names TensorFlow wraps it in."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", first_line(error.message or str(error)))
    text = re.sub(r"\s*\[Op:\w+\].*$", "", text)
    return re.sub(r"^assertion failed: \[(.*)\]$", r"\1", text)  # a check's own words, without the wrapping


def unreadable(error):
    """The line naming a damaged record file, when `error` is the pipeline's check of one; else None."""
    found = re.search(rf"{UNREADABLE}\] \[(.*) record \d+\] \[(\d+) (\d+)\]", error.message or "")
    if not found:
        return None
    path, code, expected = found.group(1), int(found.group(2)), int(found.group(3))
    if code == 2:
        return f"{path}: holds more than the {expected} records counted: {_CHANGED}"
    read = sum(1 for _ in tf.data.TFRecordDataset(path).ignore_errors())  # only when it failed: read it whole
    return f"{path}: truncated or corrupt: {read} of its {expected} records could be read"


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
    # Photos of many sizes (imagenet2012 and most photo datasets) are read encoded and decoded per example.
    encoded = [
        f for f in keep if isinstance(info.features[f], tfds.features.Image) and None in info.features[f].shape[:2]
    ]
    decoders = {f: tfds.decode.SkipDecoding() for f in encoded}
    spec = {f: tf.TensorSpec(info.features[f].shape, info.features[f].tf_dtype) for f in keep}
    decode = None
    if encoded:
        from engine import images  # noqa: PLC0415  (only runs that read photos need it)

        steps = [images.decoder(config, f) for f in encoded]

        def decode(example, seed, training):
            for one in steps:
                example = one(example, seed, training)
            return example

        spec.update({f: tf.TensorSpec([config.image_size, config.image_size, 3], tf.uint8) for f in encoded})
    for feature, feature_spec in spec.items():
        if not feature_spec.shape.is_fully_defined():
            raise ConfigError(f"--dataset={name}: {feature} has no fixed shape ({feature_spec.shape})")
    decoded_bytes = sum(s.shape.num_elements() * s.dtype.size for f, s in spec.items() if f not in encoded)
    known = {}
    if "label" in info.features and hasattr(info.features["label"], "num_classes"):
        known["num_classes"] = info.features["label"].num_classes

    def parse(record):
        example = info.features.deserialize_example(record, decoders=decoders)
        return {f: example[f] for f in keep}

    def split_fn(flag, split):
        try:
            split_info = info.splits[split]
        except (KeyError, ValueError, AssertionError) as e:
            raise ConfigError(
                f"--{flag}={split}: not a split of {name} (splits: {', '.join(info.splits.keys())}; {e})"
            ) from None
        size = split_info.num_examples
        if not size:  # tfds would fail on reading it ("corresponds to no data")
            raise ConfigError(f"--{flag}={split}: holds no examples of {name}")
        held = size * decoded_bytes + (int(split_info.num_bytes) if encoded else 0)
        if held < _IN_MEMORY_LIMIT_BYTES:
            arrays = builder.as_dataset(split=split, shuffle_files=False, batch_size=-1, decoders=decoders)
            return in_memory({f: arrays[f] for f in keep})
        files = [str(path) for path in split_info.filepaths]
        if info.file_format == tfds.core.FileFormat.TFRECORD and all(tf.io.gfile.exists(f) for f in files):
            return sharded(zip(files, split_info.shard_lengths), parse)

        def make():  # another file format: tfds reads it
            ds = builder.as_dataset(split=split, shuffle_files=False, decoders=decoders)
            return ds.map(lambda x: {f: x[f] for f in keep})

        return Split(size, make)

    train = split_fn("train_split", config.train_split)
    return Source(train, split_fn("eval_split", eval_split), spec, known, decode)


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
