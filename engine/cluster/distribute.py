"""The tf.distribute strategy a run's cluster settings (config.cluster: the cluster wing reads no other) ask for,
and what the engine asks of it (chief, workers, a lost peer).

`create_strategy` must run before any other TensorFlow op in the process:
logical CPU devices and MultiWorkerMirroredStrategy both have to be set up
before the runtime starts. Who a cluster's tasks are is engine/cluster/resolvers.py's. `placement` works out once
the facts the rest of the engine reads of a strategy (its device, workers, chief), a Placement the run holds.
"""

import contextlib
import dataclasses
import logging
import os

import tensorflow as tf

from engine.cluster import resolvers as cluster
from engine.cluster.signals import SIGNALS
from engine.settings.environment import tf_config
from engine.settings.errors import ConfigError
from engine.settings.strategy import planned_strategy


def _setup_cpu_devices(count):
    if count > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:
            # The runtime already started (a notebook or a test made a strategy before): fine if it has enough.
            have = len(tf.config.list_logical_devices("CPU"))
            if have < count:
                raise ConfigError(
                    f"--num_cpu_devices={count}: TensorFlow already started with {have} CPU devices "
                    "in this process; set it before the first TensorFlow op"
                ) from None
    return [f"/cpu:{i}" for i in range(count)]


def strategy_name(settings):
    """The strategy a run's cluster settings (config.cluster) run with: engine/settings/checks.py's planned_strategy
    (what validate judged), completed with this machine's GPUs where only the devices decide."""
    planned = planned_strategy(settings)
    if planned:
        return planned
    return "mirrored" if len(tf.config.list_physical_devices("GPU")) > 1 else "one_device"


def create_strategy(settings):
    """Builds the tf.distribute.Strategy a run's cluster settings (config.cluster) ask for; raises ConfigError on a
    bad cluster."""
    tf_config()  # before any strategy: TensorFlow's resolvers read TF_CONFIG themselves
    cpus = _setup_cpu_devices(settings.num_cpu_devices)
    name = strategy_name(settings)
    gpus = [f"/gpu:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(gpus[0] if gpus else "/cpu:0")
    if name == "mirrored":
        if gpus:
            return tf.distribute.MirroredStrategy(gpus)
        # Logical CPU devices share one memory: summing on one device and copying back is far cheaper than the
        # default ring all-reduce (measured: bench/RESULTS.md, "Mirrored CPU devices reduce to one device").
        return tf.distribute.MirroredStrategy(cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())
    if name == "tpu":
        return cluster.tpu_strategy(settings)
    resolver = cluster.resolve(settings, name)
    with cluster.connect_deadline(settings, resolver), listening(resolver):
        if name == "parameter_server":
            strategy = tf.distribute.ParameterServerStrategy(resolver)
            cluster.watch_servers(resolver.cluster_spec(), settings.collective_timeout)
            return strategy
        cluster.detect_dead_peers(resolver.cluster_spec(), settings.collective_timeout)
        # RING works on every device type; NCCL is faster between GPUs. No timeout_seconds: TensorFlow
        # starts a thread per collective that sleeps for the whole timeout, so a long job runs out of
        # threads (measured: bench/RESULTS.md, "No collective timeout"); the heartbeat above finds a dead peer.
        implementation = tf.distribute.experimental.CommunicationImplementation
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=implementation.NCCL if gpus else implementation.RING
        )
        # Waits for every peer in native code that holds Python's lock (engine/cluster/signals.py says what a signal
        # does).
        return SIGNALS.interruptible(
            tf.distribute.MultiWorkerMirroredStrategy, cluster_resolver=resolver, communication_options=options
        )


