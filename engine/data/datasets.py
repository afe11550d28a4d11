"""Input pipelines: the bundled sources (sources/), your own files and any tensorflow-datasets name.

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

The streams are engine/data/pipeline.py's, the splits and their record files engine/data/records.py's (a source
imports what it uses of them from engine/api.py).
"""

import dataclasses
import math
import uuid

import tensorflow as tf

from engine.data import source_checks, tfds_source
from engine.data.pipeline import AUTOTUNE, Pipelines
from engine.settings import plugins
from engine.settings.errors import ConfigError, raising_task_errors
from engine.settings.fields import FIELD_BY_NAME


class DecodeError(ConfigError):
    """An example of the data could not be decoded; the message names its file."""


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
    task: object  # the tasks/<name>.py Task this data was prepared for (built by engine/run/inputs.py, received here)
    spec: dict  # {feature: tf.TensorSpec} of one prepared example
    train_bytes: int = 0  # record bytes of the training files, when sharded
    train_shards: tuple = ()  # the training split's record files with their records, ((path, records), ...)
    origin: object = None  # (position, training, pipelines) -> the file of an example, for a decode failure
    # (batch, pipeline, pipelines) -> input pipeline `pipeline`'s prepared share of global batch `batch` (tensors),
    # gathered from memory inside a step: what train_fn's batch would be. None: the split is not held in memory.
    gather: object = None
    # The order settings (--shuffle_buffer, --interleave_files) the training split does not read: a resume may change
    # them (engine/state/workdir.py check_same_run).
    unread: tuple = ()
    source_spec: dict = dataclasses.field(default_factory=dict)  # {feature: tf.TensorSpec} as the source gives one
    train_digest: object = None  # () -> a digest of the training split's examples, when held in memory (or None)

    @property
    def sharded(self):
        """Whether the training stream depends on the number of input pipelines: its record files are shared out."""
        return self.train_files > 0

    @property
    def train_files(self):
        """The training split's record files, when it streams them (sharded); 0 when it holds none."""
        return len(self.train_shards)


def task_class(config):
    """tasks/<config.task>.py's Task class: a run's inputs (engine/run/inputs.py source_and_task) read it here,
    before the source, whose features it names; this module never builds a task."""
    return plugins.member("task", config.task)


def prepare(data, source, task, split=None, service=""):
    """The Data of `source` for `task` (built from the source's spec and info), evaluating `split`, default
    --eval_split; `data`: the run's config.data. `service`: the tf.data service that builds the training batches
    (--tf_data_service), or none. Sets `task.spec` to the prepared example's spec."""
    train, evals = source.train, source.evals
    _check_sizes(data, train, evals, split)
    unread = _unread_order(data, train)
    eval_steps = math.ceil(evals.examples / data.per_eval_batch_size)

    prepared = _prepared(task)
    prepare_spec(task, source.spec)
    pipelines = Pipelines(data, source)

    def train_fn(ctx, start_batch=0, stream=0, counter=None):
        """Per-replica batches from global batch `start_batch` on. `stream` > 0 gives an independent order (each
        parameter-server worker reads its own)."""
        ds = pipelines.train(ctx, start_batch, stream, counter).map(prepared, num_parallel_calls=AUTOTUNE)
        return _through_service(service, ds, ctx, stream, start_batch).prefetch(AUTOTUNE)

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
        train_bytes=pipelines.train_bytes,
        train_shards=train.files,
        origin=pipelines.origin,
        gather=gather if train.fetch is not None and source.decode is None else None,
        unread=unread,
        source_spec=source.spec,
        train_digest=train.digest,
    )


def _prepared(task):
    """batch -> the batch after the task's `prepare`: the task sees its features; the engine's own (index, weight)
    pass around it."""

    def prepared(batch):
        own = {k: batch[k] for k in ("index", "weight") if k in batch}
        return {**task.prepare({k: v for k, v in batch.items() if k not in own}), **own}

    return prepared


def prepare_spec(task, spec):
    """Sets `task.spec` to the spec of one example after the task's `prepare`, from `spec`, the source's: traced on
    a batch of one's spec, not run (nothing the size of an example is made before the memory check, and a run
    rebuilt from what its config.json keeps of the source reads no data)."""
    one = {k: tf.TensorSpec([1, *s.shape], s.dtype) for k, s in spec.items()}
    with raising_task_errors():  # what the task's prepare refuses: one line
        traced = tf.function(_prepared(task)).get_concrete_function(one).structured_outputs
    task.spec = {k: tf.TensorSpec(t.shape[1:], t.dtype) for k, t in traced.items()}


def _unread_order(data, train):
    """The order settings the training split does not read, with a warning for each one given (not its default):
    one held in memory is a permutation by (seed, epoch); only record files interleave, and a stream without either
    shuffles in a buffer."""
    reads = {"shuffle_buffer": train.fetch is None, "interleave_files": bool(train.files)}
    unread = tuple(name for name, read in reads.items() if not read)
    for name in unread:
        value = getattr(data, name)
        if value != FIELD_BY_NAME[name].default:
            held = "held in memory, read in a permutation by (seed, epoch)" if train.fetch is not None else "one stream"
            print(
                f"warning: --{name}={value}: the training split of --dataset={data.dataset_name} is {held}: nothing "
                "reads it",
                flush=True,
            )
    return unread


def _check_sizes(data, train, evals, split):
    if not evals.examples:  # a mean over nothing: NaN, said as if it were a number
        split = split or data.eval_split
        raise ConfigError(f"--dataset={data.dataset_name}: the split {split} it evaluates holds no examples")
    if train.examples < data.global_batch_size:
        raise ConfigError(
            f"--global_batch_size={data.global_batch_size}: larger than the "
            f"{train.examples} examples of --train_split={data.train_split}"
        )


def _through_service(service, ds, ctx, stream, start_batch):
    if not service:
        return ds
    # The service's workers build the batches; each is built once (dynamic sharding), but they
    # arrive in the order the service's workers finish them, not always the stream's. The job's name is this
    # pipeline's alone: a dispatcher serves a named job to every client that names it, whatever dataset it sends,
    # so a name another run (or this run before its restart) used would read that run's batches from where it
    # stopped, of its dataset.
    return ds.apply(
        tf.data.experimental.service.distribute(
            processing_mode=tf.data.experimental.service.ShardingPolicy.DYNAMIC,
            service=service,
            job_name=f"train-{ctx.input_pipeline_id}-{stream}-{start_batch}-{uuid.uuid4().hex}",
        )
    )


def load_source(config, features, split=None):
    """The Source `config.dataset` names, keeping `features` (all when empty); its eval split is `split`, else
    --eval_split."""
    name = config.dataset_name
    kind = name.partition(":")[0]  # KIND:ARGUMENT, e.g. npz:PATH, is sources/KIND.py's to read
    if kind in plugins.names("dataset"):
        load = plugins.member("dataset", kind)
        handed = config.plugin("dataset", kind)
        source = source_checks.loaded(load, plugins.file("dataset", kind), handed, split or config.eval_split)
    else:
        source = tfds_source.load(config, name, features, split or config.eval_split)
        source = source_checks.checked(source, "engine/data/tfds_source.py", name)
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
