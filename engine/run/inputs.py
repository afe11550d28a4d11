"""A run's inputs: its source and task with their prepared Data, as the run builds them (what evaluation, research,
tests and a fork's reference read without building a run), and how its steps get their training batches: one
interface, four paths.

`open(start)` gives what the traced inner loop reads from, from data position `start` on; `step` runs one replica
step inside that loop with its batch; `run` runs a round of the loop from the host. The paths: each replica
gathers its batch from the split held in memory (InStep); the dataset's own iterator on one CPU device
(DatasetIterator); the strategy's distributed iterator (Distributed); one dataset per worker, the round scheduled on
the workers in pieces (PerWorker, parameter servers).
"""

import contextlib
import os
import re
import sys
import threading
import time

import tensorflow as tf

from engine.cluster import distribute
from engine.data import datasets
from engine.data.pipeline import UNDECODABLE
from engine.data.records import unreadable
from engine.settings.errors import CheckpointError


def release(iterators):
    """Deletes the tf.data iterators in the list `iterators` on a thread of its own, where the list held their last
    references (after an error the traceback may hold one: it is deleted where the error ends). Deleting an
    autotuned iterator waits for its tuning thread to wake (TensorFlow 2.21: a sleep that doubles towards 60 s as
    the iterator lives; measured 0 to 51 s, bench/RESULTS.md "Deleting a tf.data iterator waits for its
    autotuner"; the strategy's distributed iterators block the longest, and one CPU device no longer uses them),
    with the GIL released: the run goes on meanwhile. Not a daemon: the interpreter waits for it
    before exiting (a daemon thread still in TensorFlow's destructor when the interpreter finalized aborted the
    process)."""
    if sys.is_finalizing():  # a thread started now never runs (Python 3.11), and start() waits for it forever
        iterators.clear()  # (a training_batches generator left open at a script's end is closed here)
        return
    try:
        threading.Thread(target=iterators.clear, name="release_iterators").start()
    except RuntimeError:  # the interpreter is shutting down: no new thread
        iterators.clear()


@contextlib.contextmanager
def releasing(iterators):
    """`iterators`, a list holding tf.data iterators, released (`release`) when the block ends, an error included."""
    try:
        yield iterators
    finally:
        release(iterators)


def batches(dataset):
    """The batches of a finite `dataset`, iterated in Python; its iterator deleted off this thread at the end."""
    with releasing([iter(dataset)]) as iterators:
        yield from iterators[0]


def source_and_task(config, split=None):
    """The source `config.dataset` names, keeping the features its task reads (its evaluation split `split`, else
    --eval_split), and the task built from what the source gives: its examples' spec and its info."""
    source = datasets.load_source(config, datasets.task_class(config).features, split)
    return source, task_of(config, source.spec, source.info)


def task_of(config, spec, info):
    """The run's task (tasks/<config.task>.py's Task) built from what its source gives: one example's spec and the
    source's info."""
    return datasets.task_class(config)(config.plugin("task", config.task), spec, info)


def run_data(config, split=None):
    """The Data of the run `config` describes, its source and task built as a run builds them: what evaluation,
    research and tests read without building a run. Its `task` is the task it was prepared for."""
    source, task = source_and_task(config, split)
    return datasets.prepare(config.data, source, task, split, config.tf_data_service)


def training_batches(config, start=0):
    """The global batches the run `config` describes trains on, in order from batch `start` (each a dict of prepared
    tensors with `index`, the examples' positions in the training stream), as one device reads them: what a fork
    holds its step against. A step of an update that reads a fresh batch per repetition takes several in turn."""
    return batches(run_data(config).train_fn(tf.distribute.InputContext(), start))


def examples(config):
    """examples(split): the prepared batches of `split`, each example once (weight 0 marks padding), on this host:
    one pass of a generator (its tf.data iterator deleted off this thread at the end, release).
    What a task's probe reads (Task.probe)."""
    return lambda split: batches(run_data(config, split).eval_fn(tf.distribute.InputContext()))


