"""A fork's data source (sources/NAME.py) that gives the engine something it cannot read is one line naming the file
before anything trains (engine/data/source_checks.py): a load of another signature, a result that is no Source,
splits unlike the spec, labels outside num_classes. Before these checks each ended in a traceback from deep in the
pipeline, some after every training step had run, or in a number: an evaluation split's labels beyond num_classes
reported accuracy 0.07 with loss NaN, exit 0; one class reported accuracy 1.0."""

import re
import threading

import numpy as np
import pytest
import tensorflow as tf

from engine.api import Source, Split, in_memory, sharded
from engine.data import datasets
from engine.data.pipeline import Pipelines
from engine.data.records import UNREADABLE, counted_records, unreadable
from engine.run import evaluator, inputs, loop
from engine.settings import plugins
from engine.settings.errors import ConfigError, TaskError
from engine.state.report import format_metrics
from tests import helpers

SPEC = {"image": tf.TensorSpec([6], tf.float32), "label": tf.TensorSpec([], tf.int64)}
WHERE = "sources/synthetic.py"  # the fork's load stands in for synthetic's: the file a message names


def _arrays(n, seed=0, classes=4, dtype=np.float32, shape=(6,)):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype(dtype)
    return {"image": tf.constant(x), "label": tf.constant(np.argmax(x.reshape(n, -1)[:, :classes], 1), tf.int64)}


def _good(config, eval_split, **change):
    parts = dict(train=in_memory(_arrays(256)), evals=in_memory(_arrays(64, 1)), spec=SPEC, info={"num_classes": 4})
    return Source(**{**parts, **change})


def _loaded(monkeypatch, load, **settings):
    monkeypatch.setattr(plugins, "member", lambda kind, name: load)
    config = helpers.make_config("", dataset="synthetic", **settings)
    return datasets.load_source(config, ("image", "label"))


def _with(train=None, evals=None):
    """A load whose splits are in_memory(`train`) and in_memory(`evals`) (the good ones where None)."""
    return lambda config, split: _good(
        config,
        split,
        train=in_memory(train or _arrays(256)),
        evals=in_memory(evals or _arrays(64, 1)),
    )


def _with_nan(n, seed, at):
    arrays = _arrays(n, seed)
    image = arrays["image"].numpy()
    image[at, 2] = np.nan
    return {**arrays, "image": tf.constant(image)}