@contextlib.contextmanager
def listening(resolver):
    """A task whose gRPC server cannot listen on its own address (another process holds the port: a TF_CONFIG that
    names a taken port, or another job's task) is refused in one line (ConfigError, exit 2), not TensorFlow's
    traceback ending `UnknownError: Could not start gRPC server`."""
    try:
        yield
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" not in (e.message or ""):
            raise
        job, index = resolver.task_type, resolver.task_id
        address = resolver.cluster_spec().task_address(job, index)
        raise ConfigError(
            f"{job} {index} could not listen on {address}, its address in the cluster (Could not start gRPC server): "
            f"is port {address.rpartition(':')[2]} in use by another process? Give this task a free port"
        ) from None


def cluster_resolver(settings):
    """The cluster of a multi-worker or parameter-server job (`settings`: config.cluster): from TF_CONFIG (the
    default), Slurm or Kubernetes."""
    return cluster.resolve(settings, strategy_name(settings))


def serve(settings):
    """A parameter-server job's worker or ps task (`settings`: config.cluster): serve the chief until the job ends.
    Returns False on the chief (and in any other strategy), which then trains."""
    if strategy_name(settings) != "parameter_server":
        return False
    resolver = cluster_resolver(settings)
    if resolver.task_type not in ("worker", "ps"):
        return False
    with listening(resolver):
        server = tf.distribute.Server(
            resolver.cluster_spec(),
            job_name=resolver.task_type,
            task_index=resolver.task_id,
            protocol=resolver.rpc_layer or "grpc",
            start=True,
        )
    print(f"{resolver.task_type} {resolver.task_id} serving the parameter-server job", flush=True)
    server.join()
    return True


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's steps execute, worked out once from its strategy (`placement`): the facts the memory check, the
    XLA choice, the input paths, the train program, the evaluator and the workdir read. What only the strategy
    itself can do (its scope, `run`, distributed datasets, naming a lost peer) they still ask of `strategy`."""

    strategy: object
    name: str  # the strategy the run asked for (strategy_name): one_device, mirrored, multi_worker, ...
    device: str  # TPU, GPU or CPU (device_kind)
    replicas: int  # replicas in sync: over every worker of a multi-worker job; a parameter server's, one worker's
    workers: int  # the processes that share each global batch (num_workers): 1 in one process, and with parameter
    # servers, whose workers each take whole batches
    multi_worker: bool  # several processes train (multi-worker mirrored, parameter servers)
    parameter_server: bool
    chief: bool  # the one task that writes files (is_chief)
    task: int  # this task's index in its job (task_id): 0 without a cluster
    scheduled: int = 0  # parameter servers: the workers the chief schedules steps on (scheduled_workers); 0 otherwise


def placement(strategy, name):
    """The Placement of a run on `strategy`; `name`: the strategy its config asks for (strategy_name)."""
    return Placement(
        strategy,
        name,
        device_kind(strategy),
        strategy.num_replicas_in_sync,
        num_workers(strategy),
        is_multi_worker(strategy),
        is_parameter_server(strategy),
        is_chief(strategy),
        task_id(strategy),
        scheduled_workers(strategy),
    )


def device_kind(strategy):
    """TPU, GPU or CPU: where the strategy's steps run (create_strategy puts them on every GPU there is)."""
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return "TPU"
    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"


def is_chief(strategy):
    """True on the one task that writes files (every task when there is no cluster)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type == "chief":
        return True
    return task_type in ("worker", None) and task_id == 0 and "chief" not in resolver.cluster_spec().jobs


def is_multi_worker(strategy):
    return isinstance(strategy, (tf.distribute.MultiWorkerMirroredStrategy, tf.distribute.ParameterServerStrategy))


def is_parameter_server(strategy):
    return isinstance(strategy, tf.distribute.ParameterServerStrategy)


def num_workers(strategy):
    """The processes that share each global batch: a multi-worker job's workers; 1 where the strategy holds no
    resolver (one process; parameter servers, whose strategy keeps its resolver to itself: scheduled_workers)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    # A multi-worker cluster's chief job (a TFJob's Chief replica) trains beside its workers, one input pipeline more:
    # counted as none, a chief and a worker recorded 1 pipeline for 2, and a streamed run resumed on 1 was not refused.
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("chief", ())) + len(spec.get("worker", ())))