def gathers_in_step(placement, data, coordinator, service):
    """Whether each replica gathers its batch inside the step, from the training split held in memory, instead of
    reading it from a tf.data pipeline: one CPU replica per worker (one device, or multi-worker), a split iterators in
    memory without a per-example decode. The pipeline's hand-over costs the step more than the gather
    (bench/RESULTS.md). Not on accelerators, where the pipeline prefetches to the device and the split would have
    to be copied there first; not with parameter servers (each worker its own stream) or a tf.data service (its
    workers build the batches); not for several replicas in one process (mirrored), where the gathered steps
    drifted from one device more than the pipeline's in the ResNet parity case, though every batch was identical
    (bench/RESULTS.md). `placement`: the run's engine/cluster/distribute.py Placement; `service`: --tf_data_service."""
    return (
        data.gather is not None
        and coordinator is None
        and not service
        and placement.replicas == placement.workers
        and placement.device == "CPU"
    )


def path(placement, data, counter=None, coordinator=None, service="", in_step=None):
    """The path a run's steps read their batches by: gathered in the step (where gathers_in_step, or `in_step`
    says), a parameter server's per-worker datasets (`coordinator`), the dataset's own iterator on one CPU device,
    else the strategy's distributed iterator. `placement`: the run's engine/cluster/distribute.py Placement;
    `counter`: an int64 variable counting the record bytes read; `service`: --tf_data_service."""
    if in_step is None:
        in_step = gathers_in_step(placement, data, coordinator, service)
    if in_step:
        return InStep(placement, data, counter)
    if coordinator is not None:
        return PerWorker(placement, data, counter, coordinator, service)
    cls = DatasetIterator if one_cpu_device(placement.strategy) else Distributed
    return cls(placement, data, counter)


@tf.autograph.experimental.do_not_convert
def first_replica(strategy, values):
    """The first local replica's copy of each of `values` (identical on every replica where the step all-reduced)."""
    return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], values)


def one_cpu_device(strategy):
    """Whether `strategy` is one CPU device, where the dataset's own iterator serves the steps and the evaluation:
    the strategy's distributed iterator adds a hop of host time per batch there, on the cores the step needs, and
    its deletion blocks for seconds where the dataset's own does not (bench/RESULTS.md, 2026-12-04, third
    session)."""
    return isinstance(strategy, tf.distribute.OneDeviceStrategy) and "CPU" in strategy.extended.worker_devices[0]


class Distributed:
    """The strategy's distributed iterator over the training pipeline; the base of the other paths. `placement`: the
    run's engine/cluster/distribute.py Placement; `counter`: an int64 variable the pipeline adds the record bytes it
    reads to, or None."""

    label = "tf.data"  # what the run's first line says of its input

    def __init__(self, placement, data, counter=None):
        self.placement, self.strategy, self.data, self.counter = placement, placement.strategy, data, counter

    def open(self, start):
        return iter(
            self.strategy.distribute_datasets_from_function(
                lambda ctx: self.data.train_fn(ctx, start, counter=self.counter)
            )
        )

    def step(self, train_step, iterator, first_batch, i, timed, count=1):
        """`train_step` on every replica with the iterator's next batch (the next `count`, as a tuple, for a step that
        reads several); its first replica's outputs and "waited": seconds spent waiting for the batch (when
        `timed`)."""
        # The timestamps are ordered around the wait by hand: automatic control dependencies leave a timestamp
        # free to run anywhere.
        asked = tf.timestamp() if timed else tf.constant(0.0, tf.float64)
        waited = tf.constant(0.0, tf.float64)
        with tf.control_dependencies([asked] if timed else []):
            batch = next(iterator) if count == 1 else tuple(next(iterator) for _ in range(count))
        if timed:
            with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
                waited = tf.timestamp() - asked
        out = first_replica(self.strategy, self.strategy.run(train_step, args=(batch,)))
        return {**out, "waited": waited}

    def run(self, loop, iterator, steps, first_batch):
        """A round of `steps` in one call of the traced inner loop `loop(iterator, steps, first_batch)`."""
        return loop(iterator, tf.constant(steps), tf.constant(first_batch, tf.int64))


