"""engine/data/images.py: the training crop is a function of the seed and stays inside the image, the flip flips, the
evaluation crop is the centre window, every encoding comes out uint8 [S, S, 3], a broken image raises;
imagenet2012 (mock files of random sizes) trains end to end offline; bench/decode.py runs."""

import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from bench import decode as decode_bench
from engine.data import images, tfds_source
from engine.run import loop
from engine.settings.errors import ConfigError
from tests import forkserver, helpers


def _position_image(height, width):
    """uint8 [height, width, 3]: red is the row, green the column, blue 7 (so a crop tells where it came from)."""
    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    return np.stack([rows, cols, np.full_like(rows, 7)], axis=-1).astype(np.uint8)


def _png(array):
    return tf.io.encode_png(array)


def _decode(size):
    return images.decoder(helpers.make_config("", image_size=size, dataset="folder:photos").data)


def _seed(n):
    return tf.constant([n, 12345], tf.int64)


def test_zero_image_size_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--image_size=0: --dataset=imagenet2012 has encoded images of no fixed"):
        images.decoder(helpers.make_config("", dataset="imagenet2012").data)


def test_same_seed_same_crop_different_seeds_different_crops():
    rng = np.random.default_rng(0)
    encoded = tf.io.encode_jpeg(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8))
    decode = _decode(24)
    # Inside tf.data, as the engine runs it: example i gets seed (i, 12345); two passes give the same pixels.
    ds = tf.data.Dataset.range(12).map(lambda i: decode({"image": encoded, "label": i}, tf.stack([i, 12345]), True))
    first, second = [np.stack([x["image"] for x in ds.as_numpy_iterator()]) for _ in range(2)]
    assert first.shape == (12, 24, 24, 3) and first.dtype == np.uint8
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first[5], decode({"image": encoded}, _seed(5), True)["image"].numpy())
    distinct = {first[i].tobytes() for i in range(12)}
    assert len(distinct) == 12


@pytest.mark.parametrize("training", [True, False])
def test_every_encoding_comes_out_uint8_square_rgb(training):
    rng = np.random.default_rng(1)
    encodings = {
        "jpeg rgb": tf.io.encode_jpeg(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)),
        "jpeg gray": tf.io.encode_jpeg(rng.integers(0, 256, (61, 29, 1), dtype=np.uint8)),
        "png gray": _png(rng.integers(0, 256, (19, 44, 1), dtype=np.uint8)),
        "png rgba": _png(rng.integers(0, 256, (50, 41, 4), dtype=np.uint8)),
        "tiny png": _png(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8)),
    }
    decode = _decode(16)
    for name, encoded in encodings.items():
        image = decode({"image": encoded}, _seed(3), training)["image"]
        assert image.shape == (16, 16, 3) and image.dtype == tf.uint8, name


def test_eval_centre_crop_is_the_centre_window():
    # 16 x 25: the centre square is round(0.875 x 16) = 14 a side, from row (16 - 14 + 1) // 2 = 1 and column
    # (25 - 14 + 1) // 2 = 6; at --image_size=14 nothing is resized, so the pixels are exactly that window.
    landscape = _position_image(16, 25)
    out = _decode(14)({"image": _png(landscape), "label": 3}, _seed(0), False)
    np.testing.assert_array_equal(out["image"].numpy(), landscape[1:15, 6:20])
    assert out["label"] == 3
    portrait = _position_image(25, 16)
    np.testing.assert_array_equal(_decode(14)({"image": _png(portrait)}, None, False)["image"], portrait[6:20, 1:15])


def test_eval_crop_of_grayscale_and_rgba_pngs():
    gray = np.random.default_rng(2).integers(0, 256, (16, 24, 1), dtype=np.uint8)
    out = _decode(14)({"image": _png(gray)}, None, False)["image"].numpy()
    np.testing.assert_array_equal(out, np.repeat(gray[1:15, 5:19], 3, axis=-1))
    rgba = np.concatenate([_position_image(16, 24), np.full((16, 24, 1), 9, np.uint8)], axis=-1)
    out = _decode(14)({"image": _png(rgba)}, None, False)["image"].numpy()
    np.testing.assert_array_equal(out, rgba[1:15, 5:19, :3])  # alpha dropped


def test_eval_jpeg_decodes_only_the_centre_window():
    encoded = tf.io.encode_jpeg(np.random.default_rng(3).integers(0, 256, (16, 24, 3), dtype=np.uint8))
    expected = tf.image.decode_and_crop_jpeg(encoded, [1, 5, 14, 14], channels=3)
    np.testing.assert_array_equal(_decode(14)({"image": encoded}, None, False)["image"], expected)


