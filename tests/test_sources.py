"""Bundled sources that read the user's own files: --dataset=npz:PATH."""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf

from engine.run import inputs, loop
from engine.settings.errors import ConfigError
from tests import helpers


def _write(path, splits):
    np.savez(
        path,
        **{f"{split}/{feature}": values for split, features in splits.items() for feature, values in features.items()},
    )
    return str(path)


def _digits_like(seed, count):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, count)
    images = (rng.random((count, 4, 4, 1)) * 20 + labels[:, None, None, None] * 100).astype(np.uint8)
    return {"image": images, "label": labels}


def test_an_npz_file_trains_and_evaluates_every_example_once(data_dir, tmp_path, one_device):
    path = _write(tmp_path / "mine.npz", {"train": _digits_like(0, 300), "test": _digits_like(1, 70)})
    config = helpers.make_config(
        data_dir,
        str(tmp_path / "run"),
        dataset=f"npz:{path}",
        train_steps=60,
        global_batch_size=32,
        eval_batch_size=32,
        hidden_sizes=(16,),
        learning_rate=1e-2,
    )
    loaded = inputs.run_data(config)
    assert (loaded.train_examples, loaded.eval_examples, loaded.task.outputs) == (300, 70, 3)
    seen = [b for b in loaded.eval_fn(tf.distribute.InputContext())]
    weights = np.concatenate([b["weight"].numpy() for b in seen])
    assert weights.sum() == 70 and len(weights) == 96  # 3 batches of 32, the last padded with weight 0
    summary = loop.train(config, one_device)
    assert summary["eval"]["examples"] == 70 and summary["eval"]["accuracy"] > 0.9  # the classes are separable
    assert json.load(open(tmp_path / "run" / "config.json"))["dataset"] == f"npz:{path}"


@pytest.mark.parametrize(
    "contents,why",
    [
        (b"not a zip file", r"not a .npz archive \(it begins with b'not a ', not a zip archive's "),
        (b"PK\x03\x04 and then no zip archive", "cannot read it as a .npz file"),
        ({"train/image": np.zeros((4, 2)), "train/label": np.zeros(3, np.int64)}, "differ in length"),
        ({"image": np.zeros((4, 2))}, "is not named <split>/<feature>"),
        ({"train/image": np.zeros((4, 2)), "train/label": np.zeros(4, np.int64)}, "--eval_split=test: not a split"),
    ],
    ids=["corrupt", "truncated", "lengths", "names", "split"],
)
def test_a_bad_npz_file_is_refused_naming_it(data_dir, tmp_path, contents, why):
    path = tmp_path / "bad.npz"
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        np.savez(path, **contents)
    config = helpers.make_config(data_dir, dataset=f"npz:{path}")
    with pytest.raises(ConfigError, match=why):
        inputs.run_data(config)