def scheduled_workers(strategy):
    """A parameter-server job's workers, which the chief schedules steps on; 0 for other strategies. Read from the
    strategy's own resolver: its `cluster_resolver` (the extended strategy's) is None."""
    if not is_parameter_server(strategy):
        return 0
    return len(strategy._cluster_resolver.cluster_spec().as_dict().get("worker", ()))


def task_id(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    return (resolver.task_id or 0) if resolver is not None else 0


def check_same_step(placement, workdir, step):
    """Refuses (ConfigError, on every worker) a multi-worker job whose workers restored different steps: each read
    its own copy of the workdir (a node's own disk), and the job would train replicas that disagree, the chief
    logging and saving their numbers, until their collectives no longer matched. Nothing for one process or
    parameter servers, whose chief alone restores."""
    if not placement.multi_worker or placement.parameter_server:
        return
    steps = [int(s) for s in _steps_of_replicas(placement.strategy, tf.constant(step, tf.float64)).numpy()]
    other = next((s for s in steps if s != step), None)
    if other is not None:
        # Once more before leaving: a worker that has this second one has every worker's part of it, sent only once
        # each had the first. Without it the first to leave could close a socket another still read the steps from:
        # it stopped as a lost peer (exit 5), not on this line. Ours may fail as a peer leaves: it has the steps.
        try:
            _steps_of_replicas(placement.strategy, tf.constant(step, tf.float64))
        except tf.errors.OpError:
            pass
        raise ConfigError(
            f"--workdir={workdir}: this worker starts at step {step}, another worker of the job at step {other} (each "
            "restored what its workdir holds): every worker must read the same workdir, on storage they all see (a "
            "node's own disk gives each its own)"
        )


@tf.function
def _steps_of_replicas(strategy, step):
    """Every replica's `step`, in the order of their ids: each adds its own in its slot of one all-reduce."""

    def own_slot():
        context = tf.distribute.get_replica_context()
        slot = tf.one_hot(context.replica_id_in_sync_group, strategy.num_replicas_in_sync, dtype=tf.float64)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, slot * step)

    return strategy.experimental_local_results(strategy.run(own_slot))[0]


def explain_failure(strategy, settings, error):
    """A lost peer on a multi-worker job becomes PeerLost naming it (`settings`: config.cluster); other errors come
    back unchanged."""
    if not is_multi_worker(strategy) or not isinstance(error, cluster.LOST_PEER_ERRORS):
        return error
    # ParameterServerStrategy keeps its resolver to itself: its `cluster_resolver` (the extended strategy's) is None.
    return cluster.peer_lost(strategy.cluster_resolver or strategy._cluster_resolver, settings, error)


def lost_peer(settings, error):
    """PeerLost for an error of a cluster job's task that a lost peer raised outside the steps (a chief reading
    its parameter servers' variables), else None. `settings`: config.cluster."""
    if strategy_name(settings) not in ("multi_worker", "parameter_server") or not isinstance(
        error, cluster.LOST_PEER_ERRORS
    ):
        return None
    return cluster.peer_lost(cluster_resolver(settings), settings, error)


def coordinator(strategy):
    """The ClusterCoordinator of a parameter-server chief, its logs of failed remote functions left out: tens of lines
    of gRPC errors for each peer that dies, which the job says in one line (the chief's `error: lost ps 0 (...)`, the
    launcher's `worker 1 exited with -9; the job goes on without it`). A failure it cannot recover from is raised from
    the round, and reported as any other."""
    logging.getLogger("tensorflow").addFilter(COORDINATOR_LOGS)  # once: a filter already there is not added again
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


class _CoordinatorLogs(logging.Filter):
    def filter(self, record):
        return os.path.basename(record.pathname) != "cluster_coordinator.py"


COORDINATOR_LOGS = _CoordinatorLogs()  # on TensorFlow's logger once a parameter-server chief coordinates
