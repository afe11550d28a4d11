"""TF_CONFIG checking and strategy selection."""

import inspect
import json
import signal
import socket
import subprocess
import sys

import pytest

from engine.cluster import distribute
from engine.cluster.resolvers import NOT_FORMED_EXIT_CODE, connect_deadline
from engine.settings.environment import parse_tf_config
from engine.settings.errors import ConfigError
from engine.settings.fields import Config

GOOD = {"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 1}}


def test_good_tf_config_parses():
    assert parse_tf_config(json.dumps(GOOD)) == GOOD


@pytest.mark.parametrize(
    "raw,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"task": GOOD["task"]}), "'cluster' must be an object"),
        (json.dumps({**GOOD, "cluster": {"worker": []}}), "cluster['worker'] must be a non-empty list"),
        (json.dumps({**GOOD, "cluster": {"worker": ["host1"]}}), "'host1' is not host:port"),
        (json.dumps({**GOOD, "cluster": {"worker": ["host1:99999"]}}), "'host1:99999' is not host:port"),
        (
            json.dumps({**GOOD, "cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}}),
            "no 'worker' or 'chief'",
        ),
        (json.dumps({**GOOD, "task": {"type": "evaluator", "index": 0}}), "task type 'evaluator' is not a job"),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": 2}}), "task index 2 is out of range"),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": "0"}}), "task index '0' is not a whole number"),
        (json.dumps({**GOOD, "cluster": {"worker": ["h:1"], "bogus": ["x:2"]}}), "job 'bogus' in 'cluster' is none of"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "task"}), "'task' must be an object"),
        # Each ended in a traceback (exit 1) or a cluster that never formed (exit 10 after --connect_timeout).
        (json.dumps({**GOOD, "cluster": {"worker": ["h:\u00b2"]}}), "'h:\u00b2' is not host:port"),
        (json.dumps({**GOOD, "cluster": {"worker": ["local host:1"]}}), "'local host:1' is not host:port"),
        (json.dumps({**GOOD, "cluster": {"worker": ["h:1", "h:1"]}}), "the address 'h:1' is listed for more than one"),
        (json.dumps({**GOOD, "rpc_layer": "bogus"}), "rpc_layer 'bogus' is not 'grpc'"),
        # Each passed the check, then ended in a traceback (exit 1) or a cluster that never formed (exit 10).
        (json.dumps({**GOOD, "task": {"type": ["worker"], "index": 0}}), "task type ['worker'] is not a job"),
        (
            json.dumps(
                {"cluster": {"chief": ["h:1", "h:2"], "worker": ["h:3"]}, "task": {"type": "chief", "index": 1}}
            ),
            "cluster['chief'] lists 2 tasks: a cluster has at most one chief",
        ),
        (
            json.dumps({**GOOD, "cluster": {**GOOD["cluster"], "evaluator": ["h:3", "h:4"]}}),
            "cluster['evaluator'] lists 2 tasks: a cluster has at most one evaluator",
        ),
        (
            json.dumps(
                {"cluster": {**GOOD["cluster"], "evaluator": ["h:3"]}, "task": {"type": "evaluator", "index": 0}}
            ),
            "task type 'evaluator': the engine runs no evaluator task inside a cluster",
        ),
        (
            json.dumps({**GOOD, "cluster": {"worker": ["grpc://h:1", "h:2"]}}),
            "'grpc://h:1' is not host:port (no scheme",
        ),
        (json.dumps({**GOOD, "cluster": {"worker": ["::1:2222", "h:2"]}}), "(an IPv6 host goes in brackets"),
    ],
)
def test_malformed_tf_config_names_the_field(raw, message):
    with pytest.raises(ConfigError, match="TF_CONFIG=") as error:
        parse_tf_config(raw)
    assert message in str(error.value)


def test_a_bracketed_ipv6_address_and_a_chief_beside_workers_parse():
    ipv6 = {"cluster": {"worker": ["[::1]:2222", "[fe80::1]:2223"]}, "task": {"type": "worker", "index": 0}}
    assert parse_tf_config(json.dumps(ipv6)) == ipv6
    chief = {
        "cluster": {"chief": ["h:1"], "worker": ["h:2"], "evaluator": ["h:3"]},
        "task": {"type": "chief", "index": 0},
    }
    assert parse_tf_config(json.dumps(chief)) == chief


def test_a_multi_worker_chief_job_counts_among_the_workers():
    # A TFJob's Chief replica trains beside its Workers under MultiWorkerMirroredStrategy, reading an input pipeline
    # of its own: a chief and a worker were counted as 1 worker, so a streamed run recorded 1 input pipeline for 2
    # and was resumed on one device without the refusal a run of 2 workers gets (its data position read wrongly).
    import tensorflow as tf

    def workers(spec, task):
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type=task[0], task_id=task[1]
        )
        strategy = type("Strategy", (), {"cluster_resolver": resolver})()
        return distribute.num_workers(strategy)

    assert workers({"chief": ["h:1"], "worker": ["h:2"]}, ("chief", 0)) == 2
    assert workers({"chief": ["h:1"], "worker": ["h:2", "h:3"], "evaluator": ["h:4"]}, ("worker", 1)) == 3
    assert workers({"worker": ["h:2", "h:3"]}, ("worker", 0)) == 2
    assert workers({}, (None, None)) == 1


