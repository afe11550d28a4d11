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


def _not_an_address(address):
    """Why `address` is not one TensorFlow's servers take ("" for no more said), or None for a host:port."""
    host, _, port = address.rpartition(":")
    # ASCII digits alone (int() refuses a superscript two that isdigit() takes); a host without spaces.
    if not host or host.split() != [host] or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return ""
    # TensorFlow parses host:port alone: a scheme ("grpc://h:1") failed as the cluster started (a traceback), an
    # IPv6 host outside brackets ("::1:2222") bound nothing and the cluster never formed.
    if "/" in host:
        return " (no scheme or path: host:port alone)"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return " (an IPv6 host goes in brackets: [::1]:2222)"
    return None


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
            why = _not_an_address(str(address))
            if why is not None:
                bad(f"cluster['{job}'] address {address!r} is not host:port{why}")
    listed = [str(a) for addresses in cluster.values() for a in addresses]
    twice = sorted({a for a in listed if listed.count(a) > 1})
    if twice:  # two tasks cannot serve at one address: the cluster would never form
        bad(f"the address {twice[0]!r} is listed for more than one task in 'cluster'")
    if parsed.get("rpc_layer", "grpc") != "grpc":  # the one TensorFlow serves; any other fails as it starts
        bad(f"rpc_layer {parsed['rpc_layer']!r} is not 'grpc', the one TensorFlow's servers speak")
    if "worker" not in cluster and "chief" not in cluster:
        bad("'cluster' has no 'worker' or 'chief' job")
    for job in ("chief", "evaluator"):  # TensorFlow refused more with a traceback (exit 1) as the cluster started
        if len(cluster.get(job, ())) > 1:
            bad(f"cluster['{job}'] lists {len(cluster[job])} tasks: a cluster has at most one {job}")
    if not isinstance(task, dict):
        bad("'task' must be an object with 'type' and 'index'")
    task_type, index = task.get("type"), task.get("index")
    if not isinstance(task_type, str) or task_type not in cluster:
        bad(f"task type {task_type!r} is not a job in 'cluster' ({', '.join(cluster)})")
    if not isinstance(index, int) or isinstance(index, bool):
        bad(f"task index {index!r} is not a whole number")
    if not 0 <= index < len(cluster[task_type]):
        bad(f"task index {index!r} is out of range for job '{task_type}' with {len(cluster[task_type])} tasks")
    if task_type == "evaluator":  # it joined the training cluster, which refused it (a traceback) or never formed
        bad(
            "task type 'evaluator': the engine runs no evaluator task inside a cluster; evaluate beside the job "
            "with --mode=continuous_eval on its workdir, without TF_CONFIG"
        )
    return parsed
