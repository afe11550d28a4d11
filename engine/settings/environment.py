"""The cluster the environment describes, read before TensorFlow starts: TF_CONFIG, checked field by field. A
setting of the run as much as a flag (it chooses the strategy, engine/settings/checks.py planned_strategy), so it
is read here, at the ground: the cluster wing builds on it."""

import json
import os

from engine.settings.errors import ConfigError

JOBS = ("chief", "worker", "ps", "evaluator")  # the jobs a cluster may have (TensorFlow's multi_worker_util)


def tf_config():
    """TF_CONFIG as a dict, checked; None when it is not set. Set but empty counts as not set (job scripts
    often leave it so) and is removed: TensorFlow's own resolvers, which read it too, fail on it with a
    JSON traceback, even under a strategy that has no cluster."""
    raw = os.environ.get("TF_CONFIG", "")
    if not raw.strip():
        os.environ.pop("TF_CONFIG", None)
        return None
    return parse_tf_config(raw)


def parse_tf_config(raw):
    """Checks a TF_CONFIG value; returns it as a dict or raises ConfigError naming the bad field."""

    def bad(why):
        raise ConfigError(f"TF_CONFIG={raw!r}: {why}")

    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        bad(f"not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(parsed, dict):
        bad("must be a JSON object with 'cluster' and 'task'")
    cluster, task = parsed.get("cluster"), parsed.get("task")
    if not isinstance(cluster, dict) or not cluster:
        bad("'cluster' must be an object mapping a job name to a list of host:port addresses")
    for job, addresses in cluster.items():
        if job not in JOBS:  # TensorFlow's ClusterSpec refuses any other with a traceback
            bad(f"job {job!r} in 'cluster' is none of {', '.join(JOBS)}")
        if not isinstance(addresses, list) or not addresses:
            bad(f"cluster['{job}'] must be a non-empty list of host:port addresses")
        for address in addresses:
            host, _, port = str(address).rpartition(":")
            # ASCII digits alone (int() refuses a superscript two that isdigit() takes); a host without spaces.
            if (
                not host
                or host.split() != [host]
                or not (port.isascii() and port.isdigit())
                or not 0 < int(port) < 65536
            ):
                bad(f"cluster['{job}'] address {address!r} is not host:port")
    listed = [str(a) for addresses in cluster.values() for a in addresses]
    twice = sorted({a for a in listed if listed.count(a) > 1})
    if twice:  # two tasks cannot serve at one address: the cluster would never form
        bad(f"the address {twice[0]!r} is listed for more than one task in 'cluster'")
    if parsed.get("rpc_layer", "grpc") != "grpc":  # the one TensorFlow serves; any other fails as it starts
        bad(f"rpc_layer {parsed['rpc_layer']!r} is not 'grpc', the one TensorFlow's servers speak")
    if "worker" not in cluster and "chief" not in cluster:
        bad("'cluster' has no 'worker' or 'chief' job")
    if not isinstance(task, dict):
        bad("'task' must be an object with 'type' and 'index'")
    task_type, index = task.get("type"), task.get("index")
    if task_type not in cluster:
        bad(f"task type {task_type!r} is not a job in 'cluster' ({', '.join(cluster)})")
    if not isinstance(index, int) or isinstance(index, bool):
        bad(f"task index {index!r} is not a whole number")
    if not 0 <= index < len(cluster[task_type]):
        bad(f"task index {index!r} is out of range for job '{task_type}' with {len(cluster[task_type])} tasks")
    return parsed
