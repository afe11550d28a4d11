"""Input pipelines: per-worker shards that add up to the one-device batches, evaluation padding, the
bundled digits builder; in memory and streamed (a split too large for memory; its files are read by pipeline:
tests/test_streamed.py)."""

import collections
import gzip
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from engine.data import datasets as data
from engine.data import tfds_source
from engine.data.records import Source, in_memory
from engine.run import build, inputs
from sources import digits
from tests import helpers


def _batches(dataset, count):
    """(images, labels) of the first `count` batches."""
    return [(batch["image"].numpy(), batch["label"].numpy()) for batch in dataset.take(count)]


def _key(image):
    return image.tobytes()


def _store(storage, monkeypatch):
    """A tfds split is held in memory, or streamed through a shuffle buffer as one larger than memory is
    (forced here for digits)."""
    if storage == "streamed":
        monkeypatch.setattr(tfds_source, "_IN_MEMORY_LIMIT_BYTES", 0)


@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
def test_workers_split_each_global_batch_exactly(data_dir, dataset):
    config = helpers.make_config(data_dir, dataset=dataset, synthetic_shape=(4, 4, 1), synthetic_examples=256)
    loaded = inputs.run_data(config)
    one = _batches(loaded.train_fn(tf.distribute.InputContext()), 30)  # spans several epochs
    workers = [_batches(loaded.train_fn(tf.distribute.InputContext(2, i, 2)), 30) for i in range(2)]
    for step in range(30):
        assert sorted(_key(x) for w in workers for x in w[step][0]) == sorted(_key(x) for x in one[step][0])
        assert sorted(np.concatenate([w[step][1] for w in workers]).tolist()) == sorted(one[step][1].tolist())


def _examples(dataset):
    return [
        (x.tobytes(), int(y))
        for b in dataset
        for x, y, w in zip(b["image"].numpy(), b["label"].numpy(), b["weight"].numpy())
        if w
    ]


def test_one_epoch_of_two_workers_is_the_dataset_without_overlap(data_dir):
    # The eval pipeline reads each example once: pointed at the training split it shows one epoch.
    loaded = inputs.run_data(helpers.make_config(data_dir, eval_split="train", eval_batch_size=2))
    workers = [_examples(loaded.eval_fn(tf.distribute.InputContext(2, i, 2))) for i in range(2)]
    everything = _examples(loaded.eval_fn(tf.distribute.InputContext()))
    assert len(everything) == 1257 and abs(len(workers[0]) - len(workers[1])) <= 1
    assert collections.Counter(workers[0] + workers[1]) == collections.Counter(everything)


@pytest.mark.parametrize("pipelines", [1, 2])
def test_eval_padding_counts_each_example_once(data_dir, pipelines):
    config = helpers.make_config(data_dir, eval_batch_size=64)
    loaded = inputs.run_data(config)
    assert (loaded.eval_examples, loaded.eval_steps) == (360, 6)
    total, batches = 0.0, 0
    for i in range(pipelines):
        for batch in loaded.eval_fn(tf.distribute.InputContext(pipelines, i, pipelines)):
            assert batch["image"].shape[0] == 64 // pipelines  # static shape: padding, not a ragged last batch
            total += float(tf.reduce_sum(batch["weight"]))
            batches += 1
    assert total == 360 and batches == 6 * pipelines


def test_digits_splits_and_values(data_dir):
    import tensorflow_datasets as tfds

    builder = tfds.builder("digits", data_dir=data_dir)
    assert {k: v.num_examples for k, v in builder.info.splits.items()} == {
        "train": 1257,
        "validation": 180,
        "test": 360,
    }
    rows = list(digits.read_rows())
    assert len(rows) == 1797 and max(int(image.max()) for image, _ in rows) == 255
    assert sorted({label for _, label in rows}) == list(range(10))


def test_corrupt_digits_row_names_the_line(tmp_path):
    path = tmp_path / "bad.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(",".join(["0"] * 65) + "\n" + ",".join(["3"] * 64) + ",12\n")
    with pytest.raises(ValueError, match=r"bad.csv.gz:2: expected"):
        list(digits.read_rows(str(path)))


