"""Input pipelines: the bundled sources (engine/sources/), your own files and any tensorflow-datasets name.

Every pipeline is a function of `tf.distribute.InputContext`, for
`strategy.distribute_datasets_from_function`. Training reads one stream of examples per run, a pure
function of the data position (global batches consumed), so a restored run starts at its position in
constant time and reads what an uninterrupted one would. Evaluation pads with weight-0 examples so
every real example is counted exactly once. Splits come in three kinds:

- held in memory (`in_memory`: arrays, or file paths and labels): random access. Global batch k is
  examples [k*G, (k+1)*G) of one global stream, each epoch a permutation by (seed, epoch); each input
  pipeline (one per worker) takes every n-th of them, so a step sees exactly the examples one device
  would, whatever the number of workers, and a pipeline reads only its own examples.
- record files too large for memory (`sharded`: TFRecords, a prepared tensorflow-datasets split): each
  input pipeline owns every n-th file (of a permutation by seed) and reads only those: its stream is
  its files, each epoch in an order by (seed, epoch), --interleave_files at a time interleaved example
  by example and shuffled together. The counts of records per file place any position by arithmetic:
  a restart skips whole epochs and groups of files unread and reads at most one group before its
  position. The stream depends on the number of pipelines, so a resumed run must have as many.
- anything else (`make` only): streamed and replayed up to the position on a restart.

A source may give a per-example `decode` (photos: decode, crop, flip) seeded by the example's stream
position, so a resumed run crops alike; a record file's records are parsed in the same step. An example
that cannot be parsed or decoded stops the run naming its file and record (Data.origin), and so does a
record file that holds fewer or more records than counted: nothing is skipped silently, and the run
resumes from its last checkpoint once the file is fixed or removed. An empty split is refused.

A tensorflow-datasets dataset is prepared once into --data_dir (tfds's default when empty), outside --workdir:
the prepared files, tfds's download cache (<data_dir>/downloads) and the lock that lets one process of a job
prepare it (<data_dir>/<dataset>/.prepare.lock).

The streams are engine/pipeline.py's, the splits and their record files engine/records.py's; their names a
source uses (Split, in_memory, sharded) are importable from here too.
"""

import contextlib
import dataclasses
import fcntl
import importlib
import math
import os
import socket
import urllib.parse
import urllib.request

import tensorflow as tf

import tasks
from engine import sources
from engine.config import check_memory, first_line
from engine.errors import ConfigError
from engine.pipeline import AUTOTUNE, UNDECODABLE, Pipelines  # noqa: F401  (read through this module)
from engine.records import (  # noqa: F401  (what a source builds its splits with)
    UNREADABLE,
    Split,
    file_records,
    in_memory,
    parsed,
    sharded,
    unreadable,
)

_Pipelines = Pipelines  # the name tests/test_streamed.py and bench/resume.py build one by
_IN_MEMORY_LIMIT_BYTES = 1 << 30  # splits below this are held as tensors and batched with one gather


class DecodeError(ConfigError):
    """An example of the data could not be decoded; the message names its file."""


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


@dataclasses.dataclass(frozen=True)
class Data:
    # (InputContext, start_batch, stream, counter) -> endless dataset of per-replica batches: {feature: tensor}
    # after the task's `prepare`, plus `index`, each example's position in the training stream (seeds per
    # example). `counter`, an int64 variable, counts the bytes of record files read.
    train_fn: object
    # InputContext -> finite dataset of eval_steps batches: the prepared features, `index` (the position in the
    # split) and `weight` (1 for an example, 0 for padding).
    eval_fn: object
    eval_steps: int  # evaluation steps that cover every evaluation example once
    eval_examples: int
    train_examples: int
    task: object  # the tasks/<name>.py Task this data was prepared for (built by engine/build.py, received here)
    spec: dict  # {feature: tf.TensorSpec} of one prepared example
    sharded: bool = False  # the training stream depends on the number of input pipelines
    train_bytes: int = 0  # record bytes of the training files, when sharded
    origin: object = None  # (position, training, pipelines) -> the file of an example, for a decode failure
    # (batch, pipeline, pipelines) -> input pipeline `pipeline`'s prepared share of global batch `batch` (tensors),
    # gathered from memory inside a step: what train_fn's batch would be. None: the split is not held in memory.
    gather: object = None


