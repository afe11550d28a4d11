"""The training and evaluation streams of a source (engine/data/datasets.py `Source`), each a pure function of the data
position: global batch k holds the same examples whatever the number of input pipelines, on every restart.

A split held in memory is gathered a global batch at a time; one in record files is read file by file, each
pipeline its own files, placed by arithmetic on their counts; any other is replayed up to the position. A
source's decode runs per example, seeded by its stream position, and an example it cannot decode stops the
run naming its position (`Pipelines.origin` names its file).
"""

import tensorflow as tf

from engine.data import streamed
from engine.data.records import file_records, op_message, parsed, unreadable
from engine.data.source_checks import checked_classes, file_bytes, outside

AUTOTUNE = tf.data.AUTOTUNE
_CHECK_EVERY = 256  # examples between the decode's markers: a stream whose every example fails stops within them
UNDECODABLE = "undecodable example at stream position"  # the pipeline's error; Data.origin names the file
# The decode's checks of an example (its label, its real numbers): the pipeline drops the example, and `origin` says
# why in its own words.
LABEL_OUTSIDE = "label outside num_classes"
NOT_FINITE = "NaN or infinity in a feature"


class Pipelines:
    """The training and evaluation streams of a source."""

    def __init__(self, data, source):
        # The run's config.data: what the streams read, and nothing else (a whole Config serves too: a benchmark's).
        self.data, self.source = data, source
        self.train_split, self.evals = source.train, source.evals
        self.train_bytes = sum(file_bytes(path, "training", data.dataset) for path, _ in self.train_split.files)
        self.classes = checked_classes(source)

    def position(self, ctx, local):
        """The global stream position of this pipeline's `local`-th training example: its share of global
        batch k is every n-th position of that batch, as with random access."""
        share = self.data.global_batch_size // ctx.num_input_pipelines
        return (
            (local // share) * self.data.global_batch_size
            + ctx.input_pipeline_id
            + (local % share) * ctx.num_input_pipelines
        )

    def seeds(self, index, stream):
        # Per example, from the run's seed, the stream and the example's position: a resumed run crops alike.
        return tf.stack([tf.constant(self.data.seed, tf.int64) + tf.cast(stream, tf.int64) * (1 << 32), index])

    # Training.

    def train(self, ctx, start_batch, stream, counter):
        """This pipeline's per-replica batches from global batch `start_batch` on."""
        split, data = self.train_split, self.data
        per_replica = ctx.get_per_replica_batch_size(data.global_batch_size)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        if split.fetch is not None and self.source.decode is None:
            return self._gathered(ctx, start_batch, stream, per_replica, local_replicas)
        ds = self.examples(ctx, start_batch, stream, counter)
        first = start_batch * (data.global_batch_size // ctx.num_input_pipelines)
        ds = self._decoded(ds, True, stream, first, lambda local: self.position(ctx, local))
        return ds.batch(per_replica, drop_remainder=True)

    def examples(self, ctx, start_batch, stream, counter=None):
        """This pipeline's training examples from global batch `start_batch` on, undecoded (a record file's
        unparsed), with `index`."""
        split = self.train_split
        if split.fetch is not None:
            share = self.data.global_batch_size // ctx.num_input_pipelines
            return self._gathered(ctx, start_batch, stream, share, 1).unbatch()
        if split.files:
            files = streamed.owned(self.train_split.files, self.data, ctx)
            position = lambda local: self.position(ctx, local)  # noqa: E731
            return streamed.examples(files, self.data, ctx, start_batch, stream, counter, position)
        return self._replayed(ctx, start_batch, stream)

    @tf.autograph.experimental.do_not_convert
    def order(self, positions, stream):
        """The examples at global stream `positions`: epoch e's permutation, element by element."""
        n = self.train_split.examples
        epoch, within = positions // n, positions % n
        seeds = tf.stack(
            [
                tf.fill(tf.shape(epoch), tf.constant(self.data.seed, tf.int64)),
                epoch,
                tf.fill(tf.shape(epoch), tf.cast(stream, tf.int64)),
            ],
            axis=-1,
        )
        # The raw op: tf.random.experimental.index_shuffle mis-pads a batch of seeds.
        return tf.raw_ops.RandomIndexShuffle(index=within, seed=seeds, max_index=n - 1, rounds=4)

    @tf.autograph.experimental.do_not_convert
    def share(self, batch, pipeline, num_pipelines, stream=0):
        """Input pipeline `pipeline`'s share of global batch `batch` (either may be a tensor), gathered from memory:
        the examples at stream positions pipeline, pipeline + n, ... of the batch, with their `index`."""
        positions = batch * self.data.global_batch_size + tf.range(
            pipeline, self.data.global_batch_size, num_pipelines, dtype=tf.int64
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
        # Several replicas here take consecutive elements: split the batch. Unbatching copies each slice, so one
        # replica skips it (measured: bench/RESULTS.md, section "One replica skips the unbatch").
        return ds if local_replicas == 1 else ds.unbatch()

    def _replayed(self, ctx, start_batch, stream):
        """A split with neither random access nor files: a shuffle buffer reshuffled each epoch; a restart
        replays the stream up to its position (reading, not training on, the examples before it)."""
        data, split = self.data, self.train_split
        ds = split.make().shuffle(
            min(data.shuffle_buffer, split.examples), seed=data.seed * 1000 + stream, reshuffle_each_iteration=True
        )
        start = start_batch * data.global_batch_size
        ds = ds.repeat().skip(start).enumerate(start).map(lambda i, x: {**x, "index": i})
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

    # Decoding.

    def _decoded(self, ds, training, stream, first, position, end=None):
        """`ds` with each example decoded (`decode`: a record file's record parsed, then the source's decode). A
        failure stops the pipeline naming the example's position: the decode runs in parallel and its errors are
        dropped, and the positions that come out are checked against `position(first), position(first + 1), ...`
        (up to `end`, exclusive)."""
        split = self.train_split if training else self.evals
        # A split held in memory without a decode had its labels and real numbers checked as it loaded
        # (engine/data/source_checks.py); a streamed one without either has nothing to check.
        reals = any(s.dtype.is_floating for k, s in ds.element_spec.items() if k not in ("index", "weight"))
        checked = split.fetch is not None or (self.classes is None and not reals)
        if self.source.decode is None and not split.files and checked:
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
        """An example of `split` as the task sees it: its record parsed (a record file's), then the source's decode
        (without one, its real numbers are checked finite: a NaN input reads as a run that diverged), then its label
        checked against the info's num_classes: a step compiled by XLA, and a GPU's, read a label outside them as a
        NaN loss, not an error. A failed check drops the example, and `origin` says why."""
        if split.files:
            example = parsed(split.parse, example)
        example = {k: v for k, v in example.items() if k != "origin"}
        if self.source.decode is None:
            example = _finite_checked(example)
        else:
            example = self.source.decode(example, self.seeds(index, stream), training)
        return self._label_checked(example)

    def _label_checked(self, example):
        if self.classes is None or "label" not in example:
            return example
        label = tf.cast(example["label"], tf.int64)  # compared in int64: a uint8 label of 256 classes fits
        inside = tf.logical_and(label >= 0, label < self.classes)
        found = tf.debugging.Assert(inside, [LABEL_OUTSIDE, label, self.classes], summarize=1)
        with tf.control_dependencies([found]):
            return {**example, "label": tf.identity(example["label"])}

    def origin(self, position, stream=0, training=True, pipelines=1):
        """Why the example at `position` (of the training stream read with `pipelines` input pipelines, or
        of the evaluation split) could not be decoded: its file and the decoder's error."""
        data = self.data
        if training:
            pipeline = position % data.global_batch_size % pipelines
            ctx = tf.distribute.InputContext(pipelines, pipeline, pipelines)
            k, within = divmod(position, data.global_batch_size)
            ds = self.examples(ctx, k, stream).skip((within - pipeline) // pipelines)
        else:
            ds = self._unparsed(self.evals).skip(position)
        try:
            example = next(iter(ds.take(1)))
        except tf.errors.OpError as e:  # the file itself cannot be read
            return f"--dataset={data.dataset}: cannot read example {position}: {op_message(e)}"
        split = self.train_split if training else self.evals
        where = example.get("origin")
        if where is not None:  # its file (and record): a name that is not UTF-8 said by its bytes
            where = where.numpy().decode(errors="backslashreplace")
        elif not training:  # evaluation reads its split in order
            where = f"example {position} of the split"
        elif split.fetch is not None:  # training: each epoch's permutation of the split held in memory
            where = f"example {int(self.order(tf.constant([position], tf.int64), stream)[0])} of the split"
        else:  # a stream without random access: where a shuffle buffer put it
            where = f"the example at position {position} of the training stream"
        features = {k: v for k, v in example.items() if k not in ("index", "weight")}
        if split.files:
            try:  # in a graph, as in the pipeline: its checks' messages read alike
                features = tf.function(lambda example: parsed(split.parse, example))(features)
            except tf.errors.OpError as e:
                damaged = unreadable(e) or f"cannot parse {where}: {op_message(e)}"
                return f"--dataset={data.dataset}: {damaged}"
        features.pop("origin", None)
        reals = features.items() if self.source.decode is None else ()  # a decode's are its own to make
        unreal = [k for k, v in reals if v.dtype.is_floating and not tf.reduce_all(tf.math.is_finite(v))]
        if unreal:
            return f"--dataset={data.dataset}: {where} holds NaN or infinity in its {unreal[0]}"
        try:
            if self.source.decode is not None:  # in a graph, as in the pipeline: a check's message reads alike
                decode = tf.function(lambda example, seed: self.source.decode(example, seed, training))
                features = decode(features, self.seeds(tf.constant(position, tf.int64), stream))
        except tf.errors.OpError as e:
            return f"--dataset={data.dataset}: cannot decode {where}: {op_message(e)}"
        label = features.get("label") if self.classes is not None else None
        if label is not None and not 0 <= int(label) < self.classes:
            return f"--dataset={data.dataset}: {where} {outside(int(label), self.classes)}"
        read = "the training stream" if training else "the evaluation"
        return f"--dataset={data.dataset}: {where} (position {position} of {read}) was lost before decoding"

    def _unparsed(self, split):
        """The examples of `split` in order, a record file's unparsed (`decode` parses them)."""
        return file_records(split.files) if split.files else split.make()

    # Evaluation.

    def evaluation(self, ctx, eval_steps):
        """This pipeline's share of the evaluation split, in order, padded with weight-0 examples to
        `eval_steps` batches per replica: every example counts exactly once."""
        data, source = self.data, self.source
        # An example counts once unless its source says how much it counts (a text window: its characters).
        ds = self._unparsed(self.evals).enumerate().map(lambda i, x: {"weight": tf.constant(1.0), **x, "index": i})
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        pid, n = ctx.input_pipeline_id, ctx.num_input_pipelines
        mine = len(range(pid, self.evals.examples, n))
        ds = self._decoded(ds, False, 0, 0, lambda local: pid + local * n, end=mine)
        padding = {k: tf.zeros(s.shape, s.dtype) for k, s in source.spec.items()}
        padding.update(index=tf.constant(-1, tf.int64), weight=tf.constant(0.0))
        ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat())
        ds = ds.batch(ctx.get_per_replica_batch_size(data.per_eval_batch_size), drop_remainder=True)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return ds.take(eval_steps * local_replicas)


def _finite_checked(example):
    """`example` once its real numbers (a record's float features, a streamed split's) are finite."""
    reals = [v for v in example.values() if v.dtype.is_floating]  # the features alone (no index, no weight)
    if not reals:
        return example
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in reals])
    found = tf.debugging.Assert(finite, [NOT_FINITE], summarize=1)
    with tf.control_dependencies([found]):
        return {k: tf.identity(v) for k, v in example.items()}
