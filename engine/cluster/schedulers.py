"""The cluster as a scheduler gives it: Slurm's variables of an `srun` step, Kubernetes' worker pods. Each returns
a resolver of the job's tasks with this task's own type and index (engine/cluster/resolvers.py resolve)."""

import itertools
import os
import re
import socket
import time

import tensorflow as tf

from engine.settings.config import first_line
from engine.settings.errors import ConfigError

_POLL_SECONDS = 1.0  # between two listings of the pods that do not all run yet

SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


def slurm_cluster(settings, strategy):
    """Slurm: every task of `srun` runs the same command; the step's node list says who is who. Tasks are
    numbered node by node (Slurm's default block distribution), ports from --slurm_port_base on each node."""
    missing = [name for name in SLURM_VARIABLES if name not in os.environ]
    if missing:
        raise ConfigError(
            f"--cluster_resolver=slurm: {missing[0]} is not set; run the job under srun (one task per worker)"
        )
    try:
        hosts = expand_hostlist(os.environ["SLURM_STEP_NODELIST"])
    except ValueError:
        raise ConfigError(_slurm_bad("SLURM_STEP_NODELIST", "a node list as gpu[07-08,10],login1")) from None
    try:
        per_node = expand_counts(os.environ["SLURM_STEP_TASKS_PER_NODE"])
    except ValueError:
        raise ConfigError(_slurm_bad("SLURM_STEP_TASKS_PER_NODE", "tasks per node as 2(x3),1")) from None
    if len(per_node) != len(hosts):  # each node's count: zip() left the extra nodes or counts out, silently
        raise ConfigError(
            f"--cluster_resolver=slurm: SLURM_STEP_TASKS_PER_NODE={os.environ['SLURM_STEP_TASKS_PER_NODE']!r} counts "
            f"{len(per_node)} nodes, SLURM_STEP_NODELIST={os.environ['SLURM_STEP_NODELIST']!r} lists {len(hosts)}"
        )
    addresses = [f"{host}:{settings.slurm_port_base + i}" for host, count in zip(hosts, per_node) for i in range(count)]
    tasks, rank = _slurm_count("SLURM_STEP_NUM_TASKS"), _slurm_count("SLURM_PROCID")
    if rank >= tasks:
        raise ConfigError(_slurm_bad("SLURM_PROCID", f"a task's rank, below SLURM_STEP_NUM_TASKS={tasks}"))
    top = settings.slurm_port_base + max(per_node, default=1) - 1
    if top > 65535:
        raise ConfigError(
            f"--slurm_port_base={settings.slurm_port_base}: with {max(per_node)} tasks on a node their ports run to "
            f"{top}, past 65535"
        )
    if len(addresses) != tasks:
        raise ConfigError(
            f"--cluster_resolver=slurm: SLURM_STEP_NUM_TASKS={tasks} but the node list holds "
            f"{len(addresses)} tasks ({os.environ['SLURM_STEP_NODELIST']})"
        )
    _check_block(hosts, per_node, rank)
    jobs = [("worker", tasks)]
    if strategy == "parameter_server":
        jobs = [("chief", 1), ("ps", settings.num_ps), ("worker", tasks - 1 - settings.num_ps)]
        if jobs[-1][1] < 1:
            raise ConfigError(
                f"--num_ps={settings.num_ps}: the Slurm step has {tasks} tasks, too few for a chief, "
                f"{settings.num_ps} parameter servers and at least one worker"
            )
    spec, start = {}, 0
    for job, count in jobs:
        spec[job] = addresses[start : start + count]
        if start <= rank < start + count:
            task = (job, rank - start)
        start += count
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=task[0], task_id=task[1], rpc_layer="grpc"
    )


def _check_block(hosts, per_node, rank):
    """The addresses are the block distribution's (tasks numbered node by node): a task placed otherwise (srun
    --distribution=cyclic or plane, an arbitrary SLURM_HOSTFILE) would serve on another node or port than its peers
    dial, and the cluster would never form. Its own node and local index, where Slurm says them, must agree."""
    node = next(i for i, end in enumerate(itertools.accumulate(per_node)) if rank < end)
    local = rank - sum(per_node[:node])
    actual = os.environ.get("SLURMD_NODENAME", hosts[node]), os.environ.get("SLURM_LOCALID", str(local))
    if actual != (hosts[node], str(local)):
        raise ConfigError(
            f"--cluster_resolver=slurm: task {rank} runs on {actual[0]} as its local task {actual[1]} "
            f"(SLURMD_NODENAME, SLURM_LOCALID), not on {hosts[node]} as local task {local}, where numbering node by "
            f"node places it: run srun with --distribution=block "
            f"(SLURM_DISTRIBUTION={os.environ.get('SLURM_DISTRIBUTION', '')!r})"
        )


def _slurm_bad(name, what):
    return f"--cluster_resolver=slurm: {name}={os.environ[name]!r} is not {what}"


def _slurm_count(name):
    """A whole number of at least 0 Slurm set in `name`; ConfigError naming it else."""
    value = os.environ[name]
    if not (value.isascii() and value.isdigit()):
        raise ConfigError(_slurm_bad(name, "a whole number"))
    return int(value)


