"""The strategy a run's settings plan (planned_strategy), judged before TensorFlow starts, the refusals that depend
on it, and --local_workers' cluster on this machine, held to its memory: engine/settings/config.py's validate runs
check_strategy among the settings' checks. No TensorFlow
here: launch.py reads it before TensorFlow starts."""

import re

from engine.settings.checks import fail
from engine.settings.environment import tf_config
from engine.settings.errors import counted
from engine.settings.fields import FIELD_BY_NAME, LOCAL_TASK_BYTES, MAX_LOCAL_TASKS
from engine.settings.machine import host_memory_bytes, human_bytes


def check_strategy(config):
    """The refusals that depend on the strategy, judged on the one the run will use (planned_strategy), whether
    --strategy, TF_CONFIG or --cluster_resolver chose it, and those of --local_workers."""
    if config.local_workers:
        _check_local_workers(config)
    if config.cluster_resolver and config.strategy in ("one_device", "mirrored"):
        # Each task of a Slurm or Kubernetes job trained alone on its machine's devices, the workdir's lock refusing
        # all but one.
        fail(
            "cluster_resolver",
            config.cluster_resolver,
            f"is not read by --strategy={config.strategy}, which runs in one process (each task of a job would train "
            "alone): use --strategy=multi_worker, parameter_server or tpu, or leave --strategy out",
        )
    name, said = strategy_plan(config.cluster)
    if name == "parameter_server" and config.precision == "mixed_float16":
        fail(
            "precision",
            config.precision,
            f"is not supported with {said}: asynchronous "
            "workers cannot share one dynamic loss scale; use mixed_bfloat16 or float32",
        )
    if name == "parameter_server" and config.jit_compile == "true":
        fail(
            "jit_compile",
            config.jit_compile,
            f"cannot compile the step with {said}: an XLA program cannot read the variables on parameter servers "
            "(--jit_compile=auto compiles nothing there)",
        )
    if name == "parameter_server" and config.deterministic:  # same flags, same numbers: not on asynchronous workers
        fail(
            "deterministic",
            config.deterministic,
            f"cannot make {said} reproducible: its workers apply their updates asynchronously, in the order they "
            "finish, so the same flags give other numbers each run; drop --deterministic, or use "
            "--strategy=multi_worker (synchronous)",
        )
    if name == "parameter_server" and config.cluster_resolver == "kubernetes":
        fail(
            "cluster_resolver",
            config.cluster_resolver,
            f"reads one job of worker pods; {said} needs chief, worker and ps jobs: give them in TF_CONFIG (a TFJob "
            "sets it)",
        )
    # --local_workers writes each task's TF_CONFIG: one this process inherited is no task's, and is not read.
    jobs = {} if config.local_workers else (tf_config() or {}).get("cluster") or {}
    if name == "multi_worker" and "ps" in jobs:  # TensorFlow's multi-worker strategy has no parameter servers
        fail("strategy", config.strategy, "runs no 'ps' job, which TF_CONFIG has: use --strategy=parameter_server")
    if name == "parameter_server" and "ps" in jobs and config.cluster_resolver in ("", "tf_config"):
        _check_num_ps(config, len(jobs["ps"]))
    if name == "tpu" and not config.tpu:
        fail("tpu", config.tpu, f"{said} needs --tpu=NAME_OR_ADDRESS ('local' on a TPU VM)")
    if config.tf_data_service and data_service_address(config.tf_data_service) is None:
        fail("tf_data_service", config.tf_data_service, "must be grpc://host:port or host:port of its dispatcher")
    if name == "tpu" and config.precision == "mixed_float16":
        # An explicit --strategy=tpu keeps the words it has always been refused with.
        computes = "TPUs compute" if config.strategy else f"{said} computes"
        fail("precision", config.precision, f"{computes} in bfloat16, not float16: use --precision=mixed_bfloat16")


def _check_num_ps(config, servers):
    """--num_ps, which only --local_workers and Slurm make a cluster by, beside TF_CONFIG's cluster of `servers`
    parameter servers: refused where it says another number (it changed nothing), unless at its default (not given,
    as far as a Config tells). A task --local_workers started reads its own --num_ps in the TF_CONFIG it was given."""
    if config.num_ps not in (servers, FIELD_BY_NAME["num_ps"].default):
        fail(
            "num_ps",
            config.num_ps,
            f"the cluster is TF_CONFIG's, whose 'ps' job lists {counted(servers, 'parameter server')}: --num_ps sizes "
            "only the clusters --local_workers and --cluster_resolver=slurm make; drop it",
        )