def test_synthetic_is_deterministic_and_learnable_shape(data_dir):
    config = helpers.make_config(
        data_dir, dataset="synthetic", synthetic_shape=(5, 3), synthetic_classes=4, synthetic_examples=128
    )
    a = _batches(inputs.run_data(config).train_fn(tf.distribute.InputContext()), 2)
    b = _batches(inputs.run_data(config).train_fn(tf.distribute.InputContext()), 2)
    np.testing.assert_array_equal(a[1][0], b[1][0])
    assert a[0][0].shape == (64, 5, 3) and set(np.unique(a[0][1])) <= {0, 1, 2, 3}
    assert len(np.unique(np.concatenate([a[0][1], a[1][1]]))) > 1


@pytest.mark.parametrize("storage,pipelines", [("in_memory", 1), ("in_memory", 2), ("streamed", 1)])
def test_resuming_at_a_batch_reads_what_an_uninterrupted_run_reads(data_dir, pipelines, storage, monkeypatch):
    _store(storage, monkeypatch)
    loaded = inputs.run_data(helpers.make_config(data_dir))
    for i in range(pipelines):
        ctx = tf.distribute.InputContext(pipelines, i, pipelines)
        straight = _batches(loaded.train_fn(ctx, 0), 45)
        resumed = _batches(loaded.train_fn(ctx, 37), 8)
        for a, b in zip(straight[37:], resumed, strict=True):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])


def test_each_epoch_is_a_permutation(data_dir):
    config = helpers.make_config(data_dir, dataset="synthetic", synthetic_shape=(3,), synthetic_examples=256)
    loaded = inputs.run_data(config)
    epochs = [
        np.concatenate([b[0] for b in _batches(loaded.train_fn(tf.distribute.InputContext(), e * 4), 4)])
        for e in range(2)
    ]
    assert sorted(map(_key, epochs[0])) == sorted(map(_key, epochs[1]))  # the same examples, once each
    assert len(set(map(_key, epochs[0]))) == 256
    assert not np.array_equal(epochs[0], epochs[1])  # in a new order