def expand_hostlist(hostlist):
    """Slurm's compressed node list, e.g. "gpu[07-08,10],login1" -> gpu07, gpu08, gpu10, login1; a name's text around
    its brackets stays ("n[1-2]-ib" -> n1-ib, n2-ib), several bracketed ranges in a name expand in turn. ValueError
    for what Slurm would not write (an unclosed bracket, an empty or reversed range, an empty name)."""
    names, depth, start = [], 0, 0
    for i, character in enumerate(hostlist + ","):  # the top-level commas: those inside brackets separate ranges
        depth += {"[": 1, "]": -1}.get(character, 0)
        if depth not in (0, 1):
            raise ValueError(hostlist)
        if character == "," and depth == 0:
            names.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(hostlist)
    hosts = []
    for name in names:
        parts = re.split(r"\[([^\[\]]*)\]", name)  # text, ranges, text, ranges, ..., text
        if not name or any("[" in text or "]" in text for text in parts[::2]):
            raise ValueError(hostlist)
        expanded = [parts[0]]
        for ranges, text in zip(parts[1::2], parts[2::2]):
            numbers = []
            for part in ranges.split(","):
                first, _, last = part.partition("-")
                if not re.fullmatch(r"\d+", first) or not re.fullmatch(r"\d*", last) or int(last or first) < int(first):
                    raise ValueError(hostlist)
                numbers += [f"{i:0{len(first)}d}" for i in range(int(first), int(last or first) + 1)]
            expanded = [f"{host}{number}{text}" for host in expanded for number in numbers]
        hosts += expanded
    return hosts


def expand_counts(counts):
    """Slurm's tasks per node, e.g. "2(x3),1" -> 2, 2, 2, 1; ValueError for what Slurm would not write."""
    expanded = []
    for part in counts.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not found:
            raise ValueError(counts)
        expanded += [int(found.group(1))] * int(found.group(2) or 1)
    return expanded


# Kubernetes: the port of each worker pod's TensorFlow server, and where a pod reads its namespace.
KUBERNETES_PORT = 2222
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_PODS = {}  # selector: the cluster resolved once in this process (a lost peer's message reads it again)


def kubernetes_cluster(settings):
    """Kubernetes: the worker pods --kubernetes_selector selects in this pod's namespace, once every one of them runs
    (within --connect_timeout), in the order of their names; this pod is the worker of its own name (or address).
    TensorFlow's KubernetesClusterResolver leaves a task's type and index unset, which no strategy starts without."""
    try:
        import kubernetes  # optional: only this resolver needs it
    except ImportError:
        raise ConfigError(
            "--cluster_resolver=kubernetes: needs the kubernetes client library "
            "(pip install kubernetes); a TFJob sets TF_CONFIG, so --cluster_resolver=tf_config "
            "works without it"
        ) from None
    selector = settings.kubernetes_selector
    if not selector:
        raise ConfigError(
            "--kubernetes_selector=: --cluster_resolver=kubernetes needs the label selector of the "
            "job's worker pods, e.g. job-name=train-worker"
        )
    if selector not in _PODS:
        _PODS[selector] = _running_pods(kubernetes, settings)
    pods = _PODS[selector]  # [(name, address)] by name
    me, address = os.environ.get("HOSTNAME") or socket.gethostname(), _own_address()
    mine = [i for i, (name, ip) in enumerate(pods) if me in (name, ip) or address == ip]
    if not mine:
        raise ConfigError(
            f"--kubernetes_selector={selector}: selects the pods {', '.join(name for name, _ in pods)}, not this one "
            f"({me}): give the selector of this job's worker pods"
        )
    spec = tf.train.ClusterSpec({"worker": [f"{ip}:{KUBERNETES_PORT}" for _, ip in pods]})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="worker", task_id=mine[0], rpc_layer="grpc"
    )


def _running_pods(kubernetes, settings):
    """[(name, address)] of the pods the selector selects, by name, once each runs with an address."""
    selector, seconds = settings.kubernetes_selector, settings.connect_timeout
    try:
        kubernetes.config.load_incluster_config()
        with open(NAMESPACE_FILE) as f:
            namespace = f.read().strip()
    except (kubernetes.config.ConfigException, OSError) as e:
        raise ConfigError(f"--cluster_resolver=kubernetes: not inside a Kubernetes pod ({first_line(e)})") from None
    api, deadline = kubernetes.client.CoreV1Api(), time.monotonic() + seconds
    while True:
        try:
            pods = api.list_namespaced_pod(namespace, label_selector=selector).items
        except kubernetes.client.ApiException as e:
            raise ConfigError(
                f"--kubernetes_selector={selector}: cannot list the pods of namespace {namespace} ({e.status} "
                f"{e.reason}): the pod's service account needs permission to list pods"
            ) from None
        # A pod that ended (a preempted worker's, beside its replacement) or is being deleted is no task of the job.
        pods = [p for p in pods if p.status.phase not in ("Succeeded", "Failed") and not p.metadata.deletion_timestamp]
        waiting = sorted(p.metadata.name for p in pods if p.status.phase != "Running" or not p.status.pod_ip)
        if pods and not waiting:
            return sorted((p.metadata.name, p.status.pod_ip) for p in pods)
        if time.monotonic() >= deadline:
            why = f"{', '.join(waiting)} not running" if pods else "it selects no pod"
            raise ConfigError(
                f"--kubernetes_selector={selector}: the cluster did not form within "
                f"--connect_timeout={seconds:g}s: {why}"
            )
        time.sleep(min(_POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def _own_address():
    """This host's address as its name resolves (a pod's own IP), or None."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
