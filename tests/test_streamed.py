"""Splits of record files too large for memory: each input pipeline reads only its own files, a restart starts at
its position by arithmetic (reading at most one group of files), resumed runs end bit-identical to uninterrupted
ones, a damaged file stops the run naming it, and a changed worker count is refused for them (and exact for splits
held in memory)."""

import dataclasses
import json
import os
import re
import time

import numpy as np
import pytest
import tensorflow as tf

from engine.data import datasets as data
from engine.data import streamed
from engine.data.pipeline import Pipelines
from engine.data.records import Source, in_memory, sharded
from engine.run import build, inputs, loop
from engine.run.actions.builtin import INPUT_WINDOW_STEPS
from engine.settings.errors import ConfigError
from tests import helpers

# Twelve files of 5 to 27 records: uneven, as real shards are. A record's image holds its id, file * 1000 + record.
COUNTS = (5, 27, 9, 14, 20, 6, 11, 25, 8, 17, 12, 22)


def _write(directory, counts=COUNTS):
    files = []
    for f, count in enumerate(counts):
        path = os.path.join(directory, f"train-{f:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(count):
                example_id = f * 1000 + r
                features = {
                    "image": tf.train.Feature(float_list=tf.train.FloatList(value=[example_id, r, f, 1.0])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[example_id % 10])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
        files.append((path, count))
    return files


def _parse(record):
    spec = {"image": tf.io.FixedLenFeature([4], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}
    return tf.io.parse_single_example(record, spec)


@pytest.fixture
def records(tmp_path, monkeypatch):
    """The files, and data.load reading them as a streamed split (evaluated on the in-memory digits' shape)."""
    files = _write(str(tmp_path))
    evals = in_memory({"image": tf.zeros([10, 4]), "label": tf.range(10, dtype=tf.int64)})
    spec = {"image": tf.TensorSpec([4], tf.float32), "label": tf.TensorSpec([], tf.int64)}
    source = Source(sharded(files, _parse), evals, spec, {"num_classes": 10})
    monkeypatch.setattr(data, "load_source", lambda config, features, split=None: source)
    return files


def _config(**overrides):
    return helpers.make_config("", **{"global_batch_size": 16, "shuffle_buffer": 8, "interleave_files": 3, **overrides})


def _ids(batches):
    return [int(i) for b in batches for i in b["image"][:, 0].numpy()]


@pytest.mark.slow
@pytest.mark.parametrize("pipelines", [2, 4])
def test_each_pipeline_reads_only_its_own_files(records, pipelines):
    loaded = inputs.run_data(_config())
    sizes = {f: os.path.getsize(path) for f, (path, _) in enumerate(records)}
    total = sum(sizes.values())
    owned, read = [], []
    for i in range(pipelines):
        counter = tf.Variable(0, dtype=tf.int64)
        batches = iter(loaded.train_fn(tf.distribute.InputContext(pipelines, i, pipelines), 0, counter=counter))
        ids = _ids(next(batches) for _ in range(240 // (16 // pipelines)))  # 240 examples: several epochs of its own
        files = {i // 1000 for i in ids}
        own = sum(COUNTS[f] for f in files)
        # Every example of its files, each epoch once: the first epoch is a permutation of them.
        assert sorted(ids[:own]) == sorted(f * 1000 + r for f in files for r in range(COUNTS[f]))
        owned.append(files)
        read.append((int(counter.numpy()), sum(sizes[f] for f in files)))
    assert set().union(*owned) == set(range(len(COUNTS))) and sum(map(len, owned)) == len(COUNTS)  # disjoint
    for bytes_read, own_bytes in read:
        # Its own files only, whole: a whole number of epochs of them, plus what it read ahead.
        assert bytes_read >= own_bytes
    # The share of one epoch's bytes each pipeline reads: about 1/pipelines of the files, never all of them.
    shares = [own / total for _, own in read]
    print(f"{pipelines} pipelines: bytes of the split each reads per epoch {[round(s, 3) for s in shares]}")
    assert sum(shares) == pytest.approx(1.0) and max(shares) < 1.6 / pipelines


def test_a_restart_reads_as_little_at_step_100000_as_at_step_100(records):
    group = sum(sorted(os.path.getsize(path) for path, _ in records)[-3:])  # the 3 largest files
    read = {}
    for start in (100, 100_000):  # 100,000 steps of 16 are 9,000 epochs of these files
        counter = tf.Variable(0, dtype=tf.int64)
        pipelines = Pipelines(_config(), data.load_source(None, ()))
        next(iter(pipelines.examples(tf.distribute.InputContext(), start, 0, counter)))
        read[start] = int(counter.numpy())
    # One group of files at most (the interleave reads ahead within it), wherever the position is.
    assert 0 < read[100] <= 2 * group and 0 < read[100_000] <= 2 * group, (read, group)


@pytest.mark.slow
@pytest.mark.parametrize("pipelines", [1, 2])
def test_resuming_at_a_batch_reads_what_an_uninterrupted_run_reads(records, pipelines):
    loaded = inputs.run_data(_config())
    for i in range(pipelines):
        ctx = tf.distribute.InputContext(pipelines, i, pipelines)
        straight = list(loaded.train_fn(ctx, 0).take(45))
        for start in (1, 17, 37):  # inside a group, at an epoch's end, several epochs on
            resumed = list(loaded.train_fn(ctx, start).take(45 - start))
            for a, b in zip(straight[start:], resumed, strict=True):
                for key in ("image", "label", "index"):
                    np.testing.assert_array_equal(a[key], b[key])


def test_stream_positions_match_the_random_access_convention(records):
    """`index` is the global stream position, as in memory: a pipeline's share of batch k is every n-th of it."""
    loaded = inputs.run_data(_config())
    seen = []
    for i in range(2):
        for k, batch in enumerate(loaded.train_fn(tf.distribute.InputContext(2, i, 2), 3).take(2)):
            np.testing.assert_array_equal(batch["index"], (3 + k) * 16 + np.arange(i, 16, 2))
            seen += batch["index"].numpy().tolist()
    assert sorted(seen) == list(range(48, 80))


def _train(config, strategy, steps, workdir=None, resume_from=None):
    trainer = build.run(config, strategy)
    checkpoint = tf.train.Checkpoint(**trainer.state.tracked())
    if resume_from:
        checkpoint.restore(resume_from).assert_existing_objects_matched()
    trainer.program.run_steps(trainer.program.train_iterator(), steps)
    path = checkpoint.save(os.path.join(workdir, "ckpt")) if workdir else None
    return helpers.snapshot(trainer), path, trainer


@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored"])
@pytest.mark.slow
def test_a_resumed_streamed_run_ends_bit_identical(records, tmp_path, strategy_name, request):
    strategy = request.getfixturevalue(strategy_name)
    config = _config(deterministic=True, hidden_sizes=(8,), learning_rate=0.05)
    straight, _, _ = _train(config, strategy, 14)
    _, saved, _ = _train(config, strategy, 6, workdir=str(tmp_path))
    resumed, _, trainer = _train(config, strategy, 8, resume_from=saved)
    assert int(trainer.state.batches.numpy()) == 14
    for name in straight:
        for a, b in zip(straight[name], resumed[name], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_changed_worker_count_is_refused_for_files_and_exact_in_memory(records, one_device, data_dir, monkeypatch):
    trainer = build.run(_config(), one_device)
    trainer.state.input_pipelines.assign(2)  # as a run of 2 workers saved it
    with pytest.raises(ConfigError, match=r"with 2 input pipelines \(workers\).*now has 1.*resume it with 2 workers"):
        trainer.program.train_iterator()
    monkeypatch.undo()  # the digits, held in memory: one global stream, whatever reads it
    trainer = build.run(helpers.make_config(data_dir), one_device)
    trainer.state.input_pipelines.assign(2)
    trainer.state.batches.assign(5)
    assert trainer.program.train_iterator() is None  # not refused; each step gathers its batch from the data position
    batch = trainer.data.gather(tf.constant(5, tf.int64), tf.constant(0, tf.int64), trainer.program.pipelines)
    loaded = inputs.run_data(helpers.make_config(data_dir))
    halves = [next(iter(loaded.train_fn(tf.distribute.InputContext(2, i, 2), 5))) for i in range(2)]
    assert sorted(batch["index"].numpy()) == sorted(np.concatenate([h["index"] for h in halves]))
    assert int(trainer.state.input_pipelines.numpy()) == 1  # what the next checkpoint says


def test_a_run_resumed_on_other_record_files_says_so(records, one_device, tmp_path, monkeypatch, capsys):
    """A record file removed between two runs of one workdir: the resumed run's data position counts into another
    order, which it says (it went on silently)."""
    config = _config(workdir=str(tmp_path / "run"), train_steps=4, steps_per_loop=2, checkpoint_every=2)
    loop.train(config, one_device)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training_split"] == {
        "examples": sum(COUNTS),
        "files": len(COUNTS),
    }
    loop.train(dataclasses.replace(config, train_steps=6), one_device)  # the same files: nothing to say
    assert "warning" not in capsys.readouterr().out
    fewer = records[:-1]
    before = data.load_source(config, ())
    source = Source(sharded(fewer, _parse), before.evals, before.spec, before.info)
    monkeypatch.setattr(data, "load_source", lambda config, features, split=None: source)
    loop.train(dataclasses.replace(config, train_steps=8), one_device)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert said == [
        f"warning: --dataset=digits: its --train_split=train holds {sum(COUNTS[:-1])} examples in 11 record files now, "
        f"{sum(COUNTS)} examples in 12 record files when this run last started ({tmp_path}/run/config.json): it goes "
        "on from its data position at step 6 in the order of what the split holds now, not the examples an "
        "uninterrupted run would have read"
    ]


def test_a_pipeline_left_only_empty_files_is_refused_naming_them(tmp_path, monkeypatch):
    """Two files, one empty, for two pipelines: the one that owns the empty file had nothing to read, ever (its
    epoch of no records divided the position by zero: a traceback, exit 1, after config.json was written)."""
    files = _write(str(tmp_path), counts=(20, 0))
    evals = in_memory({"image": tf.zeros([10, 4]), "label": tf.range(10, dtype=tf.int64)})
    spec = {"image": tf.TensorSpec([4], tf.float32), "label": tf.TensorSpec([], tf.int64)}
    source = Source(sharded(files, _parse), evals, spec, {"num_classes": 10})
    monkeypatch.setattr(data, "load_source", lambda config, features, split=None: source)
    loaded = inputs.run_data(_config())
    refused = []
    for i in range(2):
        try:
            next(iter(loaded.train_fn(tf.distribute.InputContext(2, i, 2), 0)))
        except ConfigError as e:
            refused.append(str(e))
    assert len(refused) == 2 and refused[0] == refused[1], refused  # every worker refuses it alike
    assert re.search(
        r"input pipeline [01] of 2 \(workers\) would read only record files of --train_split=train that hold no "
        r"records \(.*train-00001\.tfrecord\)",
        refused[0],
    ), refused[0]
    # The run checks it as it is built, before anything is written: the same line.
    with pytest.raises(ConfigError, match=r"would read only record files .* hold no records"):
        streamed.check_enough_files(loaded.train_shards, _config().data, 2)


def test_a_truncated_record_file_stops_the_run_naming_it(records, one_device):
    path, count = records[4]
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:
        f.write(content[: len(content) // 2])
    trainer = build.run(_config(steps_per_loop=50), one_device)
    with pytest.raises(data.DecodeError) as raised:
        trainer.program.run_steps(trainer.program.train_iterator(), 50)  # 800 examples: every file is read
    message = str(raised.value)
    assert path in message and re.search(
        rf"corrupt: it cannot be read past its first \d+ records \(of {count}\)", message
    )


@pytest.mark.slow
def test_an_input_bound_run_warns_once_and_reports_its_wait(
    records, tmp_path, one_device, data_dir, capsys, monkeypatch, request
):
    from tensorflow.python.framework import config as tf_config

    from engine.run import loop

    # Op determinism (enabled for the process by any earlier --deterministic run) refuses the timestamps: off here.
    if tf_config.is_op_determinism_enabled():
        tf_config.disable_op_determinism()
        request.addfinalizer(tf_config.enable_op_determinism)
    source = data.load_source(None, ())

    def slow(example, seed, training):  # a decode that costs 20 ms: far slower than the step
        image = tf.py_function(lambda x: time.sleep(0.02) or x, [example["image"]], tf.float32)
        return {**example, "image": tf.ensure_shape(image, [4])}

    slowed = dataclasses.replace(source, decode=slow)
    monkeypatch.setattr(data, "load_source", lambda config, features, split=None: slowed)
    config = _config(workdir=str(tmp_path / "slow"), train_steps=70, steps_per_loop=10, global_batch_size=4)
    summary = loop.train(config, one_device)
    out = capsys.readouterr().out
    assert out.count("warning: input-bound: the steps waited for input") == 1, out
    assert summary["input_wait_fraction"] > 0.5 and summary["input_bytes_read"] > 0

    # Fewer timed steps than the window: the wait is reported, never warned about (the first round, with its
    # tracing, is not timed).
    short = _config(
        workdir=str(tmp_path / "short"), train_steps=INPUT_WINDOW_STEPS, steps_per_loop=10, global_batch_size=4
    )
    summary = loop.train(short, one_device)
    assert "input-bound" not in capsys.readouterr().out
    assert summary["input_wait_fraction"] > 0.5

    monkeypatch.undo()  # the digits, held in memory: nothing streamed, no bytes counted
    summary = loop.train(helpers.make_config(data_dir, workdir=str(tmp_path / "memory"), train_steps=2), one_device)
    assert summary["input_bytes_read"] is None


@pytest.mark.slow
def test_two_workers_resumed_as_one_are_refused_on_files_and_continue_in_memory(data_dir, tmp_path):
    from tests.test_file_sources import _shards

    _shards(tmp_path, "train", [40] * 6)
    _shards(tmp_path, "test", [20])
    common = [f"--data_dir={data_dir}", "--global_batch_size=16", "--hidden_sizes=16", "--connect_timeout=120"]
    files = [
        f"--dataset=tfrecord:{tmp_path}/{{split}}-*",
        "--tfrecord_features=image:uint8:4x4x1,label:int64",
        "--tfrecord_classes=3",
    ]
    for run, dataset in (("files", files), ("memory", [])):
        workdir = tmp_path / run
        args = [f"--workdir={workdir}", *common, *dataset, "--steps_per_loop=5"]
        two = helpers.launch(*args, "--train_steps=10", "--strategy=multi_worker", "--local_workers=2")
        assert two.returncode == 0, two.stdout[-3000:]
        before = {p.name: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
        one = helpers.launch(*args, "--train_steps=20", "--strategy=one_device")
        if run == "files":
            assert one.returncode == 2, one.stderr[-3000:]
            assert one.stderr.strip().splitlines()[-1] == (
                f"error: --dataset=tfrecord:{tmp_path}/{{split}}-*: this run read its streamed training files with "
                "2 input pipelines (workers) up to its data position, and now has 1: each pipeline reads its own "
                "files, so the position means nothing to 1; resume it with 2 workers, or train in a new --workdir"
            )
            assert {p.name: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before
        else:  # one global stream: one process continues from the same data position
            assert one.returncode == 0, one.stderr[-3000:]
            assert "resumed from step 10" in one.stdout
            assert json.load(open(workdir / "summary.json"))["step"] == 20


def test_a_parameter_server_workers_stream_is_built_inside_a_traced_function(records):
    """Under parameter servers each worker builds its dataset in a traced function, its stream number a tensor (the
    servers' counter): the streamed split places its start by graph arithmetic, alike to the eager build."""
    loaded = inputs.run_data(_config())
    ctx = tf.distribute.InputContext()
    traced = tf.function(lambda stream: loaded.train_fn(ctx, 7, stream))(tf.constant(2, tf.int64))
    eager = loaded.train_fn(ctx, 7, 2)
    other = loaded.train_fn(ctx, 7, 0)
    for a, b, c in zip(traced.take(12), eager.take(12), other.take(12)):
        np.testing.assert_array_equal(a["image"], b["image"])
        assert not np.array_equal(a["image"], c["image"])  # its own order


def test_uneven_shares_of_the_files_between_pipelines_are_warned_of(tmp_path):
    """Three files of 20 records for two pipelines: one owns two (40 records), the other one (20), and each reads
    half of every global batch, so the second's examples are read twice as often. A run says so as it is built."""
    files = _write(str(tmp_path), counts=(20, 20, 20))
    line = streamed.warn_of_uneven_shares(files, _config().data, 2)
    assert line is not None and re.search(r"give the 2 input pipelines \(workers\) (40/20|20/40) records", line), line
    assert "read 2.00x as often" in line
    # Even shares, and one pipeline, are not warned of.
    assert streamed.warn_of_uneven_shares(files[:2], _config().data, 2) is None
    assert streamed.warn_of_uneven_shares(files, _config().data, 1) is None