class DatasetIterator(Distributed):
    """One CPU device: the dataset's own iterator (one_cpu_device)."""

    def open(self, start):
        return iter(self.data.train_fn(tf.distribute.InputContext(), start, counter=self.counter))


class InStep(Distributed):
    """Each replica gathers its batch from the split held in memory (gathers_in_step): no iterator."""

    label = "in-step"

    def open(self, start):
        return None

    def step(self, train_step, iterator, first_batch, i, timed, count=1):
        if iterator is not None:  # batches handed over anyway (a test's, a benchmark's): read them
            return super().step(train_step, iterator, first_batch, i, timed, count)
        # The batch's index from the loop counter, not from the `batches` variable: nothing orders the gather
        # after the previous step, so it may run ahead of it.
        batch_index = first_batch + tf.cast(i, tf.int64) * count
        pipelines = self.placement.workers

        def gathered_step(batch_index):
            # One replica per worker (gathers_in_step): the replica's id is its worker's input pipeline.
            replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
            batches = tuple(self.data.gather(batch_index + k, replica, pipelines) for k in range(count))
            return train_step(batches[0] if count == 1 else batches)

        out = first_replica(self.strategy, self.strategy.run(gathered_step, args=(batch_index,)))
        return {**out, "waited": tf.constant(0.0, tf.float64)}


