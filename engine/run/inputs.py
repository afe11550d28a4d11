"""How a run's steps get their training batches: one interface, four paths.

`open(start)` gives what the traced inner loop reads from, from data position `start` on; `step` runs one replica
step inside that loop with its batch; `run` runs a round of the loop from the host. The paths: each replica
gathers its batch from the split held in memory (InStep); the dataset's own iterator on one CPU device
(DatasetIterator); the strategy's distributed iterator (Distributed); one dataset per worker, the round scheduled on
the workers in pieces (PerWorker, parameter servers).
"""

import contextlib
import threading

import tensorflow as tf

from engine.cluster import distribute
from engine.run import xla
from engine.settings import sections


def release(held):
    """Deletes the tf.data iterators in the list `held` on a thread of its own, where the list held their last
    references (after an error the traceback may hold one: it is deleted where the error ends). Deleting an
    autotuned iterator waits for its tuning thread to wake (TensorFlow 2.21: a sleep that doubles towards 60 s as
    the iterator lives; measured 0 to 51 s, bench/RESULTS.md "Deleting a tf.data iterator waits for its
    autotuner"; the strategy's distributed iterators block the longest, and one CPU device no longer uses them),
    with the GIL released: the run goes on meanwhile. Not a daemon: the interpreter waits for it
    before exiting (a daemon thread still in TensorFlow's destructor when the interpreter finalized aborted the
    process)."""
    try:
        threading.Thread(target=held.clear, name="release_iterators").start()
    except RuntimeError:  # the interpreter is shutting down: no new thread
        held.clear()


@contextlib.contextmanager
def releasing(held):
    """`held`, a list holding tf.data iterators, released (`release`) when the block ends, an error included."""
    try:
        yield held
    finally:
        release(held)


def batches(dataset):
    """The batches of a finite `dataset`, iterated in Python; its iterator deleted off this thread at the end."""
    with releasing([iter(dataset)]) as held:
        yield from held[0]


def gathers_in_step(cluster, strategy, data, coordinator):
    """Whether each replica gathers its batch inside the step, from the training split held in memory, instead of
    reading it from a tf.data pipeline: one CPU replica per worker (one device, or multi-worker), a split held in
    memory without a per-example decode. The pipeline's hand-over costs the step more than the gather
    (bench/RESULTS.md). Not on accelerators, where the pipeline prefetches to the device and the split would have
    to be copied there first; not with parameter servers (each worker its own stream) or a tf.data service (its
    workers build the batches); not for several replicas in one process (mirrored), where the gathered steps
    drifted from one device more than the pipeline's in the ResNet parity case, though every batch was identical
    (bench/RESULTS.md). `cluster`: the run's config.cluster."""
    return (
        data.gather is not None
        and coordinator is None
        and not sections.section(cluster, "cluster").tf_data_service
        and strategy.num_replicas_in_sync == distribute.num_workers(strategy)
        and xla.device_kind(strategy) == "CPU"
    )


def train_input(trainer):
    """The path `trainer`'s steps read their batches by: chosen when asked, from its `in_step` and strategy."""
    if trainer.in_step:
        return InStep(trainer)
    if trainer.coordinator is not None:
        return PerWorker(trainer)
    return DatasetIterator(trainer) if one_cpu_device(trainer.strategy) else Distributed(trainer)


def one_cpu_device(strategy):
    """Whether `strategy` is one CPU device, where the dataset's own iterator serves the steps and the evaluation:
    the strategy's distributed iterator adds a hop of host time per batch there, on the cores the step needs, and
    its deletion blocks for seconds where the dataset's own does not (bench/RESULTS.md, 2026-12-04, third
    session)."""
    return isinstance(strategy, tf.distribute.OneDeviceStrategy) and "CPU" in strategy.extended.worker_devices[0]


def eval_iterator(trainer):
    """An iterator over `trainer`'s evaluation batches: the dataset's own on one CPU device, else the strategy's."""
    if one_cpu_device(trainer.strategy):
        return iter(trainer.data.eval_fn(tf.distribute.InputContext()))
    return iter(trainer.eval_dataset)


