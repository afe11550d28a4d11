"""Sources that read the user's own files without a builder: --dataset=folder:PATH (photos in class folders) and
--dataset=tfrecord:GLOB (tf.train.Example records). The datasets are generated here: photos of varied sizes, many
small TFRecord shards."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from engine.data.pipeline import UNDECODABLE
from engine.data.records import sharded, unreadable
from engine.run import inputs, loop
from engine.settings.errors import ConfigError
from sources import folder, tfrecord
from tests import helpers

CLASSES = ("ant", "bee", "cat")


def _photo(path, seed, label=0):
    """A JPEG or PNG (by the name's extension) of a size drawn from `seed`, tinted by `label`'s colour channel."""
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(12, 40)), int(rng.integers(12, 40))
    pixels = rng.integers(0, 80, (height, width, 3))
    pixels[..., label % 3] += 170
    pixels = tf.constant(pixels.astype(np.uint8))
    encode = tf.io.encode_png if str(path).lower().endswith(".png") else tf.io.encode_jpeg
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode(pixels).numpy())


def _photos(root, per_class=20, classes=CLASSES, start=0):
    """`per_class` photos in each class folder of `root`, alternately .jpg and .png."""
    for label, name in enumerate(classes):
        for i in range(start, start + per_class):
            _photo(f"{root}/{name}/{i:03d}.{'jpg' if i % 2 else 'png'}", seed=label * 1000 + i, label=label)


def _config(data_dir, path, kind="folder", **overrides):
    defaults = dict(image_size=16, global_batch_size=8, eval_batch_size=8, hidden_sizes=(16,))
    return helpers.make_config(data_dir, dataset=f"{kind}:{path}", **{**defaults, **overrides})


def _paths(split):
    """{path: label} of an in-memory split."""
    arrays = split.fetch(tf.range(split.examples, dtype=tf.int64))
    assert arrays["path"].numpy().tolist() == arrays["origin"].numpy().tolist()
    return {p.decode(): int(label) for p, label in zip(arrays["path"].numpy(), arrays["label"].numpy())}


def _refused(config, why):
    """The one-line ConfigError that loading `config`'s data raises; it starts with --dataset=... unless `why`
    names another flag."""
    with pytest.raises(ConfigError) as caught:
        inputs.run_data(config)
    message = str(caught.value)
    assert "\n" not in message and why in message, message
    return message


# Photos in class folders.


def test_a_class_folder_named_train_is_a_class_not_a_split(data_dir, tmp_path):
    # Vehicles: bus/, car/, train/. The folder named train switched the source to split folders, and every run was
    # refused: "--dataset=folder:...: .../train has no class folders".
    root = tmp_path / "vehicles"
    _photos(root, per_class=10, classes=("bus", "car", "train"))
    source = folder.load(_config(data_dir, root), "test")
    assert source.info == {"num_classes": 3, "class_names": ("bus", "car", "train")}
    labels = {**_paths(source.train), **_paths(source.evals)}
    assert len(labels) == 30 and sorted(labels.values()).count(2) == 10
    assert all(label == 2 for path, label in labels.items() if "/train/" in path)


def test_a_folder_gives_sorted_classes_and_carves_the_held_out_part_by_path(data_dir, tmp_path):
    root = tmp_path / "photos"
    _photos(root)
    _photo(f"{root}/bee/IMG_9.JPG", seed=7, label=1)  # the extension in any case
    for ignored in ("ant/.hidden.jpg", "ant/notes.txt", "cat/thumbs.db", ".cache/x/1.jpg"):
        os.makedirs(os.path.dirname(root / ignored), exist_ok=True)
        (root / ignored).write_bytes(b"not a photo")
    source = folder.load(_config(data_dir, root), "test")
    assert source.info == {"num_classes": 3, "class_names": CLASSES}
    assert source.spec == {"image": tf.TensorSpec([16, 16, 3], tf.uint8), "label": tf.TensorSpec([], tf.int64)}
    train, held_out = _paths(source.train), _paths(source.evals)
    assert (len(train), len(held_out)) == (51, 10)  # of 61 photos, 10 paths hash into the held-out 10%
    assert not set(train) & set(held_out)
    for path, label in {**train, **held_out}.items():
        assert CLASSES[label] == os.path.basename(os.path.dirname(path))
    # validation is the same held-out part, train the training one.
    assert _paths(folder.load(_config(data_dir, root), "validation").evals) == held_out
    assert _paths(folder.load(_config(data_dir, root), "train").evals) == train
    # The same files, the same split; new photos leave the others where they were.
    _photos(root, per_class=10, start=20)
    grown = folder.load(_config(data_dir, root), "test")
    grown_train, grown_held_out = _paths(grown.train), _paths(grown.evals)
    assert (len(grown_train), len(grown_held_out)) == (79, 12)
    assert set(train) < set(grown_train) and set(held_out) < set(grown_held_out)
    # A larger percent only adds to the held-out part.
    larger = _paths(folder.load(_config(data_dir, root, folder_eval_percent=30), "test").evals)
    assert set(grown_held_out) < set(larger) and len(larger) == 34


def test_photos_a_folder_does_not_read_are_said(data_dir, tmp_path, capsys):
    """A photo of another format (by its extension) and a folder inside a class folder were left out without a word:
    the run trained on fewer photos than the folder holds. Files of no image format stay unsaid."""
    root = tmp_path / "photos"
    _photos(root, per_class=4)
    for other in ("ant/scan.bmp", "bee/anim.GIF", "cat/more/1.jpg", "cat/.cache/1.jpg", "ant/notes.txt"):
        os.makedirs(os.path.dirname(root / other), exist_ok=True)
        (root / other).write_bytes(b"not read")
    source = folder.load(_config(data_dir, root), "test")
    assert source.train.examples + source.evals.examples == 12  # the 4 photos of each class, as before
    assert capsys.readouterr().out == (
        f"warning: --dataset=folder:{root}: not read: 2 photo(s) of another format than JPEG or PNG (ant/scan.bmp, "
        "bee/anim.GIF) and 1 folder(s) inside class folders (cat/more): only .jpg, .jpeg and .png files directly in "
        "a class folder are\n"
    )
    _photos(tmp_path / "plain", per_class=4)
    folder.load(_config(data_dir, tmp_path / "plain"), "test")
    assert capsys.readouterr().out == ""


def test_photos_beside_the_class_folders_are_said(data_dir, tmp_path, capsys):
    """A photo beside the class folders (of no class), carved or in a split folder, was left out without a word."""
    root = tmp_path / "photos"
    _photos(root, per_class=4)
    for stray in ("stray.jpg", "Scan.BMP", ".hidden.jpg", "notes.txt"):
        (root / stray).write_bytes(b"not read")
    source = folder.load(_config(data_dir, root), "test")
    assert source.train.examples + source.evals.examples == 12
    assert capsys.readouterr().out == (
        f"warning: --dataset=folder:{root}: not read: 2 photo(s) outside the class folders (Scan.BMP, stray.jpg): "
        "only .jpg, .jpeg and .png files directly in a class folder are\n"
    )
    _photos(tmp_path / "split" / "train", per_class=4)
    _photos(tmp_path / "split" / "test", per_class=2)
    (tmp_path / "split" / "train" / "stray.png").write_bytes(b"not read")
    (tmp_path / "split" / "beside.JPG").write_bytes(b"not read")  # beside the split folders
    folder.load(_config(data_dir, tmp_path / "split"), "test")
    said = capsys.readouterr().out
    assert f"folder:{tmp_path / 'split'}: not read: 1 photo(s) outside the class folders (beside.JPG)" in said
    assert "split 'train': not read: 1 photo(s) outside the class folders (stray.png)" in said


@pytest.mark.parametrize("link", ["bee/broken.jpg", "dog", "train/bee/broken.png"])
def test_a_link_to_nothing_is_refused_naming_it_before_the_run(data_dir, tmp_path, link):
    """A photo linked to a file since moved stopped the run at its first read, epochs in; a class folder so linked
    was left out without a word. A hidden one, which is not read, is no matter."""
    root = tmp_path / "photos"
    _photos(root / "train" if link.startswith("train/") else root, per_class=4)
    if link.startswith("train/"):
        _photos(root / "test", per_class=2)
    os.symlink(tmp_path / "gone", (root / link).parent / ".gone.jpg")
    folder.load(_config(data_dir, root), "test")
    os.symlink(tmp_path / "moved", root / link)
    _refused(_config(data_dir, root), f"{root / link} is a link to {tmp_path / 'moved'}, which does not exist")


def test_split_folders_are_used_as_given(data_dir, tmp_path):
    root = tmp_path / "photos"
    for split, count in (("train", 6), ("validation", 3), ("test", 2)):
        _photos(root / split, per_class=count, classes=("cat", "dog"))
    config = _config(data_dir, root)
    for split, count in (("validation", 3), ("test", 2)):
        source = folder.load(config, split)
        assert source.info == {"num_classes": 2, "class_names": ("cat", "dog")}
        assert (source.train.examples, source.evals.examples) == (12, 2 * count)
        assert {os.path.relpath(p, root).split("/")[0] for p in _paths(source.evals)} == {split}
        assert sorted(_paths(source.train).values()) == [0] * 6 + [1] * 6
    _refused(dataclasses.replace(config, eval_split="dev"), f"--eval_split=dev: not a split of {root}")
    # A split with other classes than the training one is refused, naming the difference.
    _photos(root / "test", per_class=1, classes=("emu",))
    os.rename(root / "test" / "dog", tmp_path / "dog")
    why = "splits 'train' and 'test' must have the same class folders ('test' lacks: dog; has beyond 'train': emu)"
    _refused(config, why)


@pytest.mark.parametrize(
    "layout,why",
    [
        (None, "no such folder"),
        ({"readme.txt": b"hi"}, "has no class folders (a sub-folder per class of JPEG or PNG files)"),
        ({"ant/1.jpg": "photo", "bee/notes.txt": b"hi"}, "class folder {root}/bee holds no JPEG or PNG files"),
        ({"ant/notes.txt": b"hi", "bee/.hidden.png": b"x"}, "no JPEG or PNG files (.jpg, .jpeg, .png) in the class"),
        (
            {"ant/1.jpg": "photo", "bee/1.jpg": "photo"},
            "none of its 2 photos fall in the held-out 10% (--folder_eval_percent)",
        ),
        # A traceback-free line blaming sources/folder.py's info before (num_classes=1), naming no folder.
        ({f"ant/{i}.jpg": "photo" for i in range(30)}, "one class folder (ant): a folder of classes holds a folder"),
        # "none of its 1 photos fall in the held-out 10%": adding photos then met "one class folder".
        ({"ant/1.jpg": "photo"}, "one class folder (ant): a folder of classes holds a folder"),
        # A sub-folder named as a photo was read as one: "cannot decode .../bee/old.png: Is a directory".
        ({"ant/1.jpg": "photo", "bee/old.png/1.jpg": "photo"}, "class folder {root}/bee holds no JPEG or PNG files"),
    ],
    ids=["missing", "no-classes", "empty-class", "no-photos", "none-held-out", "one-class", "one-photo", "sub-folder"],
)
def test_a_bad_folder_is_refused_naming_it(data_dir, tmp_path, layout, why):
    root = tmp_path / "photos"
    for name, contents in (layout or {}).items():
        if contents == "photo":
            _photo(root / name, seed=1)
        else:
            os.makedirs(os.path.dirname(root / name), exist_ok=True)
            (root / name).write_bytes(contents)
    message = _refused(_config(data_dir, root), why.format(root=root))
    assert message.startswith(f"--dataset=folder:{root}: ")


def test_a_folder_needs_a_path_an_image_size_and_splits_it_has(data_dir, tmp_path):
    _photos(tmp_path, per_class=2)
    _refused(_config(data_dir, ""), "--dataset=folder:: name the folder, --dataset=folder:PATH")
    why = f"--dataset=folder:{tmp_path}: photos come in many sizes: set --image_size"
    _refused(_config(data_dir, tmp_path, image_size=0), why)
    why = f"--eval_split=dev: not a split of {tmp_path} (it has no split folders: train, and the held-out 10% as"
    _refused(_config(data_dir, tmp_path, eval_split="dev"), why)
    why = f"--train_split=all: {tmp_path} has no folder 'all'; without split folders its photos are carved"
    _refused(_config(data_dir, tmp_path, train_split="all"), why)
    # Evaluated on its training photos, it needs none held out (refused: "none of its 2 photos fall in the held-out").
    _photo(tmp_path / "few" / "ant" / "1.jpg", seed=1)
    _photo(tmp_path / "few" / "bee" / "1.jpg", seed=2)
    source = folder.load(_config(data_dir, tmp_path / "few", eval_split="train"), "train")
    assert (source.train.examples, source.evals.examples) == (2, 2)


def test_folder_photos_decode_to_the_image_size(data_dir, tmp_path):
    _photos(tmp_path, per_class=4)
    source = folder.load(_config(data_dir, tmp_path), "train")
    example = {k: v for k, v in next(iter(source.train.make())).items() if k != "origin"}  # the engine drops it
    seed = tf.constant([3, 4], tf.int64)
    cropped = source.decode(example, seed, True)
    assert set(cropped) == set(source.spec) and cropped["image"].shape == (16, 16, 3)
    assert cropped["image"].dtype == tf.uint8 and int(cropped["label"]) == 0
    assert np.array_equal(source.decode(example, seed, True)["image"], cropped["image"])  # seeded: resumes alike
    centre = source.decode(example, seed, False)["image"].numpy()
    # Photos of class 0 are tinted red.
    assert centre[..., 0].mean() > 150 and centre[..., 1].mean() < 100


def test_a_folder_of_photos_trains_and_evaluates_every_held_out_photo_once(data_dir, tmp_path, one_device):
    _photos(tmp_path / "photos")
    config = _config(data_dir, tmp_path / "photos", workdir=str(tmp_path / "run"), train_steps=30, learning_rate=1e-2)
    summary = loop.train(config, one_device)
    assert summary["eval"]["examples"] == 10 and summary["step"] == 30
    assert summary["eval"]["accuracy"] >= 0.8  # the classes are tinted red, green and blue


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_photo_stops_the_run_naming_it(data_dir, tmp_path, one_device, damage):
    # A JPEG cut short decoded wherever a crop stopped above the cut: it stopped the run epochs later, if ever.
    root = tmp_path / "photos"
    _photos(root, per_class=6)
    bad = root / "bee" / "broken.jpg"  # in the training part (its path's hash)
    _photo(bad, seed=7)
    whole = bad.read_bytes()
    bad.write_bytes(whole[: len(whole) * 9 // 10] if damage == "truncated" else b"\xff\xd8\xff\xe0 not really a JPEG")
    assert str(bad) in _paths(folder.load(_config(data_dir, root), "test").train)
    config = _config(data_dir, root, workdir=str(tmp_path / "run"), train_steps=10)
    why = ": truncated: a JPEG without its end-of-image marker;" if damage == "truncated" else ""
    with pytest.raises(ConfigError, match=re.escape(f"cannot decode {bad}{why}")):
        loop.train(config, one_device)


# TFRecord files.


def _example(i, image_kind="raw"):
    """The features of record `i`: a 4x4x1 image (raw bytes, or an encoded JPEG of a varied size), its label
    (i % 3), a float score, a 3-vector and a name."""
    if image_kind == "raw":
        image = np.full((4, 4, 1), i % 256, np.uint8).tobytes()
    else:
        rng = np.random.default_rng(i)
        pixels = rng.integers(0, 80, (int(rng.integers(10, 30)), int(rng.integers(10, 30)), 3))
        pixels[..., i % 3] += 170
        image = tf.io.encode_jpeg(tf.constant(pixels.astype(np.uint8))).numpy()
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3])),
        "score": tf.train.Feature(float_list=tf.train.FloatList(value=[i / 2])),
        "vector": tf.train.Feature(float_list=tf.train.FloatList(value=[i, -i, 0.5])),
        "name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f"record {i}".encode()])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _shards(root, split, counts, image_kind="raw", first=0):
    """TFRecord files root/<split>-NNNNN-of-MMMMM of `counts` records; returns their paths."""
    paths, i = [], first
    for n, count in enumerate(counts):
        path = f"{root}/{split}-{n:05d}-of-{len(counts):05d}.tfrecord"
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(count):
                writer.write(_example(i, image_kind))
                i += 1
        paths.append(path)
    return paths


FEATURES = "image:uint8:4x4x1,label:int64,score:float32,vector:float32:3,name:string"


def test_tfrecord_files_are_counted_exactly_and_their_counts_cached(data_dir, tmp_path, monkeypatch):
    train = _shards(tmp_path, "train", [5, 0, 12, 1, 7, 3, 9])
    test = _shards(tmp_path, "test", [4, 6])
    cache = tmp_path / "tfds"
    config = _config(
        cache, f"{tmp_path}/{{split}}-*.tfrecord", "tfrecord", tfrecord_features=FEATURES, tfrecord_classes=3
    )
    source = tfrecord.load(config, "test")
    assert source.train.files == tuple(zip(train, [5, 0, 12, 1, 7, 3, 9]))
    assert source.evals.files == tuple(zip(test, [4, 6]))
    assert (source.train.examples, source.evals.examples, source.info) == (37, 10, {"num_classes": 3})
    assert source.decode is None and (cache / tfrecord.CACHE).exists()
    assert source.spec == {
        "image": tf.TensorSpec([4, 4, 1], tf.uint8),
        "label": tf.TensorSpec([], tf.int64),
        "score": tf.TensorSpec([], tf.float32),
        "vector": tf.TensorSpec([3], tf.float32),
        "name": tf.TensorSpec([], tf.string),
    }
    # A second run reads no headers; a file rewritten (another size and time) is counted again, alone.
    counted = []
    monkeypatch.setattr(tfrecord, "_count", lambda path, size, where: counted.append(path) or 99)
    assert tfrecord.load(config, "test").train.files == source.train.files and counted == []
    with tf.io.TFRecordWriter(test[1]) as writer:
        writer.write(_example(0))
    assert [n for _, n in tfrecord.load(config, "test").evals.files] == [4, 99] and counted == [test[1]]


def test_a_tfrecord_parses_into_the_named_features(data_dir, tmp_path):
    _shards(tmp_path, "train", [3])
    config = _config(data_dir, f"{tmp_path}/{{split}}-*", "tfrecord", tfrecord_features=FEATURES, eval_split="train")
    parse = tfrecord.load(dataclasses.replace(config, tfrecord_classes=3), "train").train.parse
    example = {k: v.numpy() for k, v in parse(tf.constant(_example(7))).items()}
    assert set(example) == {"image", "label", "score", "vector", "name"}
    assert example["image"].shape == (4, 4, 1) and (example["image"] == 7).all()
    assert (example["label"], example["score"], example["name"]) == (1, 3.5, b"record 7")
    assert example["vector"].tolist() == [7.0, -7.0, 0.5]
    # A label beyond --tfrecord_classes stops the run.
    parse = tfrecord.load(dataclasses.replace(config, tfrecord_classes=2), "train").train.parse
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"label 2 is outside \[0, 2\) \(--tfrecord_classes=2\)"):
        parse(tf.constant(_example(8)))


def test_encoded_images_in_tfrecords_decode_to_the_image_size(data_dir, tmp_path):
    _shards(tmp_path, "train", [2], image_kind="jpeg")
    config = _config(
        data_dir, f"{tmp_path}/{{split}}-*", "tfrecord", tfrecord_features="image:jpeg,label:int64", eval_split="train"
    )
    source = tfrecord.load(dataclasses.replace(config, tfrecord_classes=3), "train")
    assert source.spec["image"] == tf.TensorSpec([16, 16, 3], tf.uint8)
    example = source.train.parse(tf.constant(_example(1, "jpeg")))
    decoded = source.decode(example, tf.constant([1, 2], tf.int64), False)
    assert decoded["image"].shape == (16, 16, 3) and int(decoded["label"]) == 1
    assert decoded["image"].numpy()[..., 1].mean() > 150  # record 1 is tinted green


@pytest.mark.parametrize(
    "glob,features,why",
    [
        ("{root}/*.tfrecord", "label:int64", "put {{split}} where the split's name goes"),
        ("{root}/{{split}}-*.rec", "score:float32", "no files match {root}/train-*.rec (--train_split=train)"),
        ("{root}/{{split}}-*", "image:jpg", "'image:jpg' is not name:type[:shape] with type one of jpeg"),
        ("{root}/{{split}}-*", "label", "'label' is not name:type[:shape] with type one of jpeg, png, image, int64"),
        ("{root}/{{split}}-*", "x:float32:28xa", "'x:float32:28xa': the shape must be sizes joined by x"),
        ("{root}/{{split}}-*", "name:string:2", "'name:string:2': a string is one value, with no shape"),
        ("{root}/{{split}}-*", "image:uint8", "uint8 is a tensor's raw bytes and needs its shape"),
        ("{root}/{{split}}-*", "label:int64,label:float32", "label is named twice"),
        (  # a record's weight weighted nothing while an npz column weighted the means: neither reads as the engine's
            "{root}/{{split}}-*",
            "image:uint8:4x4x1,weight:float32",
            "weight is a feature the engine sets itself (how much an evaluation example counts in the means, which a "
            "source's own code sets): leave it out",
        ),
        ("{root}/{{split}}-*", "image:jpeg", "image holds encoded images, which come in many sizes: set --image_size"),
        ("{root}/{{split}}-*", "", "--tfrecord_features=: --dataset=tfrecord needs it"),
        ("{root}/{{split}}-*", "image:uint8:4x4x1,label:int64", "its int64 label needs --tfrecord_classes"),
        ("{root}/{{split}}-0000[1]-*", "score:float32", "the 1 files of {root}/train-0000[1]-* hold no records"),
        (
            "{root}/{{split}}-*",
            "image:uint8:4x4x1,label:float32",
            "--tfrecord_features=image:uint8:4x4x1,label:float32: a label is a class, label:int64 (not label:float32)",
        ),
        (
            "{root}/{{split}}-*",
            "image:uint8:4x4x1,label:int64:2",
            "--tfrecord_features=image:uint8:4x4x1,label:int64:2: a label is a class, label:int64 (not label:int64:2)",
        ),
    ],
    ids=[
        "no-split",
        "no-files",
        "type",
        "no-type",
        "shape",
        "scalar-shape",
        "uint8-shape",
        "twice",
        "engine-feature",
        "image-size",
        "no-features",
        "classes",
        "empty",
        "float-label",
        "shaped-label",
    ],
)
def test_a_bad_tfrecord_dataset_is_refused(data_dir, tmp_path, glob, features, why):
    _shards(tmp_path, "train", [2, 0])
    _shards(tmp_path, "test", [2])
    glob, why = glob.format(root=tmp_path), why.format(root=tmp_path)
    overrides = dict(tfrecord_features=features, image_size=0, eval_split="train")
    if not features:  # refused when the flags are checked
        with pytest.raises(ConfigError, match=why):
            _config(data_dir, glob, "tfrecord", **overrides)
        return
    _refused(_config(data_dir, glob, "tfrecord", **overrides), why)


def test_one_tfrecord_class_is_refused(data_dir, tmp_path):
    """One class makes every prediction right: an accuracy of 1.0 that says nothing."""
    _shards(tmp_path, "train", [2])
    overrides = dict(tfrecord_features="image:uint8:4x4x1,label:int64", tfrecord_classes=1, image_size=0)
    config = _config(data_dir, f"{tmp_path}/{{split}}-*", "tfrecord", eval_split="train", **overrides)
    _refused(config, "--tfrecord_classes=1: a classification needs at least 2 classes")


def test_a_truncated_tfrecord_file_is_refused_naming_it_in_one_line(data_dir, tmp_path):
    paths = _shards(tmp_path, "train", [3, 4])
    _shards(tmp_path, "test", [2])
    with open(paths[1], "rb+") as f:
        f.truncate(os.path.getsize(paths[1]) - 5)
    result = helpers.launch(
        f"--dataset=tfrecord:{tmp_path}/{{split}}-*",
        "--tfrecord_features=image:uint8:4x4x1,label:int64",
        "--tfrecord_classes=3",
        f"--data_dir={data_dir}",
        f"--workdir={tmp_path / 'run'}",
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"error: --dataset=tfrecord:{tmp_path}/{{split}}-*: {paths[1]} is truncated: its ")
    assert "(after 3 whole records;" in lines[0] and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_tfrecord_files_of_photos_train_end_to_end(data_dir, tmp_path, one_device):
    _shards(tmp_path, "train", [9, 11, 7, 13], image_kind="jpeg")
    _shards(tmp_path, "test", [6, 6], image_kind="jpeg", first=1000)
    config = _config(
        data_dir,
        f"{tmp_path}/{{split}}-*.tfrecord",
        "tfrecord",
        tfrecord_features="image:jpeg,label:int64",
        workdir=str(tmp_path / "run"),
        train_steps=30,
        learning_rate=1e-2,
    )
    summary = loop.train(dataclasses.replace(config, tfrecord_classes=3), one_device)
    assert summary["eval"]["examples"] == 12 and summary["step"] == 30
    assert summary["eval"]["accuracy"] >= 0.75  # tinted red, green and blue by label


def test_a_resume_may_change_the_order_settings_its_training_split_does_not_read(data_dir, tmp_path, one_device):
    """--shuffle_buffer and --interleave_files are a run's identity only where its training split reads them: one
    held in memory (digits) resumes under others; one streamed from records is refused, naming the one it reads."""
    held = helpers.make_config(data_dir, str(tmp_path / "held"), train_steps=2, steps_per_loop=2, hidden_sizes=(8,))
    loop.train(held, one_device)
    resumed = dataclasses.replace(held, train_steps=4, shuffle_buffer=5, interleave_files=2)
    assert loop.train(resumed, one_device)["step"] == 4
    _shards(tmp_path, "train", [9, 11])
    _shards(tmp_path, "test", [6], first=1000)
    streamed = _config(
        data_dir,
        f"{tmp_path}/{{split}}-*.tfrecord",
        "tfrecord",
        tfrecord_features=FEATURES,
        tfrecord_classes=3,
        workdir=str(tmp_path / "streamed"),
        train_steps=2,
        steps_per_loop=2,
    )
    loop.train(streamed, one_device)
    touched = (tmp_path / "streamed").stat().st_mtime_ns
    with pytest.raises(ConfigError, match=r"other settings .*: --shuffle_buffer=10000 there, 5 here\. "):
        loop.train(dataclasses.replace(streamed, train_steps=4, shuffle_buffer=5), one_device)
    # Refused before it wrote anything, the lock's file too (it was taken, and the workdir touched, before).
    assert helpers.logged_steps(str(tmp_path / "streamed")) == [2]
    assert (tmp_path / "streamed").stat().st_mtime_ns == touched


def test_a_corrupt_tfrecord_record_stops_the_run_naming_the_file(data_dir, tmp_path, one_device):
    paths = _shards(tmp_path, "train", [5, 5])
    _shards(tmp_path, "test", [2])
    contents = bytearray(open(paths[0], "rb").read())
    contents[len(contents) // 2] ^= 0xFF  # a payload byte: its record's checksum fails
    open(paths[0], "wb").write(bytes(contents))
    config = _config(
        data_dir,
        f"{tmp_path}/{{split}}-*",
        "tfrecord",
        tfrecord_features="image:uint8:4x4x1,label:int64",
        workdir=str(tmp_path / "run"),
        global_batch_size=4,
        train_steps=10,
    )
    with pytest.raises((ConfigError, tf.errors.OpError), match=re.escape(paths[0])):
        loop.train(dataclasses.replace(config, tfrecord_classes=3), one_device)


# TFRecord files that do not match what the flags say, and a record-count cache that does not match its files.


def _bytes_records(path, count, size):
    """A TFRecord file of `count` records of `size` bytes each (16 bytes of framing apiece)."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(count):
            writer.write(b"x" * size)
    return str(path)


def _float_features(path, count, **features):
    """A TFRecord file of `count` Examples whose features are the float lists given."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(count):
            feature = {k: tf.train.Feature(float_list=tf.train.FloatList(value=v)) for k, v in features.items()}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


@pytest.mark.parametrize(
    "features,stored,training,why",
    [
        ("image:float32:2,label:int64", dict(image=[1, 2], label=[1.0]), True, "Key: label.  Data types don't match"),
        ("image:float32:3,label:int64", dict(image=[1, 2]), False, "Key: image.  Can't parse serialized Example"),
        ("image:float32:2,label:int64", dict(image=[1, 2]), True, "label 5 is outside [0, 3) (--tfrecord_classes=3)"),
    ],
    ids=["type-training", "shape-evaluation", "label-training"],
)
def test_a_record_unlike_the_features_stops_the_stream_naming_its_file_and_record(
    data_dir, tmp_path, features, stored, training, why
):
    """Every record of the file fails to parse: the stream stops (it does not wait forever for one that parses), and
    the line the run ends with (Data.origin, as engine/run/loop.py asks it) names the file, the record and the
    reason."""
    path = tmp_path / "train-0.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(8):
            feature = {k: tf.train.Feature(float_list=tf.train.FloatList(value=v)) for k, v in stored.items()}
            feature.setdefault("label", tf.train.Feature(int64_list=tf.train.Int64List(value=[5])))
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    glob = f"{tmp_path}/{{split}}-*"
    config = _config(data_dir, glob, "tfrecord", tfrecord_features=features, tfrecord_classes=3, eval_split="train")
    loaded = inputs.run_data(dataclasses.replace(config, global_batch_size=4, eval_batch_size=4))
    dataset = loaded.train_fn if training else loaded.eval_fn
    with pytest.raises(tf.errors.InvalidArgumentError, match=UNDECODABLE):
        next(iter(dataset(tf.distribute.InputContext())))
    message = loaded.origin(0, 0, training, 1)
    record = re.escape(f"--dataset=tfrecord:{glob}: cannot parse {path} record ")
    assert re.fullmatch(rf"{record}{'[0-7]' if training else '0'}: {re.escape(why)}.*", message), message


def test_a_record_holding_nan_stops_the_stream_naming_its_file_and_record(data_dir, tmp_path):
    """A float feature's NaN read as a run that diverged: the loss was NaN and the run said "lower --learning_rate"."""
    path = tmp_path / "train-0.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(8):
            image = [1.0, float("nan") if i == 3 else 2.0]
            feature = {
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=image)),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    glob = f"{tmp_path}/{{split}}-*"
    config = _config(data_dir, glob, "tfrecord", tfrecord_features="image:float32:2,label:int64", tfrecord_classes=3)
    loaded = inputs.run_data(dataclasses.replace(config, global_batch_size=8, eval_batch_size=8, eval_split="train"))
    for read in (loaded.train_fn, loaded.eval_fn):
        with pytest.raises(tf.errors.InvalidArgumentError, match=UNDECODABLE):
            list(read(tf.distribute.InputContext()).take(1))
    said = f"--dataset=tfrecord:{glob}: {path} record 3 holds NaN or infinity in its image"
    positions = [p for p in range(8) if "NaN" in loaded.origin(p, 0, True, 1)]
    assert len(positions) == 1, positions  # the training stream's order is shuffled: one position holds record 3
    assert loaded.origin(positions[0], 0, True, 1) == said and loaded.origin(3, 0, False, 1) == said


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda p: os.symlink(p / "train-loop", p / "train-loop"), "cannot read {root}/train-loop: "),
        (lambda p: os.mkdir(p / "train-dir"), "{root}/train-dir is a directory, not a TFRecord file"),
    ],
    ids=["symlink-loop", "directory"],
)
def test_a_path_the_glob_matches_that_is_no_file_is_refused_naming_it(data_dir, tmp_path, make, why):
    _shards(tmp_path, "train", [2])
    make(tmp_path)
    config = _config(data_dir, f"{tmp_path}/{{split}}-*", "tfrecord", tfrecord_features="score:float32")
    message = _refused(dataclasses.replace(config, eval_split="train"), why.format(root=tmp_path))
    assert message.startswith(f"--dataset=tfrecord:{tmp_path}/{{split}}-*: ")