class PerWorker(Distributed):
    """Parameter servers: each worker reads its own stream; the chief schedules a round's steps on the workers."""

    def __init__(self, placement, data, counter, coordinator, service=""):
        super().__init__(placement, data, counter)
        self.coordinator, self.service = coordinator, service

    def open(self, start):
        strategy, data = self.strategy, self.data
        with strategy.scope():  # on a parameter server, shared by the workers
            streams = tf.Variable(0, dtype=tf.int64, trainable=False, name="streams")
            lock = tf.CriticalSection(name="streams")

        def per_worker():
            # Traced once, then run by each worker as it builds its dataset: the server's counter, incremented
            # under a lock, gives each worker (and a restarted one) its own stream 1, 2, ... With the tf.data
            # service all workers consume one shared job instead, which hands each batch to one of them.
            stream = 1 if self.service else lock.execute(lambda: tf.identity(streams.assign_add(1)))
            return strategy.distribute_datasets_from_function(
                lambda ctx: data.train_fn(ctx, self.stream_start(start), stream)
            )

        return iter(self.coordinator.create_per_worker_dataset(per_worker))

    def stream_start(self, start):
        """Where a worker's stream starts in a job resumed after `start` global batches: at its share of them (each
        worker reads a stream of its own); with the tf.data service, whose one job all workers share, at `start`."""
        return start if self.service else start // self.placement.scheduled

    def run(self, loop, iterator, steps, first_batch):
        """The round's steps as functions of a few steps each, scheduled on whichever worker is free (the
        coordinator reschedules a dead worker's share); the chief waits for all."""
        chunk = max(1, steps // (4 * self.placement.scheduled))
        sizes = [chunk] * (steps // chunk) + ([steps % chunk] if steps % chunk else [])
        tic = time.perf_counter()
        remote = [
            self.coordinator.schedule(loop, args=(iterator, tf.constant(n), tf.constant(0, tf.int64))) for n in sizes
        ]
        self.coordinator.join()
        seconds = time.perf_counter() - tic
        fetched = [r.fetch() for r in remote]
        extras = {k: v for k, v in fetched[-1].items() if isinstance(v, dict)}  # the last step's, an action asked for
        outs = [{k: float(v) for k, v in f.items() if not isinstance(v, dict)} for f in fetched]
        done = sum(o["steps"] for o in outs)
        finite = done - sum(o["skipped"] for o in outs)
        sums = {k: sum(o[k] for o in outs) for k in outs[0] if k.endswith("_sum")}
        return {
            **outs[-1],
            "steps": done,
            "skipped": done - finite,
            **{k[: -len("_sum")]: v / finite if finite else float("nan") for k, v in sums.items()},
            **sums,
            "floor_skipped": sum(o["floor_skipped"] for o in outs),
            "stop": max(o["stop"] for o in outs),  # any function that saw the flag: they ran in no set order
            "input_wait": waited_share(outs) * seconds,  # the workers' share, in seconds of the round's
            "busy": sum(o["busy"] for o in outs),
            **extras,
        }


def waited_share(outs):
    """The share of their time the steps of a parameter server's functions (`outs`: their numbers) waited for their
    batches: their waits over the time they ran. The functions run at once on the workers: their waits summed, over
    the round's wall time, came to more than the whole (an input_wait_fraction of 1.16 on two workers)."""
    busy = sum(o["busy"] for o in outs)
    return sum(o["input_wait"] for o in outs) / busy if busy else 0.0


# What a rerun does after a data error: a run that saved no checkpoint starts again (engine/state/workdir.py
# check_same_run), and may then correct its settings too.
RESUMES = "the run resumes from its last checkpoint (one that saved none starts again, its settings corrected too)"


def explain(error, config, strategy, data, training, pipelines):
    """An example the pipeline could not decode becomes DecodeError naming its file; a lost peer, PeerLost; any
    other error comes back as it is."""
    found = re.search(rf"{UNDECODABLE}\] \[(\d+)\] \[of stream\] \[(\d+)", error.message or "")
    if found:
        position, stream = int(found.group(1)), int(found.group(2))
        return datasets.DecodeError(
            f"{data.origin(position, stream, training, pipelines)}; fix or remove it and run the same "
            f"command: {RESUMES}"
        )
    damaged = unreadable(error)
    if damaged:
        return datasets.DecodeError(
            f"--dataset={config.dataset}: {damaged}; restore the file and run the same command: {RESUMES}"
        )
    cached = _unloaded(error, config.compile_cache) or _unwritten(error, config.compile_cache)
    return cached or distribute.explain_failure(strategy, config.cluster, error)


def _unloaded(error, cache):
    """CheckpointError naming --compile_cache=`cache` where `error` is TensorFlow's failing to load a compiled program
    read back from it (its entries set aside: the same command compiles them again); None for any other error."""
    from engine.run import compile_cache  # deferred: the public face (engine/api.py) loads this module, no cache

    if not cache:
        return None
    said = next((line for line in (error.message or "").splitlines() if compile_cache.unloadable(line)), None)
    if said is None:
        return None
    count = compile_cache.set_aside(cache, said)
    return CheckpointError(
        f"--compile_cache={cache}: TensorFlow could not load a compiled program read back from it ({said}): a "
        f"damaged entry; its {count} entries are set aside, and the same command compiles them again"
    )


def _unwritten(error, cache):
    """CheckpointError naming --compile_cache=`cache` where `error` is TensorFlow's failing to write a compiled
    program there (a full disk: "<its temporary file>; No space left on device"), that file removed; None for any
    other error. TensorFlow fails the op it compiled: the run stops at its first step, as at a full workdir."""
    from engine.run import compile_cache

    if not cache:
        return None
    folder = compile_cache.folder_of(cache)
    lines = (line.strip() for line in (error.message or "").splitlines())
    failed = next((found for line in lines if (found := re.fullmatch(rf"({re.escape(folder)}/\S+); (.+)", line))), None)
    if failed is None:
        return None
    with contextlib.suppress(OSError):
        os.remove(failed[1])  # a partial entry's temporary file, which TensorFlow never reads back
    return CheckpointError(
        f"--compile_cache={cache}: cannot write a compiled program there ({failed[2]}); free space there, or run "
        "without --compile_cache, and run the same command"
    )
