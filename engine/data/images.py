"""Encoded images (JPEG or PNG, any size; grayscale, RGB or RGBA) to uint8 [S, S, 3], S = --image_size.

Training takes an Inception-style random-resized crop (8%-100% of the area, aspect 3/4-4/3, ATTEMPTS tries, then
the centre crop) and a random horizontal flip, both drawn by stateless ops from the example's seed: the same seed
gives the same pixels, so a resumed run sees what an uninterrupted one would. Evaluation takes the centre square of
0.875 x the shorter side, resized to S: the pixels of the usual ImageNet practice (shorter side resized to
S / 0.875, centre S x S cut out) without resizing what is cut away. A JPEG is decoded only inside its crop window
(decode_and_crop_jpeg), which is faster than decoding it whole (measured: bench/RESULTS.md, section "JPEGs decoded
inside the crop window"); one without its end-of-image marker (cut short) is refused at every read, whatever the
window.

Images come out uint8, a quarter of float32's bytes through the decode's buffers; the task scales the batch
(tasks/classification.py `prepare`, on the host): on a CPU, where host and device are the same cores, where to
scale was a wash (measured: bench/RESULTS.md, section "Where images are scaled"). Scaling in the step would pay
on an accelerator (a quarter of the bytes over the host-to-device link): measure it there before moving it.
"""

import tensorflow as tf

from engine.settings.errors import ConfigError

AREA = (0.08, 1.0)  # fraction of the image a training crop covers
ASPECT = (3 / 4, 4 / 3)  # width / height of a training crop
ATTEMPTS = 10  # windows drawn before a training crop falls back to the centre crop
CENTRE = 0.875  # evaluation: the centre crop's side / the shorter side (224 of 256)
JPEG_END = b"\xff\xd9"  # a JPEG's end-of-image marker: TensorFlow decodes no JPEG whole without it
APPLICATIONS = 64  # application segments skipped at most before a JPEG's end marker is looked for (an ICC
# profile of 4 MiB takes 64)
TRUNCATED = "truncated: a JPEG without its end-of-image marker"


def decoder(data, feature="image"):
    """`decode(example, seed, training) -> example` with `example[feature]` (an encoded image string) replaced by
    uint8 [S, S, 3], S the run's --image_size (`data`: its config.data); `seed` is a [2] int64 stateless seed (used
    when `training`, a Python bool)."""
    size = data.image_size
    if size <= 0:
        raise ConfigError(
            f"--image_size={size}: --dataset={data.dataset} has encoded images of no fixed shape ({feature}); "
            "set --image_size to the side its crops are resized to, e.g. 224"
        )

    def decode(example, seed, training):
        encoded = example[feature]
        if training:
            crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
            image = tf.image.stateless_random_flip_left_right(random_crop(encoded, crop_seed, size), flip_seed)
        else:
            image = centre_crop(encoded, size)
        return {**example, feature: image}

    return decode


def random_crop(encoded, seed, size):
    """The random-resized crop `seed` draws, resized to size x size, uint8 (not flipped)."""
    return _crop(encoded, lambda shape: train_window(shape, seed), size)


def centre_crop(encoded, size):
    """The evaluation crop: the centre square of CENTRE x the shorter side, resized to size x size, uint8."""
    return _crop(encoded, centre_window, size)


def train_window(shape, seed):
    """[top, left, height, width] of a random-resized crop of an image of `shape` ([height, width, ...])."""
    begin, extent, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.cast(shape, tf.int32),
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed,
        min_object_covered=0.0,
        aspect_ratio_range=ASPECT,
        area_range=AREA,
        max_attempts=ATTEMPTS,
        use_image_if_no_bounding_boxes=True,
    )
    window = tf.concat([begin[:2], extent[:2]], 0)
    # After ATTEMPTS misses the sampler returns the whole image, whatever its aspect (a panorama would be squashed):
    # take the evaluation crop instead, as Inception's recipe does. (A drawn window that is the whole image looks
    # the same and is taken as a miss too: rare, and it only ever happens to images of an aspect in range.)
    whole = tf.reduce_all(tf.equal(extent[:2], tf.cast(shape[:2], tf.int32)))
    return tf.cond(whole, lambda: centre_window(shape), lambda: window)


def centre_window(shape):
    """[top, left, height, width] of the centre square, CENTRE x the shorter side (at least 1 pixel)."""
    height, width = tf.cast(shape[0], tf.int32), tf.cast(shape[1], tf.int32)
    side = tf.maximum(1, tf.cast(tf.round(tf.cast(tf.minimum(height, width), tf.float32) * CENTRE), tf.int32))
    return tf.stack([(height - side + 1) // 2, (width - side + 1) // 2, side, side])


def _crop(encoded, window_of, size):
    def jpeg():
        # Only the window's blocks are decoded: a JPEG cut short decoded where a window stopped above the cut, and
        # stopped the run only when one reached it, epochs later. Without its end it stops the run at its first read.
        ended = tf.debugging.Assert(_ended(encoded), [TRUNCATED])
        with tf.control_dependencies([ended]):
            window = window_of(tf.io.extract_jpeg_shape(encoded))
        return tf.image.decode_and_crop_jpeg(encoded, window, channels=3)

    def other():
        # PNG (and GIF, BMP): decoded whole; channels=3 turns grayscale to RGB and drops alpha.
        image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        top, left, height, width = tf.unstack(window_of(tf.shape(image)))
        return image[top : top + height, left : left + width]

    image = tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image.set_shape([None, None, 3])
    resized = tf.image.resize(image, [size, size], method="bilinear")
    return tf.saturate_cast(tf.round(resized), tf.uint8)


def _ended(encoded):
    """Whether the JPEG `encoded` has an end-of-image marker after its application segments (APPn, COM): a camera's
    EXIF thumbnail, a JPEG of its own, ends in one too, and a photo cut short below it passed for whole. Bytes after
    the end (a phone's motion photo) are no cut."""
    pieces = tf.strings.split(encoded, sep=JPEG_END)
    last_end = tf.strings.length(encoded) - tf.strings.length(pieces[-1])  # just past the last marker (if any)
    return (tf.size(pieces) > 1) & (last_end > _after_applications(encoded))


def _after_applications(encoded):
    """The offset of the first segment after the application segments at the JPEG's head, each skipped by its
    length; 0 where the head does not read as segments (such a JPEG is searched whole, as before)."""

    def head(at):  # the marker at `at` and its segment's length, zeros past the end
        found = tf.io.decode_raw(tf.strings.substr(encoded, at, 4), tf.uint8, fixed_length=4)
        return tf.cast(found, tf.int32)

    def application(at, marker):
        return (marker[0] == 0xFF) & (((marker[1] >= 0xE0) & (marker[1] <= 0xEF)) | (marker[1] == 0xFE))

    def skip(at, marker):
        at = tf.minimum(at + 2 + marker[2] * 256 + marker[3], tf.strings.length(encoded))
        return at, head(at)

    at, marker = tf.while_loop(application, skip, (2, head(2)), maximum_iterations=APPLICATIONS)  # after the SOI
    return tf.where(marker[0] == 0xFF, at, 0)