class Distributed:
    """The strategy's distributed iterator over the training pipeline; the base of the other paths."""

    label = "tf.data"  # what the run's first line says of its input

    def __init__(self, trainer):
        self.trainer = trainer

    def counter(self):
        # The byte count stays on this host: a tf.data service ships the pipeline's graph, without variables.
        return None if self.trainer.config.tf_data_service else self.trainer.bytes_read

    def open(self, start):
        t, counter = self.trainer, self.counter()
        return iter(
            t.strategy.distribute_datasets_from_function(lambda ctx: t.data.train_fn(ctx, start, counter=counter))
        )

    def step(self, iterator, first_batch, i, timed):
        """One replica step on the iterator's next batch; "waited": seconds spent waiting for it (when `timed`)."""
        t = self.trainer
        # The timestamps are ordered around the wait by hand: automatic control dependencies leave a timestamp
        # free to run anywhere.
        asked = tf.timestamp() if timed else tf.constant(0.0, tf.float64)
        waited = tf.constant(0.0, tf.float64)
        with tf.control_dependencies([asked] if timed else []):
            batch = next(iterator)
        if timed:
            with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
                waited = tf.timestamp() - asked
        out = t.first_replica(t.strategy.run(t.train_step, args=(batch,)))
        return {**out, "waited": waited}

    def run(self, iterator, steps, first_batch):
        """A round of `steps` in one call of the traced inner loop."""
        t = self.trainer
        out = t.train_loop(iterator, tf.constant(steps), tf.constant(first_batch, tf.int64))
        t.check_retrace("train_loop", t.train_loop)
        return out


class DatasetIterator(Distributed):
    """One CPU device: the dataset's own iterator (one_cpu_device)."""

    def open(self, start):
        return iter(self.trainer.data.train_fn(tf.distribute.InputContext(), start, counter=self.counter()))


class InStep(Distributed):
    """Each replica gathers its batch from the split held in memory (gathers_in_step): no iterator."""

    label = "in-step"

    def open(self, start):
        return None

    def step(self, iterator, first_batch, i, timed):
        if iterator is not None:  # batches handed over anyway (a test's, a benchmark's): read them
            return super().step(iterator, first_batch, i, timed)
        t = self.trainer
        # The batch's index from the loop counter, not from the `batches` variable: nothing orders the gather
        # after the previous step, so it may run ahead of it.
        batch_index = first_batch + tf.cast(i, tf.int64)
        out = t.first_replica(t.strategy.run(self._gathered_step, args=(batch_index,)))
        return {**out, "waited": tf.constant(0.0, tf.float64)}

    def _gathered_step(self, batch_index):
        t = self.trainer
        # One replica per worker (gathers_in_step): the replica's id is its worker's input pipeline.
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
        return t.train_step(t.data.gather(batch_index, replica, t.pipelines))


class PerWorker(Distributed):
    """Parameter servers: each worker reads its own stream; the chief schedules a round's steps on the workers."""

    def open(self, start):
        t = self.trainer
        with t.strategy.scope():  # on a parameter server, shared by the workers
            streams = tf.Variable(0, dtype=tf.int64, trainable=False, name="streams")
            lock = tf.CriticalSection(name="streams")

        def per_worker():
            # Traced once, then run by each worker as it builds its dataset: the server's counter, incremented
            # under a lock, gives each worker (and a restarted one) its own stream 1, 2, ... With the tf.data
            # service all workers consume one shared job instead, which hands each batch to one of them.
            stream = 1 if t.config.tf_data_service else lock.execute(lambda: tf.identity(streams.assign_add(1)))
            return t.strategy.distribute_datasets_from_function(
                lambda ctx: t.data.train_fn(ctx, start // distribute.num_workers(t.strategy), stream)
            )

        return iter(t.coordinator.create_per_worker_dataset(per_worker))

    def run(self, iterator, steps, first_batch):
        """The round's steps as functions of a few steps each, scheduled on whichever worker is free (the
        coordinator reschedules a dead worker's share); the chief waits for all."""
        t = self.trainer
        chunk = max(1, steps // (4 * distribute.num_workers(t.strategy)))
        sizes = [chunk] * (steps // chunk) + ([steps % chunk] if steps % chunk else [])
        remote = [
            t.coordinator.schedule(t.train_loop, args=(iterator, tf.constant(n), tf.constant(0, tf.int64)))
            for n in sizes
        ]
        t.coordinator.join()
        outs = [{k: float(v) for k, v in r.fetch().items()} for r in remote]
        done = sum(o["steps"] for o in outs)
        finite = done - sum(o["skipped"] for o in outs)
        sums = {k: sum(o[k] for o in outs) for k in outs[0] if k.endswith("loss_sum")}
        return {
            **outs[-1],
            "steps": done,
            "skipped": done - finite,
            **{k[: -len("_sum")]: v / finite if finite else float("nan") for k, v in sums.items()},
            **sums,
            "floor_skipped": sum(o["floor_skipped"] for o in outs),
            "stop": max(o["stop"] for o in outs),  # any function that saw the flag: they ran in no set order
            "input_wait": sum(o["input_wait"] for o in outs),
        }