def test_default_strategy_for_the_machine(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert distribute.strategy_name(Config().cluster) == "one_device"
    assert distribute.strategy_name(Config(num_cpu_devices=2).cluster) == "mirrored"
    assert distribute.strategy_name(Config(strategy="tpu", tpu="x").cluster) == "tpu"
    monkeypatch.setenv("TF_CONFIG", json.dumps(GOOD))
    assert distribute.strategy_name(Config().cluster) == "multi_worker"


def test_one_device_is_chief(one_device, mirrored):
    assert distribute.is_chief(one_device) and distribute.is_chief(mirrored)


def _parameter_server_chief(workers):
    """A ParameterServerStrategy's chief as TensorFlow 2.21 holds it, without the cluster it would connect to: its
    resolver on the strategy itself (`_cluster_resolver`), none on its extended strategy, so `cluster_resolver` is
    None."""
    import tensorflow as tf

    spec = {"chief": ["h:1"], "worker": [f"h:{2 + i}" for i in range(workers)], "ps": ["h:9"]}
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), "chief", 0)
    strategy = object.__new__(tf.distribute.ParameterServerStrategy)
    strategy._cluster_resolver = resolver
    assert getattr(strategy, "cluster_resolver", None) is None
    # Where TensorFlow's own constructor keeps it (a real one connects to its cluster): the test holds to that.
    assert "self._cluster_resolver = cluster_resolver" in inspect.getsource(tf.distribute.ParameterServerStrategy)
    return strategy


def test_a_parameter_server_job_schedules_each_round_over_all_its_workers():
    # Its workers were counted from `cluster_resolver`, which TensorFlow leaves None: a job of 3 workers was taken for
    # one, its rounds cut into 4 functions (3 of 4 workers idle on a 16-worker job) and a resumed worker's stream
    # started 3 times too far (at the whole job's batch count, not its share).
    from engine.run import inputs

    strategy = _parameter_server_chief(3)
    assert distribute.scheduled_workers(strategy) == 3 and distribute.num_workers(strategy) == 1

    zeros = {"steps": 0.0, "skipped": 0.0, "loss_sum": 0.0, "floor_skipped": 0.0, "stop": 0.0}
    zeros.update(input_wait=0.0, busy=0.0)

    class Coordinator:
        def __init__(self):
            self.sizes = []

        def schedule(self, loop, args):
            self.sizes.append(int(args[1]))
            return type("Remote", (), {"fetch": lambda _: dict(zeros, steps=float(args[1]))})()

        def join(self):
            pass

    placement = distribute.Placement(strategy, "parameter_server", "CPU", 1, 1, True, True, True, 0, scheduled=3)
    path = inputs.PerWorker(placement, data=None, counter=None, coordinator=Coordinator())
    out = path.run(loop=None, iterator=None, steps=100, first_batch=0)
    assert path.coordinator.sizes == [8] * 12 + [4] and out["steps"] == 100  # 100 // (4 workers' chunks × 3)
    assert path.stream_start(60) == 20  # each worker's own stream, at its share of the 60 batches read
    shared = inputs.PerWorker(placement, data=None, counter=None, coordinator=Coordinator(), service="grpc://d:1")
    assert shared.stream_start(60) == 60  # the tf.data service's one job, which every worker reads from


def test_a_parameter_server_rounds_input_wait_is_a_share_of_its_time_not_the_workers_waits_summed():
    # Two workers' functions ran at once, each waiting for input 80% of its time: their waits were summed over the
    # round's wall time, and an input-bound folder: job wrote input_wait_fraction=1.16 (and would warn of "116%").
    import time

    from engine.run import inputs

    strategy = _parameter_server_chief(2)

    class Coordinator:  # each function ran 1 s, 0.8 s of it waiting; together they took the round's 0.05 s
        def schedule(self, loop, args):
            out = {"steps": float(args[1]), "skipped": 0.0, "loss_sum": 0.0, "floor_skipped": 0.0, "stop": 0.0}
            return type("Remote", (), {"fetch": lambda _: {**out, "input_wait": 0.8, "busy": 1.0}})()

        def join(self):
            time.sleep(0.05)

    placement = distribute.Placement(strategy, "parameter_server", "CPU", 1, 1, True, True, True, 0, scheduled=2)
    path = inputs.PerWorker(placement, data=None, counter=None, coordinator=Coordinator())
    tic = time.perf_counter()
    out = path.run(loop=None, iterator=None, steps=8, first_batch=0)
    seconds = time.perf_counter() - tic
    assert 0.8 * 0.05 <= out["input_wait"] <= 0.8 * seconds  # 80% of the round, as each worker's share


def test_a_peer_at_an_ipv6_address_that_answers_is_not_named_silent():
    # Its host was looked up with its brackets ("[::1]"), which fails: a peer that was up read "no answer from
    # worker 1 ([::1]:PORT)" when the tasks' TF_CONFIG disagreed, sending the user to the network.
    import tensorflow as tf

    with socket.socket(socket.AF_INET6) as peer:
        peer.bind(("::1", 0))
        peer.listen()
        spec = tf.train.ClusterSpec({"worker": ["[::1]:1", f"[::1]:{peer.getsockname()[1]}"]})
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
        command = connect_deadline(Config(connect_timeout=0.2).cluster, resolver).command
        parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        command[3] = str(parent.pid)  # the watchdog signals this process, not the test's
        # Its stdin open: the cluster has not formed (a closed one says it has).
        watchdog = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = watchdog.stderr.read()
        watchdog.stdin.close()
        watchdog.wait()
    assert parent.wait(timeout=60) == -NOT_FORMED_EXIT_CODE == -signal.SIGUSR1
    assert said.strip() == (
        "error: could not form the cluster within --connect_timeout=0.2s: every peer answered but the cluster did "
        "not form: do all tasks' TF_CONFIG list the same cluster?"
    )