def task_class(config):
    """tasks/<config.task>.py's Task class: the builder (engine/build.py) reads it here, before the source, whose
    features it names; this module never builds a task."""
    return importlib.import_module(f"tasks.{config.task}").Task


def load(config, split=None):
    """The Data for `config` (evaluating `split`, default --eval_split), its source and task built as a run builds
    them (engine/build.py inputs); raises ConfigError for an unknown split or an unusable dataset."""
    from engine import build  # noqa: PLC0415  (the builder is upstream of this module: it imports it)

    return build.inputs(config, split)


def prepare(config, source, task, split=None):
    """The Data of `source` for `task` (built from the source's spec and info), evaluating `split`, default
    --eval_split. Sets `task.spec` to the prepared example's spec."""
    train, evals = source.train, source.evals
    _check_sizes(config, train, evals, split)
    eval_steps = math.ceil(evals.examples / config.per_eval_batch_size)

    def prepared(batch):
        # The task sees its features; the engine's own (index, weight) pass around it.
        own = {k: batch[k] for k in ("index", "weight") if k in batch}
        return {**task.prepare({k: v for k, v in batch.items() if k not in own}), **own}

    one = tf.data.Dataset.from_tensors({k: tf.zeros([1, *s.shape], s.dtype) for k, s in source.spec.items()})
    task.spec = {k: tf.TensorSpec(s.shape[1:], s.dtype) for k, s in one.map(prepared).element_spec.items()}
    _check_task_memory(config, task)
    pipelines = Pipelines(config.data, source)

    def train_fn(ctx, start_batch=0, stream=0, counter=None):
        """Per-replica batches from global batch `start_batch` on. `stream` > 0 gives an independent order (each
        parameter-server worker reads its own)."""
        ds = pipelines.train(ctx, start_batch, stream, counter).map(prepared, num_parallel_calls=AUTOTUNE)
        return _through_service(config, ds, ctx, stream, start_batch).prefetch(AUTOTUNE)

    def gather(batch, pipeline, num_pipelines):
        return prepared(pipelines.share(batch, pipeline, num_pipelines))

    def eval_fn(ctx):
        return pipelines.evaluation(ctx, eval_steps).map(prepared, num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)

    return Data(
        train_fn,
        eval_fn,
        eval_steps,
        evals.examples,
        train.examples,
        task,
        task.spec,
        sharded=bool(train.files),
        train_bytes=pipelines.train_bytes,
        origin=pipelines.origin,
        gather=gather if train.fetch is not None and source.decode is None else None,
    )


def _check_sizes(config, train, evals, split):
    if not evals.examples:  # a mean over nothing: NaN, said as if it were a number
        raise ConfigError(
            f"--dataset={config.dataset or tasks.default_dataset(config.task)}: the split "
            f"{split or config.eval_split} it evaluates holds no examples"
        )
    if train.examples < config.global_batch_size:
        raise ConfigError(
            f"--global_batch_size={config.global_batch_size}: larger than the "
            f"{train.examples} examples of --train_split={config.train_split}"
        )


def _check_task_memory(config, task):
    """The memory check again, now with the task's prepared input shape and its outputs."""
    input_spec = task.spec.get(task.input)
    try:
        outputs = task.outputs
    except NotImplementedError:  # a task that builds its own models
        outputs = None
    check_memory(config, tuple(input_spec.shape) if input_spec else None, outputs)


def _through_service(config, ds, ctx, stream, start_batch):
    if not config.tf_data_service:
        return ds
    # The service's workers build the batches; each is built once (dynamic sharding), but they
    # arrive in the order the service's workers finish them, not always the stream's.
    return ds.apply(
        tf.data.experimental.service.distribute(
            processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
            service=config.tf_data_service,
            job_name=f"train-{ctx.input_pipeline_id}-{stream}-{start_batch}",
        )
    )


