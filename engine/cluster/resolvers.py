"""The tasks of a cluster job: who they are (TF_CONFIG, a TPU; Slurm's and Kubernetes' in
engine/cluster/schedulers.py) and what a task does when one of them stops answering (the connect deadline, the
dead-peer heartbeat, the parameter-server watch).

engine/cluster/distribute.py builds the strategy from what this module resolves; this module knows no strategy, only
its name, so that the two do not import each other.
"""

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import tensorflow as tf

from engine.cluster.schedulers import kubernetes_cluster, slurm_cluster
from engine.cluster.signals import LOST_PEER_EXIT_CODE
from engine.settings.config import first_line
from engine.settings.environment import tf_config
from engine.settings.errors import ConfigError
from engine.settings.strategy import data_service_address


def resolve(settings, strategy):
    """The cluster of a multi-worker or parameter-server job (`strategy`, the name the job runs with): from
    TF_CONFIG (the default), Slurm or Kubernetes. `settings`: the run's config.cluster, as every function here."""
    source = settings.cluster_resolver or "tf_config"
    if source == "slurm":
        return slurm_cluster(settings, strategy)
    if source == "kubernetes":
        return kubernetes_cluster(settings)
    if source == "tpu":
        raise ConfigError(
            f"--cluster_resolver=tpu: use --strategy=tpu (with --strategy={strategy} the "
            "cluster comes from tf_config, slurm or kubernetes)"
        )
    parsed = tf_config()
    if parsed is None:
        raise ConfigError(
            f"TF_CONFIG is not set: --strategy={strategy} reads the cluster from it "
            '(e.g. {"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}})'
        )
    cluster = parsed["cluster"]
    if strategy == "parameter_server" and not all(job in cluster for job in ("chief", "worker", "ps")):
        raise ConfigError(
            f"TF_CONFIG={os.environ['TF_CONFIG']!r}: --strategy=parameter_server needs 'chief', 'worker' and 'ps' jobs"
        )
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def tpu_strategy(settings):
    """The TPU start-up sequence: resolve, connect, initialize the TPU system, then the strategy. A failure is one
    line naming the stage it failed in."""
    stage = ["resolve"]

    def start():
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=settings.tpu)
        stage[0] = "connect"
        # Its master device is entered as the default below, in this thread: a device scope is the thread's own.
        tf.config.experimental_connect_to_cluster(resolver, make_master_device_default=False)
        stage[0] = "initialize"
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return resolver

    doing = {"resolve": "resolving it", "connect": "connecting to it", "initialize": "initializing its TPU system"}
    try:
        resolver = _within_connect_timeout(settings, start)
    except TimeoutError:  # the stage it waited in: a TPU held by another job can hang while initializing
        raise ConfigError(
            f"--tpu={settings.tpu}: no TPU reachable (no answer within --connect_timeout={settings.connect_timeout:g}s "
            f"while {doing[stage[0]]})"
        ) from None
    # OSError: off Google Cloud, a TPU name is looked up on a metadata server that is not there (URLError).
    except (ValueError, OSError, RuntimeError, tf.errors.OpError) as e:
        reason = getattr(e, "reason", None) or first_line(e).split(". ")[0]
        if stage[0] == "resolve":
            raise ConfigError(f"--tpu={settings.tpu}: no TPU reachable ({reason})") from None
        if settings.tpu == "local" and not tf.config.list_physical_devices("TPU"):  # TensorFlow: "TPUs not found"
            raise ConfigError(
                "--tpu=local: this machine has no TPU ('local' is a TPU VM's own); elsewhere give a TPU's name or "
                "grpc://IP:8470"
            ) from None
        raise ConfigError(f"--tpu={settings.tpu}: the TPU failed while {doing[stage[0]]} ({reason})") from None
    enter_master_device(resolver)
    return tf.distribute.TPUStrategy(resolver)


def enter_master_device(resolver):
    """Makes the resolver's master task (a remote TPU's host) the default device of this thread's ops, as
    experimental_connect_to_cluster does in the thread that calls it; nothing for a TPU VM's own (local) master."""
    master, spec = resolver.master(), resolver.cluster_spec()
    if master in ("", "local"):  # what experimental_connect_to_cluster leaves alone
        return
    for job in spec.jobs:
        for task in spec.task_indices(job):
            address = spec.task_address(job, task)
            if master in address or address in master:
                tf.device(f"/job:{job}/replica:0/task:{task}").__enter__()  # for the rest of the process
                return


