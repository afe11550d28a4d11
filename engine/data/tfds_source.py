"""Any tensorflow-datasets name as a source: prepared once into --data_dir (tfds's default when empty), outside
--workdir: the prepared files, tfds's download cache (<data_dir>/downloads) and the lock that lets one process of a
job prepare it (<data_dir>/<dataset>/.prepare.lock). A split under 1 GiB is held in memory; a larger one is
streamed from its record files; photos of varied sizes are read encoded and decoded per example."""

import contextlib
import fcntl
import os
import socket
import tempfile
import urllib.parse
import urllib.request

import tensorflow as tf

from engine.data.records import ENGINE_FEATURES, Source, Split, in_memory, sharded
from engine.settings.config import first_line
from engine.settings.errors import ConfigError

_IN_MEMORY_LIMIT_BYTES = 1 << 30  # splits below this are held as tensors and batched with one gather


def _tensorflow_datasets():
    """tensorflow_datasets, imported by the first run that reads one of its datasets: the other sources (sources/)
    do not pay for importing it."""
    import tensorflow_datasets as tfds  # noqa: PLC0415

    return tfds


def load(config, name, features, eval_split):
    """The Source of the tensorflow-datasets dataset `name` (prepared into --data_dir on first use), keeping
    `features` (all when empty), evaluating `eval_split`."""
    tfds = _tensorflow_datasets()
    builder = _prepared_builder(config.data, name)
    info = builder.info
    keep = list(features or info.features.keys())
    absent = [f for f in keep if f not in info.features]
    if absent:
        raise ConfigError(
            f"--dataset={name}: --task={config.task} needs the features {', '.join(keep)} "
            f"(it has {', '.join(info.features.keys())})"
        )
    feature = next((f for f in keep if f in ENGINE_FEATURES), None)  # it would be taken for the engine's own
    if feature:
        reads = f"reads {feature}" if features else f"reads every feature (its `features` is empty), {feature} too"
        raise ConfigError(
            f"--dataset={name}: --task={config.task} {reads}, a name the engine gives a feature of its own "
            f"({ENGINE_FEATURES[feature]}): list the features the task reads in its `features`, leaving {feature} out"
        )
    encoded, decoders, spec, decode = _decoding(config.data, info, keep)
    for feature, feature_spec in spec.items():
        if not feature_spec.shape.is_fully_defined():
            raise ConfigError(f"--dataset={name}: {feature} has no fixed shape ({feature_spec.shape})")
    decoded_bytes = sum(s.shape.num_elements() * s.dtype.size for f, s in spec.items() if f not in encoded)
    known = {}
    if "label" in info.features and hasattr(info.features["label"], "num_classes"):
        known["num_classes"] = info.features["label"].num_classes
        known["class_names"] = tuple(info.features["label"].names)  # what the export returns beside each index

    def parse(record):
        example = info.features.deserialize_example(record, decoders=decoders)
        return {f: example[f] for f in keep}

    def split_fn(flag, split):
        try:
            split_info = info.splits[split]
        except (KeyError, ValueError, AssertionError) as e:
            raise ConfigError(
                f"--{flag}={split}: not a split of {name} (splits: {', '.join(info.splits.keys())}; {first_line(e)})"
            ) from None
        size = split_info.num_examples
        if not size:  # tfds would fail on reading it ("corresponds to no data")
            raise ConfigError(f"--{flag}={split}: holds no examples of {name}")
        held = size * decoded_bytes + (int(split_info.num_bytes) if encoded else 0)
        if held < _IN_MEMORY_LIMIT_BYTES:
            arrays = builder.as_dataset(split=split, shuffle_files=False, batch_size=-1, decoders=decoders)
            return in_memory({f: arrays[f] for f in keep})
        files = [str(path) for path in split_info.filepaths]
        if info.file_format == tfds.core.FileFormat.TFRECORD and all(tf.io.gfile.exists(f) for f in files):
            return sharded(zip(files, split_info.shard_lengths), parse)

        def make():  # another file format: tfds reads it
            ds = builder.as_dataset(split=split, shuffle_files=False, decoders=decoders)
            return ds.map(lambda x: {f: x[f] for f in keep})

        return Split(size, make)

    train = split_fn("train_split", config.train_split)
    return Source(train, split_fn("eval_split", eval_split), spec, known, decode)