@pytest.mark.parametrize("training", [True, False])
def test_a_corrupt_image_raises_in_the_pipeline(training):
    # The engine stops the run naming the file when decode raises; nothing may come out of a broken image instead.
    pixels = np.random.default_rng(4).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    jpeg, png = tf.io.encode_jpeg(pixels).numpy(), tf.io.encode_png(pixels).numpy()
    decode = _decode(16)
    for broken in (b"not an image", b"", jpeg[: len(jpeg) // 2], png[: len(png) // 2]):
        ds = tf.data.Dataset.from_tensors(broken).map(lambda e: decode({"image": e}, _seed(0), training)["image"])
        with pytest.raises(tf.errors.InvalidArgumentError):
            list(ds)


def _with_thumbnail(jpeg):
    """`jpeg` with a camera's EXIF segment (APP1) holding a JPEG thumbnail, whose end-of-image marker comes first."""
    thumbnail = tf.io.encode_jpeg(np.full((8, 8, 3), 128, np.uint8)).numpy()
    exif = b"Exif\x00\x00" + thumbnail
    return jpeg[:2] + b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif + jpeg[2:]


@pytest.mark.parametrize("thumbnail", [False, True])
def test_a_truncated_jpeg_raises_at_its_first_read_whatever_the_crop(thumbnail):
    """A JPEG cut short decoded wherever the crop stopped above the cut: a run read it for epochs and stopped only
    when a random crop reached it; one with an EXIF thumbnail did still. Bytes after its end (a phone's motion photo)
    are no cut."""
    pixels = np.random.default_rng(5).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    jpeg = tf.io.encode_jpeg(pixels).numpy()
    jpeg = _with_thumbnail(jpeg) if thumbnail else jpeg
    cut = jpeg[: len(jpeg) * 9 // 10]
    assert tf.image.decode_and_crop_jpeg(cut, [0, 0, 100, 400]).shape == (100, 400, 3)  # above the cut: it decodes
    decode = _decode(16)
    for training, seed in [(True, 2), (True, 6), (True, 0), (False, 0)]:  # 2 and 6 crop above the cut, 0 across
        with pytest.raises(tf.errors.InvalidArgumentError, match="truncated: a JPEG without its end-of-image marker"):
            decode({"image": tf.constant(cut)}, _seed(seed), training)
    trailing = tf.constant(jpeg + b"\x00\x00\x00\x18ftypmp42 a video after the photo")
    assert decode({"image": trailing}, _seed(1), True)["image"].shape == (16, 16, 3)


@pytest.mark.parametrize("shape", [(300, 400), (50, 50), (37, 61), (400, 300)])
def test_training_crops_stay_inside_the_image_with_area_and_aspect_in_range(shape):
    height, width = shape
    centre = images.centre_window(tf.constant([height, width, 3])).numpy().tolist()
    fallbacks = 0
    areas = []
    for n in range(200):
        top, left, h, w = images.train_window(tf.constant([height, width, 3]), _seed(n)).numpy().tolist()
        assert 0 <= top and 0 <= left and h >= 1 and w >= 1 and top + h <= height and left + w <= width
        if [top, left, h, w] == centre:
            fallbacks += 1
            continue
        areas.append(h * w / (height * width))
        assert 0.08 <= areas[-1] <= 1.0
        assert (w + 1) / h >= 3 / 4 and (w - 1) / h <= 4 / 3  # the range, up to rounding to whole pixels
    assert fallbacks <= 4  # 10 tries nearly always find a window in these shapes
    assert min(areas) < 0.2 and max(areas) > 0.7  # the whole range is drawn from


def test_training_crop_of_a_panorama_falls_back_to_the_centre():
    # 8% of 10 x 500 is 400 pixels: no window of aspect <= 4/3 fits in 10 rows, so every seed takes the centre.
    for n in range(5):
        window = images.train_window(tf.constant([10, 500, 3]), _seed(n)).numpy().tolist()
        assert window == [1, 246, 9, 9]


def test_training_output_is_its_window_resized_and_flip_flips():
    image = _position_image(200, 240)
    encoded = _png(image)
    decode = _decode(32)
    flipped = 0
    for n in range(16):
        crop_seed, _ = tf.unstack(tf.random.experimental.stateless_split(_seed(n), 2))
        top, left, h, w = images.train_window(tf.constant([200, 240, 3]), crop_seed).numpy().tolist()
        unflipped = images.random_crop(encoded, crop_seed, 32).numpy().astype(int)
        expected = tf.image.resize(image[top : top + h, left : left + w], [32, 32]).numpy()
        np.testing.assert_array_equal(unflipped, np.round(expected))
        # Bilinear resizing mixes pixels of the window only: rows and columns come from inside it.
        assert top <= unflipped[..., 0].min() and unflipped[..., 0].max() <= top + h - 1
        assert left <= unflipped[..., 1].min() and unflipped[..., 1].max() <= left + w - 1
        assert (np.diff(unflipped[..., 1], axis=1) >= 0).all() and (np.diff(unflipped[..., 1], axis=1) > 0).any()
        out = decode({"image": encoded}, _seed(n), True)["image"].numpy()
        if np.array_equal(out, unflipped):
            continue
        np.testing.assert_array_equal(out, unflipped[:, ::-1])  # the same crop, mirrored left to right
        flipped += 1
    assert 3 <= flipped <= 13  # about half of the seeds flip


def _mock_imagenet_info(data_dir, shards):
    """Writes imagenet2012's real dataset_info (its features, 1000 classes) into data_dir with the splits' shard
    sizes set ({split: [examples per shard]}): what tfds.testing.mock_data(policy=USE_FILES) reads, and what the
    engine plans its epochs by."""
    with tfds_source.no_leftover_folders():  # tfds leaves an empty folder in /tmp otherwise
        builder = tfds.builder("imagenet2012", data_dir=data_dir)

    def split(name):
        files = tfds.core.ShardedFileTemplate(
            data_dir=builder.data_dir, dataset_name=builder.name, split=name, filetype_suffix="tfrecord"
        )
        return tfds.core.SplitInfo(
            name=name, shard_lengths=shards[name], num_bytes=2000 * sum(shards[name]), filename_template=files
        )

    builder.info.set_splits(tfds.core.SplitDict([split(name) for name in shards]))
    os.makedirs(builder.data_dir)
    builder.info.write_to_directory(builder.data_dir)


def test_mock_imagenet2012_trains_end_to_end_offline(one_device, tmp_path):
    data_dir = str(tmp_path / "tfds")
    # mock_data yields num_examples for every split: both splits have that many, so the counts agree.
    _mock_imagenet_info(data_dir, {"train": [16] * 4, "validation": [64]})
    config = helpers.make_config(
        data_dir,
        str(tmp_path / "run"),
        dataset="imagenet2012",
        train_split="train",
        eval_split="validation",
        image_size=32,
        model="resnet",
        global_batch_size=16,
        train_steps=6,
        steps_per_loop=3,
        eval_every=3,
    )
    with tfds.testing.mock_data(num_examples=64, policy=tfds.testing.MockPolicy.USE_FILES, data_dir=data_dir):
        summary = loop.train(config, one_device)
    assert summary["step"] == 6 and summary["skipped_steps"] == 0 and math.isfinite(summary["train_loss"])
    assert summary["eval"]["examples"] == 64 and math.isfinite(summary["eval"]["loss"])
    assert 0 <= summary["eval"]["accuracy"] <= 1
    assert helpers.logged_steps(config.workdir) == [3, 6]
    evaluated = [json.loads(line) for line in open(tmp_path / "run" / "eval.jsonl")]
    assert [e["step"] for e in evaluated] == [3, 6] and all(e["examples"] == 64 for e in evaluated)


@pytest.mark.slow
def test_decode_benchmark_runs_the_decoder_locally_and_in_a_tf_data_service_worker(tmp_path):
    # The quick mode: small JPEGs, short windows. It also shows the decoder's graph runs in a service worker.
    out = tmp_path / "decode.json"
    result = forkserver.run(
        ["-m", "bench.decode", "--quick", f"--json={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    measured = json.loads(out.read_text())
    table = decode_bench.rows(measured)
    assert [row["id"] for row in table] == [
        "decode/per_core",
        "decode/keeps_up",
        "decode/service",
        "decode/uint8",
        "decode/bfloat16",
    ]
    for row in table:
        assert math.isfinite(row["value"]) and row["value"] > 0 and row["shown"] in result.stdout, row
    assert measured["cores"] == len(os.sched_getaffinity(0))
    assert table[0]["value"] == measured["examples_per_sec"]["local"] / measured["cores"]
    assert table[1]["result"] == ("PASS" if measured["delivered_vs_consumed"] >= 1 else "FALL SHORT")