def test_a_missing_npz_file_ends_in_one_line(data_dir, tmp_path):
    result = helpers.launch(f"--dataset=npz:{tmp_path}/absent.npz", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --dataset=npz:{tmp_path}/absent.npz: cannot read it"), lines
    assert not (tmp_path / "run").exists()


def test_npz_needs_a_path(data_dir):
    with pytest.raises(ConfigError, match=r"--dataset=npz: name the file, --dataset=npz:PATH"):
        inputs.run_data(dataclasses.replace(helpers.make_config(data_dir), dataset="npz"))


_GOOD = {
    "train/image": np.arange(32, dtype=np.uint8).reshape(8, 2, 2),
    "train/label": np.arange(8) % 3,
    "test/image": np.arange(16, dtype=np.uint8).reshape(4, 2, 2),
    "test/label": np.arange(4) % 3,
}


@pytest.mark.parametrize(
    "arrays,why",
    [
        (
            {"train/image": np.array(["ab"] * 8), "test/image": np.array(["cd"] * 4)},
            "array 'train/image' holds strings (<U2): arrays must hold real numbers or booleans",
        ),
        (
            {"train/image": np.ones((8, 2, 2)) * 1j, "test/image": np.ones((4, 2, 2)) * 1j},
            "array 'train/image' holds complex numbers (complex128): arrays must hold real numbers or booleans",
        ),
        (
            {"train/image": np.ones((8, 2), np.longdouble), "test/image": np.ones((4, 2), np.longdouble)},
            "array 'train/image' holds float128 values, which TensorFlow cannot hold",
        ),
        ({"train/image": np.array(3.0)}, "array 'train/image' is a single value: it needs one row per example"),
        (
            {"train/image": np.zeros((8, 0, 2), np.uint8), "test/image": np.zeros((4, 0, 2), np.uint8)},
            "array 'train/image': its examples, of shape (0, 2), hold no values",
        ),
        (
            {"train/label": np.arange(8) / 2, "test/label": np.arange(4) / 2},
            "array 'train/label' holds float64 values: a label is a class, an integer 0 .. N-1",
        ),
        (
            {"train/label": np.zeros((8, 3), np.int64), "test/label": np.zeros((4, 3), np.int64)},
            "array 'train/label' has shape (8, 3): a label is one class per example, shape (examples,)",
        ),
        (
            {"train/label": np.array([0, 1, -1, 2, 0, 1, 2, 0])},
            "array 'train/label' holds the label -1 (row 2): a label is a class, an integer 0 .. N-1",
        ),
        (
            {"train/label": np.array([0, 1, 2, 10**9, 0, 1, 2, 0])},
            "array 'train/label' holds the label 1000000000 (row 3): that makes 1000000001 classes (the largest "
            "label + 1) for its 12 examples; a label is a class, an integer 0 .. N-1",
        ),
        (
            {"test/image": np.zeros((0, 2, 2), np.uint8), "test/label": np.zeros(0, np.int64)},
            "split 'test' (--eval_split=test) holds no examples",
        ),
        (
            {"train/label": np.zeros(8, np.int64), "test/label": np.zeros(4, np.int64)},
            "every label is 0 (arrays 'train/label', 'test/label'): one class; a label is a class, an integer 0 .. N-1",
        ),
    ],
    ids=[
        "strings",
        "complex",
        "float128",
        "scalar",
        "zero-sized",
        "float-labels",
        "2d-labels",
        "negative",
        "huge",
        "empty-test",
        "one-class",
    ],
)
def test_a_bad_npz_array_is_refused_naming_the_file_and_the_array(data_dir, tmp_path, arrays, why):
    path = tmp_path / "bad.npz"
    np.savez(path, **{**_GOOD, **arrays})
    config = helpers.make_config(data_dir, dataset=f"npz:{path}", global_batch_size=4, eval_batch_size=4)
    with pytest.raises(ConfigError) as raised:
        inputs.run_data(config)
    assert str(raised.value) == f"--dataset=npz:{path}: {why}"


def test_a_good_npz_file_of_few_examples_and_many_classes_is_accepted(data_dir, tmp_path):
    """A label may name classes no example has (a subset of a large label set), up to 2**16 of them."""
    path = tmp_path / "subset.npz"
    np.savez(path, **{**_GOOD, "train/label": np.array([0, 1, 2, 999, 0, 1, 2, 0])})
    loaded = inputs.run_data(
        helpers.make_config(data_dir, dataset=f"npz:{path}", global_batch_size=4, eval_batch_size=4)
    )
    assert (loaded.train_examples, loaded.eval_examples, loaded.task.outputs) == (8, 4, 1000)


def test_an_npz_array_that_cannot_be_read_is_named(data_dir, tmp_path):
    """A header that declares more than memory holds was `error: sources/npz.py:51 in <dictcomp>: MemoryError: ...`
    (the engine's file and line, not the data's array); an object array named no array."""
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**13, 2)})
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as archive:
        for name, values in _GOOD.items():
            if name != "train/image":
                with archive.open(f"{name}.npy", "w") as f:
                    np.save(f, values)
        archive.writestr("train/image.npy", header.getvalue() + bytes(32))
    np.savez(tmp_path / "objects.npz", **{**_GOOD, "train/image": np.array([{"a": 1}] * 8, dtype=object)})
    for name, said in (
        ("huge.npz", "array 'train/image' does not fit in memory (Unable to allocate "),
        ("objects.npz", "cannot read its array 'train/image' (Object arrays cannot be loaded when allow_pickle=False)"),
    ):
        config = helpers.make_config(data_dir, dataset=f"npz:{tmp_path / name}", global_batch_size=4)
        with pytest.raises(ConfigError) as refused:
            inputs.run_data(config)
        assert str(refused.value).startswith(f"--dataset=npz:{tmp_path / name}: {said}"), str(refused.value)


def test_labels_the_evaluation_split_holds_and_the_training_split_does_not_are_warned_of(data_dir, tmp_path, capsys):
    # Training labels 0 and 1, test labels numbered from 1: the task took 3 classes, class 2 was never learned, and
    # the run ended at a test accuracy of 0.31, exit 0, without a word.
    path = _write(
        tmp_path / "shifted.npz",
        {
            "train": {"image": np.ones((8, 4), np.float32), "label": np.array([0, 1] * 4)},
            "test": {"image": np.ones((4, 4), np.float32), "label": np.array([1, 2, 1, 2])},
        },
    )
    inputs.run_data(helpers.make_config(data_dir, dataset=f"npz:{path}", global_batch_size=4))
    assert capsys.readouterr().out.splitlines() == [
        f"warning: --dataset=npz:{path}: its evaluation split holds 1 label that its training split has no example of "
        "(2): the model cannot learn them (are the splits' classes numbered alike, from 0?)"
    ]
    inputs.run_data(helpers.make_config(data_dir, dataset=f"npz:{path}", global_batch_size=4, eval_split="train"))
    assert "warning" not in capsys.readouterr().out


def test_a_resume_on_a_file_of_arrays_replaced_by_one_of_as_many_examples_is_warned_of(
    data_dir, tmp_path, one_device, capsys
):
    # docs/data.md promised a warning where "a file of arrays [was] replaced"; config.json kept only the number of
    # examples, so a file of other values and as many examples resumed without a word.
    path = _write(tmp_path / "mine.npz", {"train": _digits_like(0, 64), "test": _digits_like(1, 16)})
    settings = dict(dataset=f"npz:{path}", global_batch_size=16, steps_per_loop=2, checkpoint_every=2)
    config = helpers.make_config(data_dir, workdir=str(tmp_path / "run"), train_steps=2, **settings)
    loop.train(config, one_device)
    kept = json.load(open(tmp_path / "run" / "config.json"))["training_split"]
    assert kept.keys() == {"examples", "files", "digest"} and (kept["examples"], kept["files"]) == (64, 0)
    loop.train(dataclasses.replace(config, train_steps=4), one_device)  # the same file: nothing to say
    assert "warning" not in capsys.readouterr().out
    _write(tmp_path / "mine.npz", {"train": _digits_like(2, 64), "test": _digits_like(1, 16)})
    loop.train(dataclasses.replace(config, train_steps=6), one_device)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert said == [
        f"warning: --dataset=npz:{path}: its --train_split=train holds other examples (as many, 64 examples, of "
        f"other values) now, not those when this run last started ({tmp_path}/run/config.json): it goes on from its "
        "data position at step 4 in the order of what the split holds now, not the examples an uninterrupted run "
        "would have read"
    ]