def _decoding(data, info, keep):
    """(encoded features, tfds decoders, {feature: spec} as decoded, per-example decode or None) of the features
    `keep`. Photos of many sizes (imagenet2012 and most photo datasets) are read encoded and decoded per
    example."""
    tfds = _tensorflow_datasets()
    encoded = [
        f for f in keep if isinstance(info.features[f], tfds.features.Image) and None in info.features[f].shape[:2]
    ]
    decoders = {f: tfds.decode.SkipDecoding() for f in encoded}
    spec = {f: tf.TensorSpec(info.features[f].shape, info.features[f].tf_dtype) for f in keep}
    if not encoded:
        return encoded, decoders, spec, None
    from engine.data import images  # noqa: PLC0415  only runs that read photos need it

    steps = [images.decoder(data, f) for f in encoded]

    def decode(example, seed, training):
        for one in steps:
            example = one(example, seed, training)
        return example

    spec.update({f: tf.TensorSpec([data.image_size, data.image_size, 3], tf.uint8) for f in encoded})
    return encoded, decoders, spec, decode


def _prepared_builder(data, name):
    tfds = _tensorflow_datasets()
    data_dir = os.path.expanduser(data.data_dir) if data.data_dir else None
    if data_dir and os.path.exists(data_dir) and not os.path.isdir(data_dir):  # before a network is asked for
        raise ConfigError(f"--data_dir={data.data_dir}: a file, not a folder of datasets")
    try:
        with no_leftover_folders():
            builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises several kinds for names and configs it cannot resolve
        raise ConfigError(f"--dataset={name}: {first_line(e)}") from None
    # What builder.is_prepared() reads, without its warning about the folder it expected. A prepared dataset is only
    # read, without the lock: a --data_dir may be a read-only copy (its lock was a traceback there).
    if tf.io.gfile.exists(os.path.join(builder.data_dir, tfds.core.constants.DATASET_INFO_FILENAME)):
        return builder
    _check_reachable(data, builder)
    with _prepare_lock(builder.data_dir, data.data_dir):
        try:
            builder.download_and_prepare()
        except Exception as e:  # network, disk and checksum failures all end here
            raise ConfigError(
                f"--dataset={data.dataset}: could not download and prepare it into "
                f"{builder.data_dir} ({first_line(e)}); without a network, put a prepared "
                "copy under --data_dir"
            ) from None
    return builder


@contextlib.contextmanager
def no_leftover_folders():
    """The block's temporary folders (Python's tempfile) made inside one of ours, the empty ones removed as it ends:
    building a tfds builder of a dataset not yet prepared makes a /tmp/tmp*tfds folder that it never removes
    (tensorflow-datasets 4.9, DatasetInfo.initialize_from_bucket, before it finds nothing to copy there): one more
    left behind by every run that prepared a dataset or was refused one. A folder something was copied into stays."""
    scratch = tempfile.mkdtemp(prefix="engine-tfds-")
    saved, tempfile.tempdir = tempfile.tempdir, scratch
    try:
        yield
    finally:
        tempfile.tempdir = saved
        for folder in (*(os.path.join(scratch, name) for name in os.listdir(scratch)), scratch):
            with contextlib.suppress(OSError):  # not empty: tfds reads what it copied there
                os.rmdir(folder)


def _check_reachable(data, builder):
    """Refuses in seconds to download a dataset when its download hosts (or the proxy to them) do not answer:
    tfds would retry each file with backoff for minutes (urllib3: 10 tries) before failing."""
    proxies = urllib.request.getproxies()
    addresses = set()
    for url in builder.url_infos or ():
        parts = urllib.parse.urlsplit(url)
        proxy = proxies.get(parts.scheme)
        via = urllib.parse.urlsplit(proxy) if proxy and not urllib.request.proxy_bypass(parts.hostname) else parts
        addresses.add((via.hostname, via.port or (443 if via.scheme == "https" else 80), via is not parts))
    for host, port, is_proxy in sorted(addresses):
        try:
            socket.create_connection((host, port), timeout=3).close()
        except OSError as e:
            where = data.data_dir or _tensorflow_datasets().core.constants.DATA_DIR
            raise ConfigError(
                f"--dataset={data.dataset}: not prepared in --data_dir={where} ({builder.data_dir}) and the "
                f"network is unreachable ({'proxy ' if is_proxy else ''}{host}:{port}: {e.strerror or e}); prepare "
                "it on a machine with a network and copy it there"
            ) from None


@contextlib.contextmanager
def _prepare_lock(directory, given):
    """Held while the dataset is prepared into `directory` (under --data_dir, `given`; tfds's own when empty):
    workers of one job on one machine (or sharing a POSIX file system) prepare a dataset once."""
    if "://" in directory:
        yield
        return
    parent = os.path.dirname(directory.rstrip("/"))
    try:
        os.makedirs(parent, exist_ok=True)
        lock = open(os.path.join(parent, ".prepare.lock"), "w")
    except OSError as e:  # a read-only folder, another user's: one line, not a traceback
        where = f"--data_dir={given}" if given else "tensorflow-datasets' data folder (--data_dir is empty)"
        raise ConfigError(
            f"{where}: cannot prepare the dataset there: cannot create {e.filename} ({e.strerror})"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
