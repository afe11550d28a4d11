"""A cluster that stays healthy: threads that do not grow with the steps, a local cluster's servers out of reach
in a network namespace of its own, a signal still seen when the stop flag's server is gone, a TPU that is not
there refused in time, a bad or empty TF_CONFIG handled before TensorFlow starts."""

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from engine.cluster import distribute
from engine.settings.config import validate
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from tests import forkserver, helpers
from tests.helpers import ROOT, launch


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^Threads:\s+(\d+)", f.read(), re.M).group(1))


def listening_ports(pid, seen_from="self"):
    """{local address: port} of the TCP sockets `pid` listens on, e.g. {'[::]': 40123}, as the network namespace
    of process `seen_from` lists them (this process's by default): another namespace's sockets are not there."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{seen_from}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    host, port = fields[1].split(":")
                    # /proc prints each 32-bit word of the address in host byte order
                    raw = b"".join(bytes.fromhex(host)[i : i + 4][::-1] for i in range(0, len(host) // 2, 4))
                    name = str(ipaddress.ip_address(raw))
                    found[name if table == "tcp" else f"[{name}]"] = int(port, 16)
    return found


@pytest.mark.slow
def test_threads_stay_flat_over_thousands_of_collectives(data_dir, tmp_path):
    """A multi-worker job's thread count must not grow with the number of collectives it has run: TensorFlow
    starts one sleeping thread per collective that has a timeout. And the workers' servers, which listen on every
    interface (TensorFlow cannot be told to bind 127.0.0.1), listen in the local cluster's own network namespace,
    not in this one's: nothing outside it can reach them."""
    proc = forkserver.popen(
        [
            "launch.py",
            f"--workdir={tmp_path}",
            f"--data_dir={data_dir}",
            "--strategy=multi_worker",
            "--local_workers=2",
            "--hidden_sizes=8",
            "--global_batch_size=16",
            "--steps_per_loop=5",  # with a host round trip and its metric all-reduces every five steps
            "--train_steps=2400",
            "--checkpoint_every=0",
            "--collective_timeout=600",
            "--connect_timeout=120",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids, ports, counts, listening, outside, output = {}, {}, {}, {}, {}, []
    for line in proc.stdout:
        output.append(line)
        started = re.match(r"\[launcher\] (worker \d) pid (\d+) on localhost:(\d+)", line)
        if started:
            pids[started.group(1)], ports[started.group(1)] = int(started.group(2)), int(started.group(3))
        step = re.match(r"\[(worker \d)\] train step=(200|2000) ", line)
        if step:
            counts[step.groups()] = threads(pids[step.group(1)])
            pid = pids[step.group(1)]
            listening.setdefault(step.group(1), listening_ports(pid, seen_from=pid))
            outside.setdefault(step.group(1), listening_ports(pid))
    proc.wait(timeout=60)
    text = "".join(output)
    assert proc.returncode == 0, text[-3000:]
    print("threads at steps 200 and 2000:", counts)
    for worker in ("worker 0", "worker 1"):
        assert abs(counts[worker, "2000"] - counts[worker, "200"]) < 5, counts
        # every interface of the job's namespace: [::] (dual-stack), or 0.0.0.0 on a host without IPv6
        assert listening[worker] in ({"[::]": ports[worker]}, {"0.0.0.0": ports[worker]}), listening
        assert outside[worker] == {}, outside
    assert (
        "[launcher] the tasks share a network namespace that holds only loopback: their servers (ports "
        f"{ports['worker 0']}, {ports['worker 1']}) cannot be reached from outside it, and the tasks cannot reach the "
        "network (--local_cluster_network=host gives them this machine's)"
    ) in text.splitlines()


def test_unreachable_tpu_address_is_refused_within_the_connect_timeout(tmp_path):
    port = helpers.free_ports(1)[0]  # nothing listens there
    result = launch(
        f"--workdir={tmp_path / 'run'}", "--strategy=tpu", f"--tpu=grpc://127.0.0.1:{port}", "--connect_timeout=5"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        # TensorFlow connects lazily: the first call that waits on the TPU is the initialization's
        f"error: --tpu=grpc://127.0.0.1:{port}: no TPU reachable (no answer within --connect_timeout=5s while "
        "initializing its TPU system)"
    ]
    assert not (tmp_path / "run").exists()


def _fake_tpu(monkeypatch, initialize):
    """TensorFlow's TPU start-up calls, a remote TPU's (its host worker 0 at 10.1.2.3:8470) without one: the
    strategy is the resolver it was given."""
    import tensorflow as tf

    spec = tf.train.ClusterSpec({"worker": ["10.1.2.3:8470"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, master="grpc://10.1.2.3:8470")
    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", lambda tpu: resolver)
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r, make_master_device_default=True: None)
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", initialize)
    monkeypatch.setattr(tf.distribute, "TPUStrategy", lambda r: r)


def _in_a_thread(function):
    """function()'s result (or the error it raised) and the default device its thread was left with: a thread of its
    own, so that a device scope it enters stays there."""
    from tensorflow.python.distribute import device_util

    out = {}

    def run():
        try:
            out["result"] = function()
        except Exception as e:  # noqa: BLE001  (the test reads it)
            out["error"] = e
        out["device"] = device_util.current()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def test_a_remote_tpus_host_is_the_default_device_of_the_thread_that_trains(monkeypatch):
    # TensorFlow enters the master's device scope in the thread that connects, and a device scope is the thread's
    # own: connected in the start-up's thread of its own, the run's ops outside the strategy stayed on the client.
    from engine.cluster import resolvers

    _fake_tpu(monkeypatch, lambda resolver: None)
    settings = Config(strategy="tpu", tpu="grpc://10.1.2.3:8470", connect_timeout=5).cluster
    out = _in_a_thread(lambda: resolvers.tpu_strategy(settings))
    assert "error" not in out, out
    assert out["device"].startswith("/job:worker/replica:0/task:0/")  # the TPU host's, not the client's


def test_a_tpu_that_fails_after_it_answered_names_the_stage(monkeypatch):
    # Every failure read "no TPU reachable", a TPU held by another process too; an InternalError was a traceback.
    import tensorflow as tf

    from engine.cluster import resolvers

    def busy(resolver):
        raise tf.errors.InternalError(None, None, "TPU is already in use by process 4242. More text.")

    _fake_tpu(monkeypatch, busy)
    settings = Config(strategy="tpu", tpu="grpc://10.1.2.3:8470", connect_timeout=5).cluster
    out = _in_a_thread(lambda: resolvers.tpu_strategy(settings))
    assert str(out["error"]) == (
        "--tpu=grpc://10.1.2.3:8470: the TPU failed while initializing its TPU system (TPU is already in use by "
        "process 4242)"
    )


def test_a_tpu_that_hangs_after_it_answered_names_the_stage_it_waited_in(monkeypatch):
    # A timeout read "no answer" whatever the stage: a TPU that resolved and connected, then hung initializing
    # (held by another job), read as one that never answered.
    import time

    from engine.cluster import resolvers

    _fake_tpu(monkeypatch, lambda resolver: time.sleep(5))
    settings = Config(strategy="tpu", tpu="grpc://10.1.2.3:8470", connect_timeout=0.5).cluster
    out = _in_a_thread(lambda: resolvers.tpu_strategy(settings))
    assert str(out["error"]) == (
        "--tpu=grpc://10.1.2.3:8470: no TPU reachable (no answer within --connect_timeout=0.5s while initializing "
        "its TPU system)"
    )


def test_tpu_name_off_google_cloud_is_refused_without_a_traceback(tmp_path):
    result = launch(f"--workdir={tmp_path / 'run'}", "--strategy=tpu", "--tpu=some-name", "--connect_timeout=60")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tpu=some-name: no TPU reachable ("), lines
    assert not (tmp_path / "run").exists()


def test_sigterm_while_connecting_to_a_tpu_ends_the_run(tmp_path):
    """A TPU address that accepts the connection and never answers: the run waits inside TensorFlow, where
    the first SIGTERM must still end it."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        proc = forkserver.popen(
            [
                "launch.py",
                f"--workdir={tmp_path / 'run'}",
                "--strategy=tpu",
                f"--tpu=grpc://127.0.0.1:{port}",
                "--connect_timeout=600",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        silent.settimeout(120)
        connection, _ = silent.accept()  # the run is connecting now
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            connection.close()
    assert proc.returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: preempted: stopped by SIGTERM"), err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_local_tpu_on_a_machine_without_one_is_one_clear_line(tmp_path):
    # It read "the TPU failed while initializing its TPU system (TPUs not found in the cluster)": TensorFlow's words,
    # as if there were a TPU that failed.
    result = launch(f"--workdir={tmp_path / 'run'}", "--strategy=tpu", "--tpu=local", "--train_steps=2")
    assert (result.returncode, result.stderr.strip().splitlines()) == (
        2,
        [
            "error: --tpu=local: this machine has no TPU ('local' is a TPU VM's own); elsewhere give a TPU's name or "
            "grpc://IP:8470"
        ],
    )
    assert not (tmp_path / "run").exists()


def test_mixed_float16_on_a_tpu_is_refused(tmp_path):
    result = launch(f"--workdir={tmp_path}", "--strategy=tpu", "--tpu=local", "--precision=mixed_float16")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --precision=mixed_float16: TPUs compute in bfloat16, not float16: use --precision=mixed_bfloat16"
    ]


@pytest.mark.parametrize("strategy", ["multi_worker", "one_device"])
def test_malformed_tf_config_is_refused_before_tensorflow_is_imported(tmp_path, strategy):
    # A `tensorflow` that cannot be imported: the refusal must come first.
    fake = tmp_path / "fake" / "tensorflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('TensorFlow was imported')\n")
    result = launch(
        f"--workdir={tmp_path / 'run'}",
        f"--strategy={strategy}",
        env={"TF_CONFIG": '{"cluster": {"worker": ["host1:2222"]}', "PYTHONPATH": str(tmp_path / "fake")},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        'error: TF_CONFIG=\'{"cluster": {"worker": ["host1:2222"]}\': not valid JSON '
        "(Expecting ',' delimiter at character 38)"
    ]
    assert not (tmp_path / "run").exists()


def test_empty_tf_config_counts_as_unset(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "")
    strategy = distribute.create_strategy(Config(strategy="mirrored", num_cpu_devices=2).cluster)
    assert strategy.num_replicas_in_sync == 2
    assert "TF_CONFIG" not in os.environ


# A process whose stop flag lives on a parameter server that is gone: setting it raises, as TensorFlow's
# UnavailableError does. The signal must still end the process, and a second one must still be seen.
_UNREACHABLE_FLAG = """
import os, signal, sys, time
sys.path.insert(0, os.getcwd())
from engine.cluster.signals import Signals

class Flag:
    def assign(self, value):
        raise RuntimeError("Unavailable: failed to connect to all addresses\\nmore detail")

watcher = Signals()
watcher.install()
with watcher.watch(Flag()):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
print("the signal was lost", flush=True)
"""


def test_a_stop_flag_that_cannot_be_set_still_ends_the_process():
    result = subprocess.run(
        [sys.executable, "-c", _UNREACHABLE_FLAG], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 75, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "error: preempted: stopped by SIGTERM, but the training loop cannot be told to stop at a step (setting its "
        "stop flag failed: Unavailable: failed to connect to all addresses): exiting without saving"
    ]
    assert result.stdout == ""


# What a local cluster's task does, without TensorFlow: in the launcher's namespace, listen on every interface
# as TensorFlow's servers do, and reach itself on loopback as the tasks reach each other.
_IN_THE_NAMESPACE = """
import ctypes, encodings.idna, os, socket, sys  # all before the user changes: the stdlib may be its owner's alone
sys.path.insert(0, os.getcwd())
from engine.cluster import launcher
if sys.argv[1] == "nobody":  # what a laptop's user is: no privilege at all
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE, as a process started by that user is (setuid cleared it)
launcher.isolate_network()
server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
port = server.getsockname()[1]
socket.create_connection(("127.0.0.1", port), timeout=5).close()
print(port, os.getuid(), flush=True)
sys.stdin.read()  # listens until the test has looked
"""


def test_the_local_clusters_network_namespace_holds_only_loopback():
    # As root, also as an unprivileged user and as a container's root (no CAP_SYS_ADMIN): both need a user namespace.
    without_sys_admin = ["setpriv", "--bounding-set=-sys_admin"]
    users = {"as-is": []} | (
        {"nobody": [], "root without CAP_SYS_ADMIN": without_sys_admin} if os.geteuid() == 0 else {}
    )
    for user, prefix in users.items():
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", _IN_THE_NAMESPACE, user],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stdout.readline()
            assert line, proc.communicate()[1][-2000:]
            port, uid = (int(word) for word in line.split())
            assert uid == (65534 if user == "nobody" else os.geteuid())  # the same user inside, not a mapped root
            assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            in_a_user_namespace = os.readlink(f"/proc/{proc.pid}/ns/user") != os.readlink("/proc/self/ns/user")
            assert in_a_user_namespace == (user != "as-is" or os.geteuid() != 0), user  # root needs none
            assert listening_ports(proc.pid, seen_from=proc.pid) == {"[::]": port}
            assert listening_ports(proc.pid) == {}  # this namespace, the machine's, has no such socket
        finally:
            proc.communicate("")
        assert proc.returncode == 0


def test_a_local_cluster_that_cannot_have_a_network_of_its_own_is_refused(tmp_path):
    """No user namespace left to make (the limit set to 0) and no CAP_SYS_ADMIN, as in a container that forbids
    both: the launcher says so in one line and starts nothing."""
    forbid = 'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-sys_admin "$@"'
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", forbid, "sh", sys.executable, "launch.py"]
        + [f"--workdir={tmp_path / 'run'}", "--strategy=multi_worker", "--local_workers=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "error: --local_cluster_network=loopback: cannot give the local cluster a network of its own (unshare: no "
        "user namespace left to make; sysctl user.max_user_namespaces limits them); --local_cluster_network=host "
        "runs it on this machine's network, where its servers listen on every interface without authentication: "
        "use that only on a trusted network"
    ]
    assert result.stdout == ""  # no task started
    assert not (tmp_path / "run").exists()


def test_an_unknown_local_cluster_network_is_refused():
    with pytest.raises(ConfigError, match=r"^--local_cluster_network=wifi: must be one of loopback, host$"):
        validate(Config(local_cluster_network="wifi"))