def load_source(config, features, split=None):
    """The Source `config.dataset` names, keeping `features` (all when empty); its eval split is `split`, else
    --eval_split."""
    name = config.dataset or tasks.default_dataset(config.task)
    kind = name.partition(":")[0]  # KIND:ARGUMENT, e.g. npz:PATH, is engine/sources/KIND.py's to read
    if kind in sources.available():
        source = importlib.import_module(f"engine.sources.{kind}").load(config, split or config.eval_split)
    else:
        source = _tfds(config, name, features, split or config.eval_split)
    missing = [f for f in features if f not in source.spec]
    if missing:
        raise ConfigError(
            f"--dataset={name}: --task={config.task} needs the features {', '.join(features)} "
            f"(it has {', '.join(source.spec)})"
        )
    for feature, spec in source.spec.items():
        if not spec.shape.is_fully_defined():
            raise ConfigError(f"--dataset={name}: {feature} has no fixed shape ({spec.shape})")
    return source


def _tensorflow_datasets():
    """tensorflow_datasets, with the bundled `digits` builder registered. Imported by the first run that reads one
    of its datasets: the other sources (engine/sources/) do not pay for importing it."""
    import tensorflow_datasets as tfds  # noqa: PLC0415

    import engine.digits  # noqa: F401, PLC0415  (registers the bundled `digits` builder with tfds)

    return tfds


def _tfds(config, name, features, eval_split):
    tfds = _tensorflow_datasets()
    builder = _prepared_builder(config, name)
    info = builder.info
    keep = list(features or info.features.keys())
    absent = [f for f in keep if f not in info.features]
    if absent:
        raise ConfigError(
            f"--dataset={name}: --task={config.task} needs the features {', '.join(keep)} "
            f"(it has {', '.join(info.features.keys())})"
        )
    encoded, decoders, spec, decode = _decoding(config, info, keep)
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
                f"--{flag}={split}: not a split of {name} (splits: {', '.join(info.splits.keys())}; {e})"
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


def _decoding(config, info, keep):
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
    from engine import images  # noqa: PLC0415  (only runs that read photos need it)

    steps = [images.decoder(config, f) for f in encoded]

    def decode(example, seed, training):
        for one in steps:
            example = one(example, seed, training)
        return example

    spec.update({f: tf.TensorSpec([config.image_size, config.image_size, 3], tf.uint8) for f in encoded})
    return encoded, decoders, spec, decode


def _prepared_builder(config, name):
    tfds = _tensorflow_datasets()
    data_dir = os.path.expanduser(config.data_dir) if config.data_dir else None
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # tfds raises several kinds for names and configs it cannot resolve
        raise ConfigError(f"--dataset={name}: {first_line(e)}") from None
    # What builder.is_prepared() reads, without its warning about the folder it expected.
    if not tf.io.gfile.exists(os.path.join(builder.data_dir, tfds.core.constants.DATASET_INFO_FILENAME)):
        _check_reachable(config, builder)
    with _prepare_lock(builder.data_dir):
        try:
            builder.download_and_prepare()
        except Exception as e:  # network, disk and checksum failures all end here
            raise ConfigError(
                f"--dataset={config.dataset}: could not download and prepare it into "
                f"{builder.data_dir} ({first_line(e)}); without a network, put a prepared "
                "copy under --data_dir"
            ) from None
    return builder


def _check_reachable(config, builder):
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
            where = config.data_dir or _tensorflow_datasets().core.constants.DATA_DIR
            raise ConfigError(
                f"--dataset={config.dataset}: not prepared in --data_dir={where} ({builder.data_dir}) and the "
                f"network is unreachable ({'proxy ' if is_proxy else ''}{host}:{port}: {e.strerror or e}); prepare "
                "it on a machine with a network and copy it there"
            ) from None


@contextlib.contextmanager
def _prepare_lock(directory):
    # Workers of one job on one machine (or sharing a POSIX file system) prepare a dataset once.
    if "://" in directory:
        yield
        return
    parent = os.path.dirname(directory.rstrip("/"))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--data_dir={parent}: cannot create it ({e.strerror})") from None
    with open(os.path.join(parent, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