def _within_connect_timeout(settings, start):
    """Returns start(), run in a thread because TensorFlow can wait for an unreachable host forever, with no
    way to interrupt it (it lets go of Python's lock meanwhile, so a signal still reaches the preemption
    watcher). Raises TimeoutError after --connect_timeout."""
    outcome = {}

    def run():
        try:
            outcome["value"] = start()
        except BaseException as e:  # noqa: BLE001  (raised again in the calling thread)
            outcome["error"] = e

    thread = threading.Thread(target=run, name="connect", daemon=True)
    thread.start()
    thread.join(settings.connect_timeout)
    if "error" in outcome:
        raise outcome["error"]
    if "value" in outcome:
        return outcome["value"]
    raise TimeoutError


# Runs beside a process that is forming a cluster. TensorFlow waits for peers inside native code that
# holds the GIL, where neither a Python thread nor a signal handler can run; this separate process can.
_WATCHDOG = """
import os, signal, socket, sys
parent, seconds, peers = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
import select
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if ready:
    sys.exit(0)  # the parent formed the cluster and closed our stdin
def answers(address):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()  # [::1]: its brackets off
        return True
    except OSError:
        return False
silent = [p for p in peers if not answers(p.split("=", 1)[1])]
why = ("no answer from " + ", ".join(p.replace("=", " (") + ")" for p in silent)) if silent else (
    "every peer answered but the cluster did not form: do all tasks' TF_CONFIG list the same cluster?")
print(f"error: could not form the cluster within --connect_timeout={seconds:g}s: {why}", file=sys.stderr, flush=True)
os.kill(parent, signal.SIGUSR1)  # the parent's handler exits with the signal's number (connect_deadline)
"""

# A cluster that did not form exits with this code, its own: SIGKILL's 137 reads as an out-of-memory kill.
NOT_FORMED_EXIT_CODE = int(signal.SIGUSR1)


class connect_deadline:
    """Ends this process with a clear message if the cluster has not formed after --connect_timeout seconds."""

    def __init__(self, settings, resolver):
        spec = resolver.cluster_spec().as_dict()
        me = (resolver.task_type, resolver.task_id)
        peers = [
            f"{job} {i}={address}"
            for job, addresses in spec.items()
            for i, address in enumerate(addresses)
            if (job, i) != me
        ]
        self.command = [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(settings.connect_timeout), *peers]

    def __enter__(self):
        self.previous = _exits_on(NOT_FORMED_EXIT_CODE)
        self.watchdog = subprocess.Popen(self.command, stdin=subprocess.PIPE)

    def __exit__(self, *exc):
        self.watchdog.stdin.close()
        self.watchdog.wait()  # before the handler goes: a watchdog that timed out as the cluster formed still ends it
        _LIBC.signal(NOT_FORMED_EXIT_CODE, self.previous)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.signal.restype = ctypes.c_void_p
_LIBC.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _exits_on(number):
    """Makes signal `number` end this process with the signal's number as its exit code, even inside native code that
    holds Python's lock (where TensorFlow waits for its peers, and no Python handler runs): libc's _exit is its
    handler. Returns the handler it replaced."""
    return _LIBC.signal(number, ctypes.cast(_LIBC._exit, ctypes.c_void_p))


def detect_dead_peers(cluster_spec, seconds):
    """Sets the heartbeat timeout of TensorFlow's coordination service, which fails every task's pending
    collectives once a peer has been silent that long. MultiWorkerMirroredStrategy starts the service with
    the same leader and jobs, but with a fixed 10 s timeout, unless it is configured before."""
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=int(seconds * 1000),
    )
    for job in ("chief", "worker"):
        if job in cluster_spec.jobs:
            context.context().coordination_service.coordinated_job_list.add(
                name=job, num_tasks=cluster_spec.num_tasks(job)
            )


# A gRPC server answers a client's HTTP/2 connection preface with its own SETTINGS frame, from its own threads: a
# process that is stopped (SIGSTOP, a debugger) or a host cut off sends nothing, though its port may still accept.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # and an empty SETTINGS
_PROBE_INTERVAL = 1.0  # seconds between rounds of probes


def reach_data_service(settings):
    """Waits up to --connect_timeout for the tf.data service's dispatcher (--tf_data_service; `settings`: the run's
    config.cluster) to accept a connection, as a job's tasks may start before it: TensorFlow would wait for one that
    never comes forever. ConfigError naming the flag when none answered."""
    host, port = data_service_address(settings.tf_data_service)
    deadline = time.monotonic() + settings.connect_timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(3.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"--tf_data_service={settings.tf_data_service}: no dispatcher answered at {host}:{port} within "
                    f"--connect_timeout={settings.connect_timeout:g}s ({e.strerror or e})"
                ) from None
        time.sleep(min(_PROBE_INTERVAL, max(0.0, deadline - time.monotonic())))