@pytest.mark.parametrize(
    "cache",
    ["[]", '"counts"', "{not json", '{"PATH": [1]}', '{"PATH": {"size": 1}}', '{"PATH": {"size": "a", "records": 1}}'],
    ids=["list", "string", "not-json", "entry-list", "entry-partial", "entry-types"],
)
def test_a_damaged_count_cache_is_counted_again_and_rewritten(tmp_path, cache):
    path = _bytes_records(tmp_path / "a.tfrecord", 3, 10)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / tfrecord.CACHE).write_text(cache.replace("PATH", path))
    assert tfrecord.record_counts([path], str(cache_dir), "here") == [3]
    entries = json.loads((cache_dir / tfrecord.CACHE).read_text())
    assert list(entries) == [path] and entries[path]["records"] == 3


def test_a_file_replaced_with_the_same_size_and_time_is_counted_again(tmp_path, monkeypatch):
    path = _bytes_records(tmp_path / "a.tfrecord", 20, 100)
    other = _bytes_records(tmp_path / "b.tfrecord", 40, 42)  # 20 x 116 bytes = 40 x 58
    assert os.path.getsize(path) == os.path.getsize(other) == 2320
    assert tfrecord.record_counts([path], str(tmp_path), "here") == [20]
    stat = os.stat(path)
    os.replace(other, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p` or `rsync -t` would leave it
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns and os.path.getsize(path) == 2320
    assert tfrecord.record_counts([path], str(tmp_path), "here") == [40]


@pytest.mark.parametrize("counted", [20, 50], ids=["more-than-counted", "fewer-than-counted"])
def test_a_file_that_no_longer_holds_its_counted_records_stops_the_stream_naming_it(tmp_path, counted):
    path = _bytes_records(tmp_path / "a.tfrecord", 40, 42)
    split = sharded([(path, counted)], lambda record: {"record": record})
    with pytest.raises(tf.errors.OpError) as raised:
        list(split.make())
    if counted == 20:
        expected = f"{path}: holds more than the 20 records counted: it changed after they were counted"
    else:
        expected = f"{path}: truncated or corrupt: it cannot be read past its first 40 records (of 50)"
    assert unreadable(raised.value).startswith(expected), unreadable(raised.value)


def test_a_photo_whose_name_is_not_utf8_is_read_and_a_class_folder_so_named_refused(data_dir, tmp_path, one_device):
    """File names are bytes on Linux: a photo named in Latin-1 trains like any other (TensorFlow's own listing
    stops on it); a class folder so named is refused by name, as a class is named by its folder in the export."""
    from engine.run import loop

    root = tmp_path / "photos"
    _photos(root, per_class=8)
    _photo(os.fsdecode(os.fsencode(str(root / "cat")) + b"/caf\xe9.jpg"), seed=99, label=2)  # Latin-1 for café
    summary = loop.train(_config(data_dir, root, train_steps=2, workdir=str(tmp_path / "run")), one_device)
    splits = [_source(data_dir, root, split) for split in ("train", "test")]
    read = [p for split in splits for p in split.fetch(tf.range(split.examples, dtype=tf.int64))["path"].numpy()]
    assert os.fsencode(str(root / "cat")) + b"/caf\xe9.jpg" in read
    assert summary["step"] == 2 and summary["eval"]["examples"] > 0
    os.makedirs(os.fsencode(str(root)) + b"/fl\xfbte")
    _refused(
        _config(data_dir, root),
        f"--dataset=folder:{root}: the folder 'fl\\udcfbte' in it is not named in UTF-8 (b'fl\\xfbte'): a class "
        "is named by its folder; rename it",
    )


def test_a_corrupt_photo_or_record_file_whose_name_is_not_utf8_is_named_by_its_bytes(data_dir, tmp_path, one_device):
    # A photo so named that did not decode ended in a UnicodeDecodeError traceback (exit 1); a record file so named
    # in "sources/tfrecord.py:90 in load: UnicodeDecodeError".
    from engine.run import loop

    root = tmp_path / "photos"
    _photos(root, per_class=8)
    bad = os.fsencode(str(root / "cat")) + b"/caf\xe9.jpg"
    with open(bad, "wb") as f:
        f.write(b"not an image")
    config = _config(data_dir, root, workdir=str(tmp_path / "run"), train_steps=10)
    with pytest.raises(ConfigError, match=re.escape(f"cannot decode {root}/cat/caf\\xe9.jpg: ")):
        loop.train(config, one_device)
    _shards(tmp_path, "test", [2])
    with open(os.fsencode(str(tmp_path)) + b"/train-\xff", "wb"):
        pass
    _refused(
        _config(data_dir, f"{tmp_path}/{{split}}-*", "tfrecord", tfrecord_features="score:float32"),
        f"--dataset=tfrecord:{tmp_path}/{{split}}-*: a file that {tmp_path}/train-* matches is named by bytes that "
        f"are not UTF-8 ({tmp_path}/train-\\xff), which TensorFlow's record reader cannot open: rename it",
    )


def test_an_example_too_large_for_memory_is_refused_by_the_memory_check_before_anything_is_made(
    data_dir, tmp_path, one_device
):
    # A zero example of the spec's shape was made to learn the prepared spec: an OOM traceback before the check.
    refused, _ = _refused_run(data_dir, tmp_path, one_device, "image:uint8:1000000x1000000x1,label:int64")
    assert refused.startswith("--model=mlp: needs about 352 TB of memory (model, gradients"), refused


def test_a_feature_of_strings_a_task_reads_as_numbers_is_refused_before_anything_is_written(
    data_dir, tmp_path, one_device
):
    # image:string ended in "Cast string to float is not supported" as the first batch was read, the workdir written.
    refused, glob = _refused_run(data_dir, tmp_path, one_device, "image:string,label:int64")
    assert refused == (
        f"--dataset=tfrecord:{glob}: its image holds strings (encoded photos: image:jpeg or image:png), which "
        "--task=classification reads as numbers"
    )


def test_a_run_whose_class_folders_changed_is_refused_on_resume_and_evaluation(data_dir, tmp_path, one_device):
    # A class folder renamed under a trained run: it resumed with exit 0, label 0 now another class, and config.json
    # was rewritten with the new names.
    from engine.run import modes

    root, workdir = tmp_path / "photos", tmp_path / "run"
    _photos(root, per_class=8)
    config = _config(data_dir, root, workdir=str(workdir), train_steps=2)
    loop.train(config, one_device)
    saved = (workdir / "config.json").read_text()
    os.rename(root / "ant", root / "zebra")
    refused = (
        f"--dataset=folder:{root}: label 0 is 'bee' here, 'ant' in the run of {workdir} ({workdir}/config.json): its "
        "classes changed since that run trained; restore the data as it was, or train in a new --workdir"
    )
    with pytest.raises(ConfigError) as caught:
        loop.train(dataclasses.replace(config, train_steps=4), one_device)
    assert str(caught.value) == refused
    with pytest.raises(ConfigError) as caught:
        modes.evaluate(dataclasses.replace(config, mode="eval"), one_device)
    assert str(caught.value) == refused
    assert (workdir / "config.json").read_text() == saved
    os.rename(root / "zebra", root / "ant")  # restored: it trains on
    assert loop.train(dataclasses.replace(config, train_steps=4), one_device)["step"] == 4


def test_export_builds_the_model_from_what_config_json_keeps_of_the_source_not_from_the_data(
    data_dir, tmp_path, one_device
):
    # An export loaded the whole source: a run whose photos were elsewhere (a cluster's storage) exported nothing,
    # refused as "--dataset=folder:...: not a folder".
    from engine.run import modes

    root, workdir = tmp_path / "photos", tmp_path / "run"
    _photos(root, per_class=8)
    config = _config(data_dir, root, workdir=str(workdir), train_steps=2)
    loop.train(config, one_device)
    kept = json.loads((workdir / "config.json").read_text())["source"]
    assert kept["spec"] == {"image": {"dtype": "uint8", "shape": [16, 16, 3]}, "label": {"dtype": "int64", "shape": []}}
    assert kept["info"]["dict"]["class_names"] == {"tuple": list(CLASSES)}
    exported = modes.export(dataclasses.replace(config, mode="export", export_dir=str(tmp_path / "with")))
    os.rename(root, tmp_path / "elsewhere")
    without = modes.export(dataclasses.replace(config, mode="export", export_dir=str(tmp_path / "without")))
    images = tf.constant(np.random.default_rng(0).random((5, 16, 16, 3), dtype=np.float32))
    served = [tf.saved_model.load(path).signatures["serving_default"](images=images) for path in (exported, without)]
    assert sorted(served[1]) == ["class_names", "classes", "logits", "probabilities"]
    for name, value in served[0].items():
        np.testing.assert_array_equal(served[1][name].numpy(), value.numpy())
    assert [n.decode() for n in tf.saved_model.load(without).class_names.numpy()] == list(CLASSES)
    with pytest.raises(ConfigError, match="--dataset=folder:"):  # evaluation reads its split: the data it needs
        modes.evaluate(dataclasses.replace(config, mode="eval"), one_device)


def test_too_few_record_files_for_the_input_pipelines_are_refused_before_anything_is_written(
    data_dir, tmp_path, one_device, monkeypatch
):
    # Refused as the first batch was read, the workdir holding config.json, train/ and eval/ by then.
    from engine.cluster import distribute

    placement = distribute.placement  # one of two workers, each an input pipeline
    monkeypatch.setattr(distribute, "placement", lambda *a: dataclasses.replace(placement(*a), workers=2))
    refused, glob = _refused_run(data_dir, tmp_path, one_device, "image:uint8:4x4x1,label:int64")
    assert refused == (
        f"--dataset=tfrecord:{glob}: its 1 record file of --train_split=train cannot feed 2 input pipelines "
        "(workers), each of which reads its own files; write the split in more files"
    )


def _refused_run(data_dir, tmp_path, one_device, features):
    """(the ConfigError's message, the glob) of a train run of one file of 16 training records and one of 8 test
    records, read as `features` (--tfrecord_features), which writes nothing."""
    _shards(tmp_path, "train", [16])
    _shards(tmp_path, "test", [8])
    glob = f"{tmp_path}/{{split}}-*"
    config = _config(data_dir, glob, "tfrecord", tfrecord_features=features, tfrecord_classes=3)
    with pytest.raises(ConfigError) as refused:
        loop.train(dataclasses.replace(config, image_size=0, workdir=str(tmp_path / "run")), one_device)
    assert not (tmp_path / "run").exists()
    return str(refused.value), glob


def _source(data_dir, root, split):
    """The folder source's split `split` (train, or the held-out test)."""
    source = folder.load(_config(data_dir, root), "test")
    return source.train if split == "train" else source.evals


def test_an_npz_file_whose_name_is_not_utf8_is_read(data_dir, tmp_path):
    path = os.fsencode(str(tmp_path)) + b"/arrays\xff.npz"
    with open(path, "wb") as f:
        np.savez(f, **{"train/image": np.ones((16, 4), np.float32), "train/label": np.arange(16) % 2,
                       "test/image": np.ones((4, 4), np.float32), "test/label": np.arange(4) % 2})  # fmt: skip
    loaded = inputs.run_data(helpers.make_config(data_dir, dataset=f"npz:{os.fsdecode(path)}", global_batch_size=4))
    assert (loaded.train_examples, loaded.eval_examples) == (16, 4)
    # As a user runs it: the run's lines name the file by its bytes (stdout and stderr escape nothing away).
    from tests import forkserver

    args = [f"--dataset=npz:{os.fsdecode(path)}", "--train_steps=2", "--global_batch_size=4", "--hidden_sizes=4"]
    args += [f"--workdir={tmp_path / 'run'}", "--jit_compile=false"]
    result = forkserver.run(["launch.py", *args], capture_output=True, timeout=300)
    assert result.returncode == 0 and b"test accuracy" in result.stdout, result.stderr
    assert b"dataset=npz:" + path in result.stdout  # the run's first line names the file by its bytes