def test_streamed_epochs_are_new_permutations_of_the_split(data_dir, monkeypatch):
    config = helpers.make_config(data_dir, eval_split="train", eval_batch_size=2)
    in_memory = inputs.run_data(config)
    split = _examples(in_memory.eval_fn(tf.distribute.InputContext()))  # the training split, each example once
    _store("streamed", monkeypatch)
    streamed = inputs.run_data(config)
    n = streamed.train_examples
    stream = [
        (x.tobytes(), int(y))
        for xs, ys in _batches(streamed.train_fn(tf.distribute.InputContext()), 2 * n // 64 + 1)
        for x, y in zip(xs, ys)
    ]
    epochs = [stream[:n], stream[n : 2 * n]]
    assert collections.Counter(epochs[0]) == collections.Counter(epochs[1]) == collections.Counter(split)
    assert epochs[0] != epochs[1], "the second epoch repeats the first one's order"
    assert streamed.sharded and not in_memory.sharded  # its files, read by pipeline; not the in-memory path


@pytest.mark.parametrize("pipelines", [1, 2])
def test_a_gathered_share_is_the_pipelines_batch(data_dir, pipelines):
    """What a step gathers for itself (data.gather) is, batch for batch, what each worker's pipeline gives it,
    across epochs (digits: 1,437 training examples, 40 batches of 64 run into the second epoch)."""
    config = helpers.make_config(data_dir)
    loaded = inputs.run_data(config)
    for worker in range(pipelines):
        dataset = loaded.train_fn(tf.distribute.InputContext(pipelines, worker, pipelines), 3)
        for k, batch in enumerate(dataset.take(40), start=3):
            gathered = loaded.gather(tf.constant(k, tf.int64), tf.constant(worker, tf.int64), pipelines)
            share = config.global_batch_size // pipelines  # worker w: positions w, w + n, ... of global batch k
            expected = k * config.global_batch_size + worker + pipelines * np.arange(share)
            np.testing.assert_array_equal(gathered["index"].numpy(), expected)
            assert gathered.keys() == batch.keys()
            for name in batch:
                np.testing.assert_array_equal(gathered[name].numpy(), batch[name].numpy())


def test_steps_gather_their_batches_on_one_cpu_replica_and_train_as_the_pipeline_does(
    data_dir, one_device, mirrored, monkeypatch
):
    """One CPU replica per worker and a split held in memory: each step gathers its own batch (no pipeline to wait
    on). Rounds that do match rounds fed by the pipeline, and a run resumed at another batch reads on from it."""

    config = helpers.make_config(data_dir, train_steps=30)
    gathering = build.run(config, one_device)
    assert gathering.program.in_step and gathering.program.train_iterator() is None
    fed = build.run(config, one_device)
    fed.program.input = fed.program.input_path(in_step=False)
    for steps in (7, 13):  # rounds of uneven length: each starts at the data position the last one left
        out = gathering.program.run_steps(gathering.program.train_iterator(), steps)
        reference = fed.program.run_steps(fed.program.train_iterator(), steps)
        assert out["input_wait"] == 0.0 and out["steps"] == reference["steps"] == steps
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert int(gathering.state.batches.numpy()) == int(fed.state.batches.numpy()) == 20
    for a, b in zip(gathering.weights.variables, fed.weights.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
    # Several replicas in one process (mirrored), a split streamed from its files: the pipeline.
    assert not build.run(config, mirrored).program.in_step
    _store("streamed", monkeypatch)
    assert not build.run(config, one_device).program.in_step


def test_a_replayed_tfds_stream_reshuffles_each_epoch_reproducibly_from_the_seed(data_dir, tmp_path, monkeypatch):
    """A tensorflow-datasets split with neither random access nor record files (here: tfds's mock data behind the
    digits' metadata, its files absent) is streamed through a shuffle buffer and replayed on a restart: each epoch
    is a new order of the split, the same for the same seed, another for another seed."""
    import dataclasses
    import os
    import shutil

    import tensorflow_datasets as tfds

    metadata = tmp_path / "digits" / "1.0.0"
    metadata.mkdir(parents=True)
    for name in ("dataset_info.json", "features.json"):  # the split sizes and features, no record file
        shutil.copy(os.path.join(data_dir, "digits", "1.0.0", name), metadata)
    _store("streamed", monkeypatch)
    n = 256  # 4 batches of 64 an epoch
    config = helpers.make_config(str(tmp_path), train_split=f"train[:{n}]")

    def stream(config, start=0, batches=8):
        loaded = inputs.run_data(config)
        assert (loaded.gather, loaded.sharded, loaded.train_examples) == (None, False, n)  # replayed, not gathered
        return [
            _key(x) for xs, _ in _batches(loaded.train_fn(tf.distribute.InputContext(), start), batches) for x in xs
        ]

    with tfds.testing.mock_data(num_examples=n, data_dir=str(tmp_path), policy=tfds.testing.MockPolicy.USE_FILES):
        first = stream(config)
        again, resumed = stream(config), stream(config, start=5, batches=3)
        other = stream(dataclasses.replace(config, seed=1), batches=4)
    epochs = [first[:n], first[n:]]
    assert len(set(epochs[0])) == n and sorted(epochs[0]) == sorted(epochs[1])  # each epoch the split, once
    assert epochs[0] != epochs[1], "the second epoch repeats the first one's order"
    assert again == first and resumed == first[5 * 64 :]  # a function of the seed and the position
    assert other != epochs[0] and sorted(other) == sorted(epochs[0])


@pytest.mark.parametrize(
    "flag,split",
    [("train_split", "train[:0]"), ("eval_split", "test[:0]"), ("eval_split", "test[100%:]")],
)
def test_an_empty_tfds_split_is_refused_in_one_line(data_dir, flag, split):
    from engine.settings.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        inputs.run_data(helpers.make_config(data_dir, **{flag: split}))
    assert str(raised.value) == f"--{flag}={split}: holds no examples of digits"


def test_any_source_with_an_empty_evaluation_split_is_refused(monkeypatch):
    """Whatever the source (here one built in the test), no evaluation reports a mean over no examples."""
    from engine.settings.errors import ConfigError
    from engine.settings.fields import Config

    split = lambda n: in_memory({"image": tf.zeros([n, 4]), "label": tf.zeros([n], tf.int64)})  # noqa: E731
    spec = {"image": tf.TensorSpec([4], tf.float32), "label": tf.TensorSpec([], tf.int64)}
    source = Source(split(64), split(0), spec, {"num_classes": 2})
    monkeypatch.setattr(data, "load_source", lambda config, features, split=None: source)
    with pytest.raises(ConfigError) as raised:
        inputs.run_data(helpers.make_config("", dataset="synthetic"), "validation")
    assert str(raised.value) == "--dataset=synthetic: the split validation it evaluates holds no examples"
    with pytest.raises(ConfigError) as raised:  # a fork's Config, not validated: no --dataset, the task's own
        inputs.run_data(Config(), "validation")
    assert str(raised.value) == "--dataset=digits: the split validation it evaluates holds no examples"


def test_an_order_setting_the_training_split_does_not_read_is_said(data_dir, monkeypatch, capsys):
    # Held in memory, the split is read in a permutation by (seed, epoch): --shuffle_buffer and --interleave_files
    # were accepted and read by nothing, unsaid. Streamed from files, both are read.
    config = helpers.make_config(data_dir, shuffle_buffer=5, interleave_files=2)
    inputs.run_data(config)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: --")] == [
        f"warning: --{name}: the training split of --dataset=digits is held in memory, read in a permutation by "
        "(seed, epoch): nothing reads it"
        for name in ("shuffle_buffer=5", "interleave_files=2")
    ]
    _store("streamed", monkeypatch)
    inputs.run_data(config)
    assert "warning: --" not in capsys.readouterr().out


def _toy_builder_with_a_weight_feature():
    """A tensorflow-datasets builder whose examples carry a feature named `weight`, as some datasets do."""
    import tensorflow_datasets as tfds

    class ToyWithWeights(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = {
                "image": tfds.features.Tensor(shape=(2,), dtype=np.float32),
                "label": tfds.features.ClassLabel(num_classes=2),
                "weight": tfds.features.Tensor(shape=(), dtype=np.float32),
            }
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(), "test": self._generate_examples()}

        def _generate_examples(self):
            for i in range(4):
                yield i, {"image": np.full(2, i, np.float32), "label": i % 2, "weight": 0.5}

    return ToyWithWeights


def test_a_tfds_feature_named_as_the_engines_own_is_refused_naming_the_dataset(tmp_path):
    from engine.settings.errors import ConfigError

    with tfds_source.no_leftover_folders():
        builder = _toy_builder_with_a_weight_feature()(data_dir=str(tmp_path))
    builder.download_and_prepare()
    config = helpers.make_config(str(tmp_path), dataset="toy_with_weights")
    with pytest.raises(ConfigError) as raised:
        data.load_source(config, ())  # a task reading every feature
    assert str(raised.value) == (
        "--dataset=toy_with_weights: --task=classification reads every feature (its `features` is empty), weight too, "
        "a name the engine gives a feature of its own (how much an evaluation example counts in the means, which a "
        "source's own code sets): list the features the task reads in its `features`, leaving weight out"
    )
    source = data.load_source(config, ("image", "label"))  # the task's own, weight left
    assert list(source.spec) == ["image", "label"]


def test_preparing_a_tfds_dataset_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """tensorflow-datasets' builder of a dataset not yet prepared made an empty tmp*tfds folder in the temporary
    folder and left it there: one more after every run that prepared a dataset (or was refused one offline)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    config = helpers.make_config(str(tmp_path / "tfds"))
    source = tfds_source.load(config, "digits", ("image", "label"), "test")
    assert source.evals.examples == 360
    assert os.listdir(temporary) == []


def test_a_prepared_tfds_dataset_is_read_where_nothing_can_be_written(data_dir, tmp_path):
    """A dataset prepared in --data_dir is only read: a read-only copy there trained (its preparation lock was a
    traceback, OSError: Read-only file system); one to prepare where nothing can be written is one line. (The lock
    is a folder here: root writes to a read-only folder.)"""
    from engine.settings.errors import ConfigError

    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(data_dir, "digits"), copy / "digits")
    (copy / "digits" / ".prepare.lock").mkdir()
    source = tfds_source.load(helpers.make_config(str(copy)), "digits", ("image", "label"), "test")
    assert (source.train.examples, source.evals.examples) == (1257, 360)
    (tmp_path / "empty" / "digits" / ".prepare.lock").mkdir(parents=True)
    with pytest.raises(ConfigError) as raised:
        tfds_source.load(helpers.make_config(str(tmp_path / "empty")), "digits", ("image", "label"), "test")
    lock = tmp_path / "empty" / "digits" / ".prepare.lock"
    assert str(raised.value) == (
        f"--data_dir={tmp_path / 'empty'}: cannot prepare the dataset there: cannot create {lock} (Is a directory)"
    )
