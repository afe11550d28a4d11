"""Streamed record files: the bytes each input pipeline reads over an epoch (read amplification, counted as the
engine counts them), and restarting: how long until the first batch, and how many bytes read, at a data position
near the start and one far into the run, side by side with replaying the stream (what the engine did before it
placed positions by arithmetic on the files' record counts).

    python -m bench.resume            # 64 files of 1,000 records of 3 KiB (about 200 MB, written to a temp dir)
    python -m bench.resume --quick    # 16 files of 200 records

Prints the share of the split's bytes each of 1, 2 and 4 pipelines read for one epoch of training, then, for each
position, seconds to the first batch and bytes read, by file arithmetic and by replay.
"""

import argparse
import os
import tempfile
import time

import numpy as np
import tensorflow as tf

from bench.common import machine
from engine.data.pipeline import Pipelines
from engine.data.records import Source, sharded
from engine.settings.config import validate
from engine.settings.fields import Config

RECORD_BYTES = 3072  # a 32 x 32 x 3 uint8 image


def write(directory, files, records):
    rng = np.random.default_rng(0)
    out = []
    for f in range(files):
        path = os.path.join(directory, f"train-{f:05d}-of-{files:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(records):
                image = rng.integers(0, 256, RECORD_BYTES, dtype=np.uint8).tobytes()
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[(f * records + r) % 10])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        out.append((path, records))
    return out


def parse(record):
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    example = tf.io.parse_single_example(record, spec)
    image = tf.reshape(tf.io.decode_raw(example["image"], tf.uint8), [32, 32, 3])
    return {"image": image, "label": example["label"]}


def first_batch(pipelines, start, replay):
    counter = tf.Variable(0, dtype=tf.int64)
    ctx = tf.distribute.InputContext()
    tic = time.perf_counter()
    if replay:
        ds = pipelines._replayed(ctx, start, 0)
    else:
        ds = pipelines.examples(ctx, start, 0, counter)
    iterator = iter(ds.batch(pipelines.data.global_batch_size))
    next(iterator)
    seconds = time.perf_counter() - tic
    del iterator  # after the clock: deleting it waits out its tf.data autotuner's sleep (bench/RESULTS.md)
    return seconds, int(counter.numpy())


def shares(pipelines, files, records):
    """The bytes each of `count` pipelines reads while the job trains one epoch, as shares of the split's."""
    out = {}
    for count in (1, 2, 4):
        read = []
        for i in range(count):
            counter = tf.Variable(0, dtype=tf.int64)
            ctx = tf.distribute.InputContext(count, i, count)
            examples = pipelines.examples(ctx, 0, 0, counter)
            # One epoch of the job: its share of every global batch, until the job has seen the split once.
            next(iter(examples.skip(files * records // count - 1)))
            read.append(int(counter.numpy()) / pipelines.train_bytes)
        out[count] = read
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    files, records = (16, 200) if args.quick else (64, 1000)
    config = validate(Config(global_batch_size=256, shuffle_buffer=1024))
    with tempfile.TemporaryDirectory() as directory:
        split = sharded(write(directory, files, records), parse)
        spec = {"image": tf.TensorSpec([32, 32, 3], tf.uint8), "label": tf.TensorSpec([], tf.int64)}
        source = Source(split, split, spec, {"num_classes": 10})
        pipelines = Pipelines(config.data, source)
        total = pipelines.train_bytes
        print(f"machine: {machine()}")
        print(
            f"{files} files x {records} records, {total / 2**20:.0f} MiB; global batch 256; --interleave_files="
            f"{config.interleave_files}"
        )
        for count, read in shares(pipelines, files, records).items():
            print(
                f"{count} pipeline{'s' if count > 1 else ' '}: each read "
                f"{', '.join(f'{r:.3f}' for r in read)} of the split's bytes in one epoch (total {sum(read):.3f})"
            )
        epoch_batches = files * records // 256
        # Replay reads everything before the position: far positions only by arithmetic (it would take hours).
        near, far = min(100, epoch_batches // 2), 100_000  # near: within the first epoch of --quick's files too
        first_batch(pipelines, 0, False)  # traces the functions once: kept out of the times
        first_batch(pipelines, 0, True)
        replay_far = 4 * epoch_batches
        rows = [
            ("files", near, *first_batch(pipelines, near, False)),
            ("files", far, *first_batch(pipelines, far, False)),
            ("replay", near, *first_batch(pipelines, near, True)),
            ("replay", replay_far, *first_batch(pipelines, replay_far, True)),
        ]
        for how, start, seconds, read in rows:
            read_text = f"{read / 2**20:8.1f} MiB read" if how == "files" else "  (all before it)"
            print(f"{how:7s} restart at step {start:>7,}: {seconds:7.2f} s to the first batch {read_text}")
        ratio = rows[1][2] / rows[0][2]
        print(f"files: step {far:,} / step {near}: {ratio:.2f}x the time (constant: about 1)")
        print(f"replay: step {replay_far:,} / step {near}: {rows[3][2] / rows[2][2]:.1f}x the time (grows with it)")


if __name__ == "__main__":
    main()