CASES = {
    "a tuple": (lambda config, split: (1, 2), "load returned a tuple, not engine.api.Source(train, evals, spec, info)"),
    "one argument": (lambda config: None, "load(config) is called as load(config, eval_split): it takes those two"),
    "a dataset split": (
        lambda c, s: _good(c, s, train=tf.data.Dataset.range(3)),
        "the Source's training split is a _RangeDataset, not a Split",
    ),
    "a spec of shapes": (
        lambda c, s: _good(c, s, spec={"image": (6,), "label": ()}),
        "the Source's spec of image is (6,), not a tf.TensorSpec(shape, dtype) of one example",
    ),
    "info None": (lambda c, s: _good(c, s, info=None), "the Source's info is None: a dict of what the source knows"),
    "a spec naming the engine's index": (
        lambda c, s: _good(c, s, spec={**SPEC, "index": tf.TensorSpec([], tf.int64)}),
        "the Source's spec names index, a feature the engine sets itself (an example's position in its split, which "
        "seeds its random draws): name it otherwise",
    ),
    "a wider feature": (
        _with(train={**_arrays(256, shape=(8,))}),
        "the training split's image is float32 of shape (8,), where the spec says float32 of shape (6,)",
    ),
    "float64 in evaluation": (
        _with(evals=_arrays(64, 1, dtype=np.float64)),
        "the evaluation split's image is float64 of shape (6,), where the spec says float32 of shape (6,)",
    ),
    "a missing label": (
        _with(evals={"image": _arrays(64)["image"]}),
        "the evaluation split lacks label (the spec names image, label)",
    ),
    "an extra feature": (
        _with(evals={**_arrays(64, 1), "id": tf.range(64)}),
        "the evaluation split holds id, not in the spec (the spec names image, label)",
    ),
    "an int32 weight": (
        _with(evals={**_arrays(64, 1), "weight": tf.ones([64], tf.int32)}),
        "the evaluation split's weight is int32 of shape (), where the engine reads float32 of shape ()",
    ),
    "labels of different length": (
        lambda c, s: _good(c, s, train=in_memory({"image": _arrays(256)["image"], "label": tf.zeros([200], tf.int64)})),
        "in_memory: each feature holds one value per example; these hold image 256, label 200",
    ),
    "one class": (
        lambda c, s: _good(c, s, info={"num_classes": 1}),
        "the Source's info says num_classes=1: the number of classes of its label, a whole number of at least 2",
    ),
    "a training label beyond num_classes": (
        _with(train={**_arrays(256), "label": tf.range(256, dtype=tf.int64) % 6}),
        "the training split holds the label 5, outside [0, 4) of the info's num_classes=4",
    ),
    "a negative evaluation label": (
        _with(evals={**_arrays(64, 1), "label": tf.range(64, dtype=tf.int64) % 4 - 1}),
        "the evaluation split holds the label -1, outside [0, 4) of the info's num_classes=4",
    ),
    # Called in the input pipeline as decode(example, seed, training): a traceback from the engine's pipeline before.
    "a decode of two parameters": (
        lambda c, s: _good(c, s, decode=lambda example, training: example),
        "decode(example, training) is called as decode(example, seed, training)",
    ),
    "a decode that is no function": (
        lambda c, s: _good(c, s, decode="jpeg"),
        "the Source's decode is a str, not a function",
    ),
    # What a decode makes, traced as the run is built: a wider feature was read by the model (an error naming
    # models/mlp.py), a float64 one trained on and then stopped the first evaluation with a traceback, exit 1.
    "a decode that widens a feature": (
        lambda c, s: _good(c, s, decode=lambda x, seed, training: {**x, "image": tf.concat([x["image"]] * 2, 0)}),
        "the decoded training example's image is float32 of shape (12,), where the spec says float32 of shape (6,)",
    ),
    "a decode that casts in evaluation": (
        lambda c, s: _good(
            c, s, decode=lambda x, seed, training: x if training else {**x, "image": tf.cast(x["image"], tf.float64)}
        ),
        "the decoded evaluation example's image is float64 of shape (6,), where the spec says float32 of shape (6,)",
    ),
    "a decode that drops the label": (
        lambda c, s: _good(c, s, decode=lambda x, seed, training: {"image": x["image"]}),
        "the decoded training example lacks label (the spec names image, label)",
    ),
    "a decode that returns a tuple": (
        lambda c, s: _good(c, s, decode=lambda x, seed, training: (x["image"], x["label"])),
        "decode returned a tuple for a training example, not a dict of features",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_source_the_engine_cannot_read_is_one_line_naming_its_file(monkeypatch, case):
    load, why = CASES[case]
    with pytest.raises(TaskError) as caught:
        _loaded(monkeypatch, load)
    assert str(caught.value) == f"{WHERE}: {why}" or str(caught.value).startswith(f"{WHERE}: {why}")
    assert "\n" not in str(caught.value)


def test_a_nan_in_a_split_held_in_memory_is_refused_as_it_loads_unless_a_decode_makes_the_features(monkeypatch):
    """A NaN input read as a run that diverged: "non-finite loss ... lower --learning_rate or set --clip_norm"."""
    with pytest.raises(ConfigError) as caught:
        _loaded(monkeypatch, lambda c, s: _good(c, s, evals=in_memory(_with_nan(64, 1, 7))))
    assert (
        str(caught.value) == "--dataset=synthetic: the evaluation split's image holds NaN or infinity (example 7 first)"
    )
    # A decode makes what the task reads: a missing value it fills in is its own (its labels are checked as it runs).
    fills = lambda x, seed, training: {**x, "image": tf.where(tf.math.is_nan(x["image"]), 0.0, x["image"])}  # noqa: E731
    source = _loaded(monkeypatch, lambda c, s: _good(c, s, train=in_memory(_with_nan(256, 0, 7)), decode=fills))
    assert source.train.examples == 256


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_an_evaluation_weight_that_is_not_finite_or_is_negative_is_refused_as_it_loads(monkeypatch, bad):
    """A NaN weight made the evaluation's every mean NaN, with exit 0; a negative one counted an example against the
    others. A decode does not make the weight (it passes around it): refused with one too."""
    weights = tf.tensor_scatter_nd_update(tf.ones([64]), [[9]], [bad])
    decode = lambda x, seed, training: x  # noqa: E731
    with pytest.raises(ConfigError) as caught:
        _loaded(
            monkeypatch, lambda c, s: _good(c, s, evals=in_memory({**_arrays(64, 1), "weight": weights}), decode=decode)
        )
    assert str(caught.value) == (
        f"--dataset=synthetic: the evaluation split's example 9 has the weight {bad:g}; a weight is how much an "
        "example counts in the evaluation's means, a finite number of at least 0"
    )
    source = _loaded(
        monkeypatch, lambda c, s: _good(c, s, evals=in_memory({**_arrays(64, 1), "weight": tf.ones([64])}))
    )
    assert source.evals.examples == 64


def test_a_good_source_loads_and_a_key_its_info_lacks_is_one_line(monkeypatch):
    source = _loaded(monkeypatch, _good)
    assert source.train.examples == 256 and source.info == {"num_classes": 4}
    monkeypatch.undo()
    task = datasets.task_class(helpers.make_config("", task="language_model"))(None, source.spec, source.info)
    with pytest.raises(ConfigError, match=re.escape("--dataset=synthetic: its info has no 'vocabulary', which this ")):
        task.outputs  # noqa: B018  (a property: the size of the vocabulary)
    with pytest.raises(KeyError):  # a KeyError too, for code that asks and handles one
        source.info["vocabulary"]


def test_what_a_source_may_give_beyond_the_checks_narrowest_reading_loads(monkeypatch):
    """A training example's own features (a task's prepare takes its own), a decode's labels (1-based ones it
    shifts, or labels it parses out of records), one label per token padded with -100: none is the engine's to
    refuse."""
    extra = _with(train={**_arrays(256), "id": tf.range(256), "weight": tf.ones([256])})
    assert _loaded(monkeypatch, extra).train.examples == 256
    one_based = {**_arrays(256), "label": _arrays(256)["label"] + 1}  # 1..4, shifted by the decode

    def decoded(config, split):
        return _good(config, split, train=in_memory(one_based), decode=lambda x, seed, training: x)

    assert _loaded(monkeypatch, decoded).decode is not None
    records = {"record": tf.constant(["1.5"] * 256)}  # the decode parses image and label out of each

    def parse(x, seed, training):  # a stand-in for parsing each record
        return {"image": tf.fill([6], tf.strings.to_number(x["record"], tf.float32)), "label": tf.constant(0, tf.int64)}

    def parsed(config, split):
        return _good(config, split, train=in_memory(records), evals=in_memory(records), decode=parse)

    assert _loaded(monkeypatch, parsed).train.examples == 256
    tokens = {"image": _arrays(256)["image"], "label": tf.fill([256, 5], tf.constant(-100, tf.int64))}
    spec = {**SPEC, "label": tf.TensorSpec([5], tf.int64)}

    def padded(config, split):
        return _good(config, split, train=in_memory(tokens), evals=in_memory(tokens), spec=spec)

    assert _loaded(monkeypatch, padded).train.examples == 256


def test_the_bundled_sources_pass_their_own_checks(data_dir):
    for task, dataset in (("classification", "digits"), ("classification", "synthetic"), ("regression", "penguins")):
        config = helpers.make_config(data_dir, task=task, dataset=dataset, synthetic_examples=64)
        source, _ = inputs.source_and_task(config)
        assert source.train.examples > 0 and source.evals.examples > 0


def _streamed(arrays):
    """A Split of `arrays` that is neither held in memory nor in record files: read as a stream."""
    return Split(len(arrays["label"]), lambda: tf.data.Dataset.from_tensor_slices(arrays))


LABELS_READ_AS_THEY_STREAM = {
    # A decode's labels (the load's check passes them over), read in training: the step compiled by XLA gave NaN,
    # and the run stopped with "non-finite loss ... lower --learning_rate or set --clip_norm".
    # Each training example's label is 4 + its index in the split.
    "decoded, in training": (
        lambda c, s: _good(
            c,
            s,
            train=in_memory({**_arrays(256), "id": tf.range(256, dtype=tf.int64)}),
            decode=lambda x, seed, training: {**x, "label": 4 + x["id"]} if training else x,
        ),
        lambda example: 4 + example,
    ),
    # A streamed evaluation split: the evaluation reported accuracy 0.0156 and loss nan, and the run exited 0.
    "streamed, in evaluation": (
        lambda c, s: _good(c, s, evals=_streamed({**_arrays(64, 1), "label": _arrays(64, 1)["label"] + 3})),
        lambda example: int(_arrays(64, 1)["label"][example]) + 3,
    ),
}


@pytest.mark.parametrize("case", LABELS_READ_AS_THEY_STREAM)
def test_a_label_outside_num_classes_read_as_it_streams_stops_the_run_naming_it(monkeypatch, tmp_path, case):
    load, label_of = LABELS_READ_AS_THEY_STREAM[case]  # the label the split's example decodes to
    member = plugins.member
    monkeypatch.setattr(plugins, "member", lambda kind, name: load if kind == "dataset" else member(kind, name))
    config = helpers.make_config("", str(tmp_path), dataset="synthetic", train_steps=10, **helpers.XLA_CASE)
    with pytest.raises(datasets.DecodeError) as caught:
        loop.train(config)
    found = re.match(
        r"--dataset=synthetic: example (\d+) of the split holds the label (\d+), outside \[0, 4\) of the info's "
        "num_classes=4; fix or remove it",
        str(caught.value),
    )
    assert found, str(caught.value)
    # The example named is the split's, whose label is the one reported (in training it named the example's position
    # in the epoch's shuffled order instead, and another example's label).
    example, label = int(found.group(1)), int(found.group(2))
    assert label == label_of(example) and label >= 4


NAN_READ_AS_IT_STREAMS = {
    # A streamed training split: the step's loss was NaN, and the run stopped with "non-finite loss ... lower
    # --learning_rate or set --clip_norm", exit 3.
    "streamed, in training": (
        lambda c, s: _good(c, s, train=_streamed(_with_nan(256, 0, 0))),
        "the example at position \\d+ of the training stream",  # where the shuffle buffer put example 0
    ),
    # A streamed evaluation split: the evaluation reported loss nan, and the run exited 0.
    "streamed, in evaluation": (
        lambda c, s: _good(c, s, evals=_streamed(_with_nan(64, 1, 5))),
        "example 5 of the split",
    ),
}


@pytest.mark.parametrize("case", NAN_READ_AS_IT_STREAMS)
def test_a_nan_input_read_as_it_streams_stops_the_run_naming_the_example(monkeypatch, tmp_path, case):
    load, example = NAN_READ_AS_IT_STREAMS[case]  # the example: a regular expression
    member = plugins.member
    monkeypatch.setattr(plugins, "member", lambda kind, name: load if kind == "dataset" else member(kind, name))
    config = helpers.make_config("", str(tmp_path), dataset="synthetic", train_steps=4, **helpers.XLA_CASE)
    with pytest.raises(datasets.DecodeError) as caught:
        loop.train(config)
    assert re.match(
        f"--dataset=synthetic: {example} holds NaN or infinity in its image; fix or remove it", str(caught.value)
    )


def test_the_streamed_label_check_takes_numpy_counts_and_narrow_label_types():
    # A uint8 label compared in its own type against 256 classes overflowed; a numpy num_classes turned the check off.
    uint8 = {"image": tf.TensorSpec([6], tf.float32), "label": tf.TensorSpec([], tf.uint8)}
    streamed = _streamed({"image": tf.zeros([4, 6]), "label": tf.constant([0, 1, 254, 255], tf.uint8)})
    source = Source(train=streamed, evals=streamed, spec=uint8, info={"num_classes": np.int64(256)})
    pipelines = Pipelines(None, source)
    assert pipelines.classes == 256 and isinstance(pipelines.classes, int)
    checked = pipelines._label_checked({"label": tf.constant(255, tf.uint8)})
    assert checked["label"].dtype == tf.uint8 and int(checked["label"]) == 255
    with pytest.raises(tf.errors.InvalidArgumentError):
        Pipelines(None, Source(streamed, streamed, uint8, {"num_classes": 200}))._label_checked({"label": 200})


def test_a_record_file_that_is_missing_is_refused_as_it_loads_and_stops_a_run_it_vanishes_from(monkeypatch, tmp_path):
    """A streamed split's record file that is not there: as the run was built, a traceback from the pipeline's
    stat, exit 1; deleted while the run read it, its reader's error repeated forever under ignore_errors: the run
    hung at that step, and so did the evaluation of a split whose file was missing."""
    path, missing = str(tmp_path / "train-0.tfrecord"), str(tmp_path / "train-1.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(3):
            writer.write(str(i).encode())
    parse = lambda record: {"image": tf.fill([6], tf.strings.to_number(record)), "label": tf.constant(0, tf.int64)}  # noqa: E731
    files = sharded(((path, 3), (missing, 3)), parse)
    with pytest.raises(ConfigError) as caught:
        _loaded(monkeypatch, lambda c, s: _good(c, s, evals=files))
    assert str(caught.value) == f"--dataset=synthetic: the evaluation split's record file {missing} does not exist"
    training = _loaded(monkeypatch, lambda c, s: _good(c, s, train=files))  # measured as its pipeline is built
    with pytest.raises(ConfigError) as caught:
        Pipelines(helpers.make_config("", dataset="synthetic").data, training)
    assert str(caught.value) == f"--dataset=synthetic: the training split's record file {missing} does not exist"
    # Deleted after the run was built: read as a file of none of its counted records, each damaged (code 1).
    read = []
    reader = threading.Thread(target=lambda: read.extend(counted_records(tf.constant(missing), 3)), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "reading a missing record file hung"
    assert [damage.numpy().tolist() for _, _, damage in read] == [[1, 3]] * 3
    error = tf.errors.InvalidArgumentError(None, None, f"{UNREADABLE}] [{missing} record 0] [1 3]")
    assert unreadable(error) == f"{missing}: missing: it was deleted or moved after its 3 records were counted"


def test_an_evaluation_whose_every_weight_is_0_is_refused_and_a_numpy_num_classes_is_an_int(monkeypatch):
    """Every weight 0: the evaluation reported accuracy nan on 0 examples with a RuntimeWarning, exit 0. A numpy
    num_classes passed the check and then Keras refused it as the head's size: "--model=mlp: Received an invalid
    value for `units`, expected a positive integer. Received: units=3"."""
    zero = {**_arrays(64, 1), "weight": tf.zeros([64])}
    with pytest.raises(ConfigError) as caught:
        _loaded(monkeypatch, lambda c, s: _good(c, s, evals=in_memory(zero)))
    assert str(caught.value).startswith(
        "--dataset=synthetic: every example of the evaluation split has the weight 0: its means would count none"
    )
    source = _loaded(monkeypatch, lambda c, s: _good(c, s, info={"num_classes": np.int64(4)}))
    assert source.info["num_classes"] == 4 and type(source.info["num_classes"]) is int


def test_an_evaluation_of_fractional_weights_reports_their_sum_not_its_integer_part(monkeypatch, one_device):
    """A fork's evaluation split weighting each of its 64 examples 0.3 (its sum 19.2) reported `examples=19`: the
    sum was cut to an integer; of 606 examples, 181.80006: float32's sum, added in order within each batch (XLA's),
    with its roundings. Weights that sum to a whole number still report an int."""
    from engine.run import build

    def evaluated(weight, examples=64, **settings):
        evals = {**_arrays(examples, 1), "weight": tf.fill([examples], weight)}
        load = lambda c, s: _good(c, s, evals=in_memory(evals))  # noqa: E731
        member = plugins.member
        monkeypatch.setattr(plugins, "member", lambda kind, name: load if kind == "dataset" else member(kind, name))
        config = helpers.make_config("", dataset="synthetic", **{"global_batch_size": 16, "model": "mlp", **settings})
        return build.run(config, one_device).evaluator.evaluate()["examples"]

    assert evaluated(0.3) == 19.2
    assert evaluated(0.3, 606, global_batch_size=128, jit_compile="true") == 181.8
    # A sum a rounding or two from its decimal (791.1), and one of more digits than the console's 5 (123456.5).
    assert evaluator.weighed(np.float32(791.10004)) == 791.1 and evaluator.weighed(np.float32(123456.5)) == 123456.5
    assert format_metrics({"loss": 0.1234567, "examples": 123456.5}) == "loss=0.12346 examples=123456.5"
    whole = evaluated(0.5)
    assert whole == 32 and type(whole) is int