# The parameter-server chief's watch, a process beside it: the chief waits for its peers inside native calls that
# hold Python's lock (TensorFlow removing the save function each checkpoint retraces, from every task of the cluster,
# waits there for a stopped worker), where a thread of the chief's could not run. It ends with its parent's stdin.
_SERVER_WATCH = """
import os, select, signal, socket, sys
parent, seconds, interval = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
preface = bytes.fromhex(sys.argv[4])
peers = [p.split("=", 1) for p in sys.argv[5:]]
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the chief's to handle
def silent(address):  # sends nothing within the timeout: refusing or closing the connection is an answer
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds) as connection:
            connection.sendall(preface)
            connection.recv(1)
    except TimeoutError:
        return True
    except OSError:
        pass
    return False
while not select.select([sys.stdin], [], [], interval)[0]:  # until the chief ends, closing our stdin
    for name, address in peers:
        if silent(address):
            print(
                f"error: lost {name}: no answer within --collective_timeout={seconds:g}s (a stopped process or a "
                "host cut off); a peer that dies or is silent that long stops the job; restart every task of the job "
                "to resume from the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os.kill(parent, signal.SIGTRAP)  # the parent's handler exits with the signal's number, 5 (watch_servers)
            sys.exit(0)
"""

# Its signal: libc's _exit is the chief's handler, called with the signal's number, the lost-peer exit code.
LOST_PEER_SIGNAL = signal.SIGTRAP
assert int(LOST_PEER_SIGNAL) == LOST_PEER_EXIT_CODE

_watches = []  # the chief's watch processes, whose stdin it holds open while it lives


def watch_servers(cluster_spec, seconds):
    """A parameter-server chief: a process beside it that ends it (exit 5) naming a parameter server or worker
    that has answered nothing for `seconds`. A hung task fails no RPC, so without this the chief waits for it
    forever. A task that is gone is left to TensorFlow: a lost server fails the step, a lost worker's share moves
    to the others."""
    spec = cluster_spec.as_dict()
    peers = [
        f"{job} {i} ({address})={address}" for job in ("ps", "worker") for i, address in enumerate(spec.get(job, []))
    ]
    _exits_on(int(LOST_PEER_SIGNAL))
    sys.stdout.flush()
    command = [sys.executable, "-c", _SERVER_WATCH, str(os.getpid()), f"{seconds:g}", f"{_PROBE_INTERVAL:g}"]
    command += [_HTTP2_PREFACE.hex(), *peers]
    _watches.append(subprocess.Popen(command, stdin=subprocess.PIPE))


class PeerLost(RuntimeError):
    """A multi-worker peer died or stopped answering; restarting every worker resumes the job."""


# What TensorFlow raises on a task whose peer is gone or silent.
LOST_PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.InternalError,
)


def peer_lost(resolver, settings, error):
    """PeerLost naming the peer that TensorFlow's `error` names (the first task other than this one)."""
    text = getattr(error, "message", str(error))
    cluster = resolver.cluster_spec().as_dict()
    lost = [
        m
        for m in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", text)
        if m != (resolver.task_type, str(resolver.task_id))
    ]
    if lost:
        job, index = lost[0]
        peer = f"{job} {index} ({cluster.get(job, ['?'] * (int(index) + 1))[int(index)]})"
    else:
        peer = "a peer (not named by TensorFlow)"
    # An error inside a tf.function starts "Graph execution error:", then the Python stack of the failing op.
    # Several errors at once ("2 root error(s) found.") list theirs as "  (0) UNAVAILABLE: ...": the first one's.
    lines = [line for line in text.splitlines() if line.strip() and not re.match(r"\d+ root error", line.strip())]
    # Where TensorFlow kept no Python stack (a node of a saver's function), "<stack traces unavailable>" stands in it.
    skip = ("Graph execution error", "Detected at node", "  File ", "\t", "<stack traces unavailable>")
    first = next((line for line in lines if not line.startswith(skip)), lines[0] if lines else "").rstrip(":")
    first = re.sub(r"^\s*\(\d+\) ", "", first)
    return PeerLost(
        f"lost {peer}: {first}; a peer that dies or is silent for --collective_timeout="
        f"{settings.collective_timeout:g}s stops the job; restart every task of the job to resume from the last "
        "checkpoint"
    )
