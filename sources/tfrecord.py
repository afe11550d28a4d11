"""Your own TFRecord files (--dataset=tfrecord:GLOB) of tf.train.Example records, streamed.

Your own TFRecord files, no builder: `--dataset=tfrecord:GLOB`, files of tf.train.Example records (what TPU jobs
read from cloud storage: gs:// works), one glob for every split with `{split}` where a split's name goes:

    --dataset='tfrecord:/data/imagenet/{split}-*.tfrecord' --tfrecord_features=image:jpeg,label:int64
    --tfrecord_classes=1000 --image_size=224

trains on /data/imagenet/train-*.tfrecord (--train_split) and evaluates /data/imagenet/test-*.tfrecord (--eval_split).

--tfrecord_features names the features a run reads, `name:type` or `name:type:shape`, comma separated (the records'
other features are ignored):
- `jpeg`, `png` or `image`: an encoded JPEG or PNG of any size (a bytes_list of one value); needs --image_size:
  training reads random-resized crops of that side, flipped at random, evaluation the centre crop
  (engine/data/images.py).
- `int64`, `float32`, `string`: a scalar (a list of one value).
- `int64:AxBx..`, `float32:AxBx..`: a tensor of that shape stored flat, row-major, as an int64_list or float_list
  of A*B*.. values (e.g. `image:float32:28x28x1`).
- `uint8:AxBx..`: a tensor of that shape stored as its raw bytes, one bytes_list value (numpy's `array.tobytes()`,
  e.g. `image:uint8:28x28x1`): a quarter of the size of a float_list.
A `label` is a class: `label:int64`, with --tfrecord_classes, its number of classes (the records cannot tell it
without reading them all). A label outside [0, --tfrecord_classes), or a record whose features are of another type
or shape than named, stops the run naming its file and record.

Each split is streamed file by file (engine/data/records.py `sharded`): each input pipeline reads its own files, and a
resume
skips whole files by arithmetic on their exact numbers of records. Those are counted from the record headers (each
record's length; the payloads are skipped, not read) once per file and kept in <--data_dir>/tfrecord_counts.json,
keyed by the file's path and trusted while its size, modification time and a fingerprint of its first and last
bytes match, so later runs do not read them again (a data dir that cannot be written, or a cache that is not one,
only costs the recount). A path the glob matches that is a directory or cannot be read, or a file that does not end
on a record boundary (truncated, or not an uncompressed TFRecord file), is refused naming it; a record that fails
its checksum or does not parse, or a file that holds more records than counted, stops the run naming its file.
"""

import concurrent.futures
import glob
import hashlib
import json
import os
import struct
import uuid

import tensorflow as tf

from engine.api import ENGINE_FEATURES, ConfigError, Source, first_line, image_decoder, sharded

SETTINGS = {
    "tfrecord_features": (
        "",
        "the features to read, name:type[:shape],... with type jpeg, png, image, int64, float32, string, uint8 "
        "(e.g. image:jpeg,label:int64 or image:uint8:28x28x1,label:int64)",
        "required",
    ),
    "tfrecord_classes": (0, "number of classes of an int64 `label` (labels 0 .. N-1), at least 2", (0, 2147483647)),
}
READS = ("image_size",)  # the engine's setting: the side encoded images decode to
# What follows the source's name in --dataset, and what it names: --help says so.
ARGUMENT = ("GLOB", "tf.train.Example files, {split} in the glob")
IMAGES = ("jpeg", "png", "image")  # encoded, any size: decoded to --image_size by engine/data/images.py
SCALARS = {"int64": tf.int64, "float32": tf.float32, "string": tf.string}
CACHE = "tfrecord_counts.json"  # in --data_dir: {path: {"size", "mtime_nsec", "fingerprint", "records"}}
_FINGERPRINT = 4096  # bytes at each end of a file that its fingerprint hashes
_BLOCK = 1 << 20  # bytes read at once while counting: the headers of records smaller than this come in one read
_HEADER = 12  # a record: length (8 bytes, little-endian), its CRC (4), the payload, the payload's CRC (4)


