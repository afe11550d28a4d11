"""The splits a source gives (engine/data/datasets.py `Source`): held in memory (`in_memory`), or record files whose
records are counted exactly (`sharded`), read with any damage to a file carried beside each record, so a
truncated, corrupt or changed file stops the run naming it (`parsed`, `unreadable`).
"""

import dataclasses
import functools
import hashlib
import re

import numpy as np
import tensorflow as tf

from engine.settings.config import first_line
from engine.settings.errors import TaskError, counted

# The features the engine sets on an example itself, beside a source's: no spec, and no file a source reads, may name
# one (a column of them would be overwritten, or taken for the engine's).
ENGINE_FEATURES = {
    "index": "an example's position in its split, which seeds its random draws",
    "origin": "the file an example came from",
    "weight": "how much an evaluation example counts in the means, which a source's own code sets",
}
_RECORD_FRAMING = 16  # bytes a TFRecord adds to each record: length, its CRC, the data's CRC
UNREADABLE = "damaged record file:"  # the pipeline's error naming a truncated, corrupt or changed record file
_CHANGED = (
    "it changed after they were counted (--dataset=tfrecord: keeps its counts in tfrecord_counts.json in "
    "--data_dir: delete it to count them again)"
)


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a source: `examples` dicts of features, in a fixed order."""

    examples: int
    make: object  # () -> dataset of example dicts, in order
    fetch: object = None  # int64 indices [n] -> {feature: [n, ...]}: random access, when held in memory
    files: tuple = ()  # ((path, records), ...): record files, read in shards by input pipeline
    parse: object = None  # a serialized record -> {feature: tensor}, for `files`
    digest: object = None  # () -> a hex digest of the examples, when held in memory (a resume compares it)


class SplitError(TaskError):
    """A split a source made that cannot be read (features of different lengths); the source's file is named where
    its load is called (engine/data/source_checks.py)."""


def in_memory(arrays):
    """A Split of {feature: tensor of examples x ...} held in memory: batches are gathered, not iterated."""
    if not isinstance(arrays, dict) or not arrays:
        raise SplitError(f"in_memory takes {{feature: tensor of examples x ...}}, not {arrays!r:.80}")
    lengths = {name: _length(values) for name, values in arrays.items()}
    examples = next(iter(lengths.values()))
    if len(set(lengths.values())) > 1 or None in lengths.values():
        said = ", ".join(f"{name} {'a scalar' if n is None else n}" for name, n in lengths.items())
        raise SplitError(f"in_memory: each feature holds one value per example; these hold {said}")
    return Split(
        examples,
        lambda: tf.data.Dataset.from_tensor_slices(arrays),
        lambda indices: {name: tf.gather(values, indices) for name, values in arrays.items()},
        digest=functools.cache(lambda: digest(arrays)),  # read at the start and on a resume: hashed once
    )


def digest(arrays):
    """A hex digest of {feature: values}: their names, dtypes, shapes and every value (a string's bytes), so that a
    file of arrays replaced by another of as many examples reads as other examples."""
    hashed = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        values = np.asarray(arrays[name])
        hashed.update(f"{name} {values.dtype} {values.shape};".encode())
        if values.dtype.kind == "O":  # strings (file paths): their bytes, not the objects' addresses
            for value in values.ravel():
                hashed.update(value if isinstance(value, bytes) else str(value).encode())
                hashed.update(b"\0")
        else:
            hashed.update(np.ascontiguousarray(values).tobytes())
    return hashed.hexdigest()


def _length(values):
    """The examples a feature's values hold (their first dimension), or None for a scalar."""
    shape = values.shape if hasattr(values, "shape") else np.shape(values)
    return int(shape[0]) if len(shape) else None


def sharded(files, parse):
    """A Split of TFRecord files, ((path, number of records), ...), each record `parse`d into an example. The
    counts must be exact: they place every position of the stream."""
    files = tuple((str(path), int(records)) for path, records in files)
    make = lambda: file_records(files).map(lambda example: parsed(parse, example))  # noqa: E731
    return Split(sum(records for _, records in files), make, files=files, parse=parse)


def file_records(files, counter=None):
    """{"record", "origin", "damage"} of each counted record of `files` ((path, records), ...), file after file,
    unparsed (`parsed` parses one)."""
    paths, counts = zip(*files)
    ds = tf.data.Dataset.from_tensor_slices((list(paths), tf.constant(counts, tf.int64)))
    return ds.flat_map(lambda path, n: counted_records(path, n, counter)).map(record_example)


def record_example(origin, record, damage):
    return {"record": record, "origin": origin, "damage": damage}


def parsed(parse, example):
    """A record file's example (`file_records`) with its record `parse`d into features; stops on a damaged record,
    naming its file."""
    intact = tf.debugging.Assert(
        tf.equal(example["damage"][0], 0), [UNREADABLE, example["origin"], example["damage"]], summarize=2
    )
    with tf.control_dependencies([intact]):
        record = tf.identity(example["record"])
    return {**parse(record), **{k: v for k, v in example.items() if k not in ("record", "damage")}}


def counted_records(path, expected, counter=None):
    """(origin, record, damage) of a file's `expected` records: exactly that many, plus one where the file holds
    more, since the stream's arithmetic places every position by the counts. `damage` is [code, expected]: code 0
    for a sound record, 1 for one that could not be read (the file truncated, or a record whose checksum fails:
    it comes empty), 2 for a record beyond the count (the file changed after it was counted). `parsed` stops on
    a damaged one; the damage is carried, not raised, so that the decode's dropped errors
    (engine/data/pipeline.py `Pipelines._decoded`) cannot hide it."""
    # A file that cannot be opened (deleted or moved after it was counted) is read as holding no records: its
    # reader's error repeats on every try, which ignore_errors would retry forever (the run hung).
    read = tf.data.Dataset.from_tensors(path).filter(present).flat_map(tf.data.TFRecordDataset)
    read = read.ignore_errors().take(expected + 1).map(lambda r: (r, True))
    missing = tf.data.Dataset.from_tensors((tf.constant(b""), False)).repeat()  # stand-ins for records it lacks

    def judged(i, item):
        record, real = item
        # Past the count, a real record is one too many; a stand-in, the end where it should be (dropped below).
        code = tf.where(i < expected, tf.where(real, 0, 1), tf.where(real, 2, -1))
        origin = tf.strings.join([path, " record ", tf.strings.as_string(i)])
        return origin, record, tf.stack([tf.cast(code, tf.int64), expected])

    ds = read.concatenate(missing).take(expected + 1).enumerate().map(judged)
    ds = ds.filter(lambda origin, record, damage: damage[0] >= 0)
    if counter is not None:  # bytes read, for the read-amplification count

        def count(origin, record, damage):
            with tf.control_dependencies(
                [counter.assign_add(tf.cast(tf.strings.length(record) + _RECORD_FRAMING, tf.int64))]
            ):
                return origin, tf.identity(record), damage

        ds = ds.map(count)
    return ds


def present(path):
    """Whether the file `path` (a string tensor) exists, in the graph: a glob of the path, its wildcards escaped."""
    return tf.size(tf.io.matching_files(tf.strings.regex_replace(path, r"([*?\[\\])", r"\\\1"))) > 0


def op_message(error):
    """A TensorFlow error's first line without the function node and op names TensorFlow wraps it in."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", first_line(error.message or str(error)))
    text = re.sub(r"\s*\[Op:\w+\].*$", "", text)
    return re.sub(r"^assertion failed: \[(.*)\]$", r"\1", text)  # a check's own words, without the wrapping


def unreadable(error):
    """The line naming a damaged record file, when `error` is the pipeline's check of one; else None."""
    found = re.search(rf"{UNREADABLE}\] \[(.*) record \d+\] \[(\d+) (\d+)\]", error.message or "")
    if not found:
        return None
    path, code, expected = found.group(1), int(found.group(2)), int(found.group(3))
    if code == 2:
        return f"{path}: holds more than the {counted(expected, 'record')} counted: {_CHANGED}"
    if not tf.io.gfile.exists(path):  # its reader's error would repeat forever under ignore_errors
        return f"{path}: missing: it was deleted or moved after its {counted(expected, 'record')} were counted"
    read = sum(1 for _ in tf.data.TFRecordDataset(path).ignore_errors())  # only when it failed: read it whole
    # TensorFlow's reader stops at the first record that fails its checksum: those after it are not counted as read.
    return f"{path}: truncated or corrupt: it cannot be read past its first {counted(read, 'record')} (of {expected})"


@dataclasses.dataclass(frozen=True)
class Source:
    """What a dataset gives: its splits, the spec of one (decoded) example ({feature: tf.TensorSpec}, static
    shapes) and what it knows about them (`num_classes` of a `label`, a text's `vocabulary`, ...). An evaluation
    example may carry a float32 `weight`, how much it counts in the means (default 1). `decode(example, seed,
    training)` runs on each example before batching (seed: [2] int64, from the run's seed and the example's
    stream position); an example may carry `origin` (its file), named when it cannot be decoded."""

    train: Split
    evals: Split
    spec: dict
    info: dict
    decode: object = None
