"""A training split streamed from record files too large for memory: each input pipeline (one per worker) owns
every n-th file and reads only those; the files' record counts place any data position by arithmetic, so a restart
skips whole epochs and groups of files unread and reads at most one group before its position."""

import math

import numpy as np
import tensorflow as tf

from engine.data.records import counted_records, record_example
from engine.settings.errors import ConfigError, counted

AUTOTUNE = tf.data.AUTOTUNE
UNEVEN_SHARES = 1.1  # the largest input pipeline's records over the smallest's above which a run is warned


def _fold(seed, *values):
    """A [2] int64 stateless seed mixed with `values` (ints or int tensors), one after the other."""
    for value in values:
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(value, tf.int64))
    return seed


def _permutation(n, seed):
    """A uniform random permutation of range(n) from a [2] int64 seed. (RandomIndexShuffle is far from uniform on
    a few elements, such as a pipeline's files: on 12 it leaves most in place, and it reads 16 bits of a seed word.)"""
    return tf.argsort(tf.random.stateless_uniform([n], seed=seed))


def check_enough_files(files, data, pipelines):
    """Refuses a streamed training split of fewer record `files` ((path, records), ...) than input `pipelines`, each
    of which reads files of its own, or one that leaves a pipeline only files without records (it would have
    nothing to read, ever): a run checks it as it is built, before anything is written. `data`: the run's
    config.data."""
    if len(files) < pipelines:
        raise ConfigError(
            f"--dataset={data.dataset}: its {counted(len(files), 'record file')} of --train_split={data.train_split} "
            f"cannot feed {pipelines} input pipelines (workers), each of which reads its own files; write the split "
            "in more files"
        )
    for pipeline, own in enumerate(_shares(files, data, pipelines)):
        if not sum(records for _, records in own):
            named = ", ".join(path for path, _ in own[:3]) + (", ..." if len(own) > 3 else "")
            raise ConfigError(
                f"--dataset={data.dataset}: input pipeline {pipeline} of {pipelines} (workers) would read only "
                f"record files of --train_split={data.train_split} that hold no records ({named}): remove the "
                "empty files, or write the split in more files"
            )


def warn_of_uneven_shares(files, data, pipelines):
    """Warns of a streamed training split whose files give the input `pipelines` (workers) unequal numbers of
    records; returns the line said, or None. Each pipeline reads --global_batch_size / pipelines examples a step
    from its own files, so one with fewer records goes through them more often: its examples weigh more in training
    than the others', and no step holds the examples one device would read."""
    if pipelines < 2:
        return None
    totals = [sum(records for _, records in own) for own in _shares(files, data, pipelines)]
    low, high = min(totals), max(totals)
    if not low or high <= UNEVEN_SHARES * low:
        return None
    line = (
        f"warning: --dataset={data.dataset}: its record files of --train_split={data.train_split} give the "
        f"{pipelines} input pipelines (workers) {'/'.join(str(t) for t in totals)} records: each reads the same "
        f"number of examples a step from its own files, so the examples of the smallest share are read "
        f"{high / low:.2f}x as often as those of the largest; write the split in files of equal size, as many as "
        "a multiple of the workers"
    )
    print(line, flush=True)
    return line


def owned(files, data, ctx):
    """Input pipeline ctx's files of the split's `files` ((path, records), ...): every n-th of a permutation fixed by
    the seed. `data`: the run's config.data."""
    check_enough_files(files, data, ctx.num_input_pipelines)
    return _shares(files, data, ctx.num_input_pipelines)[ctx.input_pipeline_id]


def _shares(files, data, pipelines):
    """Each of `pipelines` input pipelines' files of `files`: every n-th of a permutation fixed by the seed."""
    order = np.random.default_rng(data.seed).permutation(len(files))
    return [[files[i] for i in order[pipeline::pipelines]] for pipeline in range(pipelines)]


def examples(files, data, ctx, start_batch, stream, counter, position):
    """The examples of this pipeline's `files` (owned) from global batch `start_batch` on, unparsed, each with
    its `index` (`position(local)`: the global stream position of the pipeline's local-th example). Each epoch
    takes the files in an order drawn from (seed, stream, pipeline, epoch), --interleave_files at a time, shuffled
    in windows of --shuffle_buffer; the start is placed by arithmetic on the counts."""
    paths = tf.constant([path for path, _ in files])
    counts = tf.constant([records for _, records in files], tf.int64)
    per_epoch = sum(records for _, records in files)
    width = min(data.interleave_files, len(files))
    groups = math.ceil(len(files) / width)
    # Seeds of this pipeline's orders: the run's, its stream's, its own. (A parameter-server worker's stream
    # is a tensor of the traced dataset function: everything below is graph arithmetic.)
    key = _fold(tf.constant([data.seed, 0], tf.int64), stream, ctx.input_pipeline_id)

    def file_order(epoch):
        return _permutation(len(files), _fold(key, epoch))

    def group(epoch, g):
        chosen = file_order(epoch)[g * width : (g + 1) * width]
        ds = tf.data.Dataset.from_tensor_slices((tf.gather(paths, chosen), tf.gather(counts, chosen)))
        ds = ds.interleave(
            lambda path, n: counted_records(path, n, counter),
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

        return ds.batch(data.shuffle_buffer).enumerate().map(shuffle).unbatch()

    def epoch_stream(epoch, first_group=0):
        return tf.data.Dataset.range(first_group, groups).flat_map(lambda g: group(epoch, g))

    # Where the start lies, by arithmetic on the counts: the epochs and groups before it are never read.
    local = start_batch * (data.global_batch_size // ctx.num_input_pipelines)
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
        lambda i, item: {**record_example(*item), "index": position(i)}, num_parallel_calls=AUTOTUNE
    )