def load(config, eval_split):
    pattern = config.dataset.partition(":")[2]
    where = f"--dataset={config.dataset}"
    if not pattern:
        raise ConfigError(f"{where}: name the files, --dataset=tfrecord:GLOB with {{split}} in it")
    if "{split}" not in pattern:
        raise ConfigError(
            f"{where}: put {{split}} where the split's name goes, e.g. tfrecord:/data/{{split}}-*.tfrecord"
        )
    features = _features(config)
    parse, spec, decode = _reader(config, features)
    info = {}
    if features.get("label") == ("int64", ()):
        if not config.tfrecord_classes:
            raise ConfigError(
                f"{where}: its int64 label needs --tfrecord_classes, the number of classes (labels 0 .. N-1)"
            )
        if config.tfrecord_classes == 1:  # one class: every prediction is right, and the accuracy says nothing
            raise ConfigError("--tfrecord_classes=1: a classification needs at least 2 classes")
        info["num_classes"] = config.tfrecord_classes
    splits = {}
    for flag, split in (("train_split", config.train_split), ("eval_split", eval_split)):
        files = pattern.replace("{split}", split)
        paths = _matched(files, where)
        if not paths:
            raise ConfigError(f"{where}: no files match {files} (--{flag}={split})")
        counted = record_counts(paths, _data_dir(config), where)
        if not sum(counted):
            raise ConfigError(f"{where}: the {len(paths)} files of {files} hold no records (--{flag}={split})")
        splits[split] = sharded(tuple(zip(paths, counted)), parse)
    return Source(splits[config.train_split], splits[eval_split], spec, info, decode=decode)


def _matched(files, where):
    """The files the glob `files` matches, sorted; one whose name is not UTF-8 (which TensorFlow's readers cannot
    open) is refused by its bytes."""
    try:
        return sorted(tf.io.gfile.glob(files))
    except UnicodeDecodeError:
        bytes_names = [] if "://" in files else glob.glob(os.fsencode(files))
        bad = next((name for name in bytes_names if not _utf8(name)), None)
        named = "" if bad is None else f" ({bad.decode(errors='backslashreplace')})"
        raise ConfigError(
            f"{where}: a file that {files} matches is named by bytes that are not UTF-8{named}, which TensorFlow's "
            "record reader cannot open: rename it"
        ) from None


def _utf8(name):
    try:
        name.decode()
    except UnicodeDecodeError:
        return False
    return True


def _features(config):
    """{name: (type, shape)} from --tfrecord_features."""
    text = config.tfrecord_features

    def refuse(why):
        raise ConfigError(f"--tfrecord_features={text}: {why}")

    if not text:
        refuse(f"--dataset={config.dataset} needs it, e.g. image:jpeg,label:int64")
    features = {}
    for item in text.split(","):
        name, _, typed = item.strip().partition(":")
        kind, *shape = typed.split(":")
        if not name or kind not in (*IMAGES, *SCALARS, "uint8") or len(shape) > 1:
            refuse(f"{item!r} is not name:type[:shape] with type one of {', '.join((*IMAGES, *SCALARS, 'uint8'))}")
        if name in features:
            refuse(f"{name} is named twice")
        dims = tuple(shape[0].split("x")) if shape else ()
        if not all(d.isdigit() and int(d) > 0 for d in dims):
            refuse(f"{item!r}: the shape must be sizes joined by x, e.g. 28x28x1")
        if dims and kind not in ("int64", "float32", "uint8"):
            refuse(f"{item!r}: a {kind} is one value, with no shape")
        if kind == "uint8" and not dims:
            refuse(f"{item!r}: uint8 is a tensor's raw bytes and needs its shape, e.g. {name}:uint8:28x28x1")
        if name in ENGINE_FEATURES:  # the engine's would overwrite it, or take it for its own
            refuse(f"{name} is a feature the engine sets itself ({ENGINE_FEATURES[name]}): leave it out")
        features[name] = (kind, tuple(int(d) for d in dims))
    if "label" in features and features["label"] != ("int64", ()):
        refuse(f"a label is a class, label:int64 (not label:{_typed(features['label'])})")
    return features


def _typed(feature):
    """A feature's `type[:shape]` as --tfrecord_features writes it."""
    kind, shape = feature
    return ":".join([kind, *(["x".join(map(str, shape))] if shape else [])])


def _reader(config, features):
    """(parse: serialized Example -> {feature: tensor}, spec of a decoded example, decode or None)."""
    wire, spec, images = {}, {}, []
    for name, (kind, shape) in features.items():
        if kind in IMAGES or kind == "uint8":
            wire[name] = tf.io.FixedLenFeature([], tf.string)
        else:
            wire[name] = tf.io.FixedLenFeature(shape, SCALARS[kind])
        if kind in IMAGES:
            images.append(name)
            spec[name] = tf.TensorSpec([config.image_size, config.image_size, 3], tf.uint8)
        else:
            spec[name] = tf.TensorSpec(shape, tf.uint8 if kind == "uint8" else SCALARS[kind])
    if images and not config.image_size:
        raise ConfigError(
            f"--dataset={config.dataset}: {', '.join(images)} holds encoded images, which come in many sizes: "
            "set --image_size (e.g. 224), the side of the crops"
        )
    classes = config.tfrecord_classes if features.get("label") == ("int64", ()) else 0

    def parse(serialized):
        example = tf.io.parse_single_example(serialized, wire)
        for name, (kind, shape) in features.items():
            if kind == "uint8":
                # reshape refuses a record whose bytes are not exactly the shape's.
                example[name] = tf.reshape(tf.io.decode_raw(example[name], tf.uint8), shape)
        if classes:
            label = example["label"]
            check = tf.debugging.Assert(
                (label >= 0) & (label < classes),
                [tf.strings.format(f"label {{}} is outside [0, {classes}) (--tfrecord_classes={classes})", label)],
            )
            with tf.control_dependencies([check]):
                example["label"] = tf.identity(label)
        return example

    if not images:
        return parse, spec, None

    decoders = [image_decoder(config.data, feature=name) for name in images]

    def decode(example, seed, training):
        for i, decoder in enumerate(decoders):
            # Each image feature its own crop: the example's seed folded with the feature's position.
            example = decoder(example, tf.random.experimental.stateless_fold_in(seed, i) if i else seed, training)
        return example

    return parse, spec, decode


