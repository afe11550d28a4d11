"""The tf.distribute strategy and cluster resolver a config asks for.

`create_strategy` must run before any other TensorFlow op in the process:
logical CPU devices and MultiWorkerMirroredStrategy both have to be set up
before the runtime starts.
"""

import json
import os
import re

import tensorflow as tf

from engine.config import ConfigError


def parse_tf_config(raw):
    """Checks a TF_CONFIG value; returns it as a dict or raises ConfigError naming the bad field."""

    def bad(why):
        raise ConfigError(f"TF_CONFIG={raw!r}: {why}")

    try:
        tf_config = json.loads(raw)
    except json.JSONDecodeError as e:
        bad(f"not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(tf_config, dict):
        bad("must be a JSON object with 'cluster' and 'task'")
    cluster, task = tf_config.get("cluster"), tf_config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        bad("'cluster' must be an object mapping a job name to a list of host:port addresses")
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses:
            bad(f"cluster['{job}'] must be a non-empty list of host:port addresses")
        for address in addresses:
            host, _, port = str(address).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                bad(f"cluster['{job}'] address {address!r} is not host:port")
    if "worker" not in cluster and "chief" not in cluster:
        bad("'cluster' has no 'worker' or 'chief' job")
    if not isinstance(task, dict):
        bad("'task' must be an object with 'type' and 'index'")
    task_type, index = task.get("type"), task.get("index")
    if task_type not in cluster:
        bad(f"task type {task_type!r} is not a job in 'cluster' ({', '.join(cluster)})")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[task_type]):
        bad(f"task index {index!r} is out of range for job '{task_type}' with {len(cluster[task_type])} tasks")
    return tf_config


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


def strategy_name(config):
    """The strategy a config runs with, resolving the empty default for this machine."""
    if config.strategy:
        return config.strategy
    if config.cluster_resolver == "tf_config" or os.environ.get("TF_CONFIG"):
        return "multi_worker"
    if len(tf.config.list_physical_devices("GPU")) > 1 or config.num_cpu_devices > 1:
        return "mirrored"
    return "one_device"


def create_strategy(config):
    """Builds the tf.distribute.Strategy for `config`; raises ConfigError on a bad cluster."""
    cpus = _setup_cpu_devices(config.num_cpu_devices)
    name = strategy_name(config)
    gpus = [f"/gpu:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(gpus[0] if gpus else "/cpu:0")
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(gpus or cpus)
    if name == "multi_worker":
        return _multi_worker(config, bool(gpus))
    if name == "tpu":
        return _tpu(config)
    raise ConfigError(f"--strategy={name}: unknown strategy")


def _multi_worker(config, have_gpus):
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise ConfigError(
            "TF_CONFIG is not set: --strategy=multi_worker reads the cluster from it "
            '(e.g. {"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}})'
        )
    parse_tf_config(raw)
    # RING works on every device type; NCCL is faster between GPUs. The timeout turns a dead peer
    # into an error instead of a hang.
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=(
            tf.distribute.experimental.CommunicationImplementation.NCCL
            if have_gpus
            else tf.distribute.experimental.CommunicationImplementation.RING
        ),
        timeout_seconds=config.collective_timeout,
    )
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)


def _tpu(config):
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=config.tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.NotFoundError, tf.errors.UnavailableError, RuntimeError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise ConfigError(f"--tpu={config.tpu}: no TPU reachable ({first_line})") from None
    return tf.distribute.TPUStrategy(resolver)


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
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def task_id(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    return (resolver.task_id or 0) if resolver is not None else 0


class PeerLost(RuntimeError):
    """A multi-worker peer died or stopped answering; restarting every worker resumes the job."""


def explain_failure(strategy, config, error):
    """A lost peer on a multi-worker job becomes PeerLost naming it; other errors come back unchanged."""
    if not is_multi_worker(strategy) or not isinstance(
        error,
        (
            tf.errors.UnavailableError,
            tf.errors.DeadlineExceededError,
            tf.errors.AbortedError,
            tf.errors.CancelledError,
            tf.errors.InternalError,
        ),
    ):
        return error
    text = getattr(error, "message", str(error))
    cluster = strategy.cluster_resolver.cluster_spec().as_dict()
    lost = [
        m
        for m in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", text)
        if m != (strategy.cluster_resolver.task_type, str(strategy.cluster_resolver.task_id))
    ]
    if lost:
        job, index = lost[0]
        peer = f"{job} {index} ({cluster.get(job, ['?'] * (int(index) + 1))[int(index)]})"
    else:
        peer = "a peer (not named by TensorFlow)"
    first = text.strip().splitlines()[0]
    return PeerLost(
        f"lost {peer}: {first}; the collective timeout is --collective_timeout="
        f"{config.collective_timeout:g}s; restart every worker to resume from the last checkpoint"
    )