def data_service_address(service):
    """(host, port) of a --tf_data_service value ([grpc://]host:port), or None when it is not one."""
    found = re.fullmatch(r"(?:grpc://)?(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):(\d{1,5})", service)
    if not found or not 0 < int(found.group(2)) < 65536:
        return None
    return found.group(1).strip("[]"), int(found.group(2))


def _plan(cluster):
    """(strategy name or None, what chose it): see planned_strategy."""
    if cluster.strategy:
        return cluster.strategy, f"--strategy={cluster.strategy}"

    jobs = (tf_config() or {}).get("cluster")
    if jobs and "ps" in jobs:
        return "parameter_server", "TF_CONFIG has a 'ps' job"
    if jobs:
        return "multi_worker", "TF_CONFIG has a cluster"
    if cluster.cluster_resolver in ("tf_config", "slurm", "kubernetes"):
        return "multi_worker", f"--cluster_resolver={cluster.cluster_resolver}"
    if cluster.cluster_resolver == "tpu":
        return "tpu", "--cluster_resolver=tpu"
    if cluster.num_cpu_devices > 1:
        return "mirrored", f"--num_cpu_devices={cluster.num_cpu_devices}"
    return None, "the devices"


def strategy_plan(cluster):
    """(planned_strategy, what chose it in words: the flag "--strategy=multi_worker", or "the multi_worker strategy
    (TF_CONFIG has a cluster)"), for a refusal to name."""
    name, origin = _plan(cluster)
    return name, origin if cluster.strategy else f"the {name} strategy ({origin})"


def planned_strategy(cluster):
    """The strategy a run will use, as its cluster settings (config.cluster) and environment decide it: --strategy;
    else a cluster in TF_CONFIG (parameter_server when it has a 'ps' job, else multi_worker); else
    --cluster_resolver's (tpu, or multi_worker); else mirrored over --num_cpu_devices; None where only the devices
    decide (mirrored over several GPUs, else one_device), which needs TensorFlow: engine/cluster/distribute.py's
    strategy_name completes this. Every check that depends on the strategy reads this one answer, before anything
    starts."""
    return _plan(cluster)[0]


# ---- --local_workers: a cluster on this machine, in what it holds ------------------------------------------


def _check_local_workers(config):
    """--local_workers starts a cluster's workers here, whose TF_CONFIG it writes: only to train, with a strategy that
    has workers and no other source of the cluster; every task of its cluster, no more than MAX_LOCAL_TASKS, nor
    than fit in memory."""
    if config.strategy not in ("multi_worker", "parameter_server"):
        fail("local_workers", config.local_workers, "needs --strategy=multi_worker or --strategy=parameter_server")
    if config.mode != "train":  # each task would run the mode alone, and say so alone
        fail("local_workers", config.local_workers, f"starts the workers of a train run, not --mode={config.mode}")
    if config.cluster_resolver not in ("", "tf_config"):
        fail(
            "local_workers",
            config.local_workers,
            f"writes the cluster's TF_CONFIG, which --cluster_resolver={config.cluster_resolver} would not read",
        )
    total = host_memory_bytes()
    limit = max(1, min(MAX_LOCAL_TASKS, total // LOCAL_TASK_BYTES))
    why = (
        f"at most {limit} fit (each is a TensorFlow process of about {human_bytes(LOCAL_TASK_BYTES)}, this machine has "
        f"{human_bytes(total)}; the launcher's cap is {MAX_LOCAL_TASKS})"
    )
    if config.local_workers > limit:
        fail("local_workers", config.local_workers, f"starts {config.local_workers} TensorFlow processes here; {why}")
    if config.strategy == "parameter_server" and 1 + config.local_workers + config.num_ps > limit:
        count = 1 + config.local_workers + config.num_ps
        fail(
            "num_ps",
            config.num_ps,
            f"with --local_workers={config.local_workers} starts {count} TensorFlow processes here (a chief, "
            f"{counted(config.local_workers, 'worker')}, {counted(config.num_ps, 'parameter server')}); {why}",
        )