def _data_dir(config):
    return os.path.expanduser(config.data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets")


def record_counts(paths, data_dir, where):
    """The exact number of records of each TFRecord file in `paths`, from the cache in `data_dir` where the file's
    size, modification time and fingerprint match, else counted (and cached)."""
    cache_path = os.path.join(data_dir, CACHE)
    cached = _read_cache(cache_path)
    keys = [p if "://" in p else os.path.abspath(p) for p in paths]

    def count(key):
        identity = _identity(key, where)
        entry = cached.get(key)
        # Anything else in the cache (another program's, half a version's) is counted again.
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in identity.items()):
            records = entry.get("records")
            if isinstance(records, int) and not isinstance(records, bool) and records >= 0:
                return entry
        return {**identity, "records": _count(key, identity["size"], where)}

    # Threads: on an object store each file costs round trips, not CPU.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        entries = dict(zip(keys, pool.map(count, keys)))
    if any(cached.get(k) != e for k, e in entries.items()):
        _write_cache(cache_path, entries)
    return [entries[k]["records"] for k in keys]


def _identity(path, where):
    """What the cache compares to trust a count: the file's size, modification time and a fingerprint of its first
    and last bytes (a file replaced by one of the same size and time, as `cp -p` leaves it, is counted again)."""
    try:
        stat = tf.io.gfile.stat(path)
        if stat.is_directory:
            raise ConfigError(f"{where}: {path} is a directory, not a TFRecord file")
        with tf.io.gfile.GFile(path, "rb") as f:
            ends = f.read(_FINGERPRINT)
            if stat.length > _FINGERPRINT:
                f.seek(max(stat.length - _FINGERPRINT, _FINGERPRINT))
                ends += f.read(_FINGERPRINT)
    except tf.errors.OpError as e:
        reason = first_line(e.message or str(e)).removeprefix(f"{path}; ")
        raise ConfigError(f"{where}: cannot read {path}: {reason}") from None
    fingerprint = hashlib.sha256(ends).hexdigest()[:32]
    return {"size": stat.length, "mtime_nsec": stat.mtime_nsec, "fingerprint": fingerprint}


def _count(path, size, where):
    """Records in the TFRecord file `path` of `size` bytes, reading only their headers."""
    records, position = 0, 0
    block, start = b"", 0  # the bytes read last and where they start: small records' headers share a read
    with tf.io.gfile.GFile(path, "rb") as f:
        while position + _HEADER <= size:
            if position + _HEADER > start + len(block):
                f.seek(position)
                block, start = f.read(_BLOCK), position
                if len(block) < _HEADER:
                    break
            end = position + _HEADER + struct.unpack_from("<Q", block, position - start)[0] + 4
            if end > size:
                break
            position, records = end, records + 1
    if position != size:
        raise ConfigError(
            f"{where}: {path} is truncated: its {size} bytes do not end on a record boundary (after {records} whole "
            f"records; or it is not an uncompressed TFRecord file)"
        )
    return records


def _read_cache(cache_path):
    try:
        with tf.io.gfile.GFile(cache_path, "r") as f:
            cached = json.load(f)
    except (tf.errors.OpError, OSError, ValueError):
        return {}  # none yet, or unreadable: count again
    return cached if isinstance(cached, dict) else {}  # not a cache of counts: count again, and replace it


def _write_cache(cache_path, entries):
    # Re-read first: other jobs may have cached other files meanwhile. Write then rename: a reader never sees half.
    merged = {**_read_cache(cache_path), **entries}
    temporary = f"{cache_path}.{uuid.uuid4().hex}"
    try:
        tf.io.gfile.makedirs(os.path.dirname(cache_path))
        with tf.io.gfile.GFile(temporary, "w") as f:
            json.dump(merged, f)
        tf.io.gfile.rename(temporary, cache_path, overwrite=True)
    except (tf.errors.OpError, OSError):
        pass  # a data dir that cannot be written: the next run counts again
