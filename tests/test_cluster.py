"""Cluster scale: the local launcher, parameter servers, Slurm, unreachable peers, TPU start-up and XLA."""

import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from engine.cluster import distribute, launcher
from engine.cluster.resolvers import NOT_FORMED_EXIT_CODE, PeerLost
from engine.cluster.schedulers import SLURM_VARIABLES
from engine.cluster.signals import LOST_PEER_EXIT_CODE
from engine.run import build, inputs, loop
from engine.settings.config import validate
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from engine.state import checkpoint
from tests import forkserver, helpers
from tests.helpers import ROOT, launch


def final_tensors(workdir):
    return {k: v for k, v in helpers.checkpoint_tensors(workdir)[1].items() if k.startswith("models/")}


@pytest.mark.slow
def test_launcher_runs_two_workers_that_match_one_device(data_dir, tmp_path):
    settings = dict(
        data_dir=data_dir,
        deterministic=True,
        train_steps=20,  # within float rounding of one device; later a ReLU crossing zero amplifies it
        steps_per_loop=10,
        hidden_sizes=(64, 64),
        clip_norm=0.5,
        connect_timeout=120,
    )
    args = helpers.as_flags(settings)
    cluster = launch(f"--workdir={tmp_path / 'two'}", "--strategy=multi_worker", "--local_workers=2", *args)
    assert cluster.returncode == 0, cluster.stdout[-3000:]
    lines = cluster.stdout.splitlines()
    assert any(line.startswith("[worker 0] train step=20") for line in lines)
    assert any(line.startswith("[worker 1] train step=20") for line in lines)
    assert lines[-1] == "[launcher] job finished with exit code 0"
    # The one-device reference trains in this process: launch.py's Config and strategy for the same flags.
    helpers.in_process_run({**settings, "workdir": str(tmp_path / "one"), "strategy": "one_device"})
    a, b = final_tensors(tmp_path / "two"), final_tensors(tmp_path / "one")
    assert a.keys() == b.keys() and len(a) == 6
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) < 1e-5
    summaries = [json.load(open(tmp_path / d / "summary.json")) for d in ("two", "one")]
    assert summaries[0]["num_replicas"] == 2 and summaries[0]["eval"]["examples"] == 360
    assert summaries[0]["eval"]["accuracy"] == pytest.approx(summaries[1]["eval"]["accuracy"], abs=1e-9)


@pytest.mark.slow
def test_launcher_stops_the_job_when_a_worker_fails(data_dir, tmp_path):
    # Worker 1's TF_CONFIG is fine, but its workdir cannot be written: it fails, the launcher stops worker 0.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = launch(
        f"--workdir={blocker}/run",
        f"--data_dir={data_dir}",
        "--strategy=multi_worker",
        "--local_workers=2",
        "--connect_timeout=60",
        timeout=300,
    )
    assert result.returncode != 0
    assert re.search(r"\[launcher\] worker \d exited with \d+; stopping the others", result.stdout)
    assert "cannot write there" in result.stdout


@pytest.mark.slow
def test_parameter_servers_train_to_one_device_accuracy_and_survive_a_dead_worker(data_dir, one_device, tmp_path):
    args = ["--train_steps=400", "--steps_per_loop=100", "--hidden_sizes=256,256", f"--data_dir={data_dir}"]
    proc = forkserver.popen(
        [
            "launch.py",
            f"--workdir={tmp_path / 'ps'}",
            "--strategy=parameter_server",
            "--local_workers=2",
            "--num_ps=1",
            "--connect_timeout=120",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, victim = [], None
    for line in proc.stdout:
        output.append(line)
        pid = re.match(r"\[launcher\] worker 1 pid (\d+)", line)
        if pid:
            victim = int(pid.group(1))
        if victim and line.startswith("[chief 0] train step=200"):
            os.kill(victim, signal.SIGKILL)  # mid-run: the coordinator moves its work to worker 0
    proc.wait(timeout=60)
    text = "".join(output)
    assert proc.returncode == 0, text[-3000:]
    assert "[launcher] worker 1 exited with -9; the job goes on without it" in text
    # The servers stopped at the end are no preempted runs: no task ends on the engine's `error:` line. (The chief
    # may log the killed worker's refused connection, "... last error: UNKNOWN: ...", when a call to it was under
    # way: that is the failure the coordinator recovers from, not one of the run's.)
    assert re.findall(r"^(?:\[[^\]]*\] )?error:.*", text, re.MULTILINE) == []
    assert "cluster_coordinator.py" not in text  # the coordinator's logs of the calls that failed (distribute.py)
    summary = json.load(open(tmp_path / "ps" / "summary.json"))
    assert summary["step"] == 400 and summary["strategy"] == "parameter_server"
    reader = tf.train.load_checkpoint(checkpoint.list_checkpoints(tmp_path / "ps" / "checkpoints")[0])
    # assign_add on the servers: no update lost between the asynchronous workers. The killed worker's function in
    # flight runs again on worker 0 (TensorFlow's at least once): the updates it applied before it died apply twice,
    # a few steps (functions of 100 // (4 * 2) = 12; docs/cluster.md). The step count stays the chief's: it read 401
    # and more where the re-run function's increments counted twice, and a rerun of the command was then refused.
    assert 400 <= reader.get_tensor("optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE") < 400 + 2 * 12
    assert reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 400
    assert reader.get_tensor("batches/.ATTRIBUTES/VARIABLE_VALUE") == 400
    config = helpers.make_config(
        data_dir,
        str(tmp_path / "one"),
        train_steps=400,
        steps_per_loop=100,
        hidden_sizes=(256, 256),
        global_batch_size=128,
    )
    reference = loop.train(config, one_device)
    print(f"parameter servers {summary['eval']['accuracy']:.4f}, one device {reference['eval']['accuracy']:.4f}")
    assert abs(summary["eval"]["accuracy"] - reference["eval"]["accuracy"]) <= 0.02


# A task of a parameter-server job, without TensorFlow: it serves (sleeps) until stopped, dies at once, or
# exits with a code after a second, as its job's role in argv says ("ps 0=die", "chief 0=5"). A signal it is
# sent is written to $SIGNALLED before it exits, as a preempted task prints its error line.
_FAKE_TASK = """
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']} {task['index']}"
role = dict(arg.split("=") for arg in sys.argv[1:]).get(name, "serve")

def stopped(signum, frame):
    with open(os.environ["SIGNALLED"], "a") as f:
        f.write(f"{name} {signal.Signals(signum).name}\\n")
    sys.exit(75)

signal.signal(signal.SIGTERM, stopped)
signal.signal(signal.SIGINT, stopped)
if role == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if role == "serve":
    time.sleep(600)
time.sleep(1)
sys.exit(int(role))
"""


def run_fake_job(tmp_path, monkeypatch, *roles, strategy="parameter_server", workers=1):
    """launcher.run on a job of fake tasks (a parameter-server job of one worker and one server by default), on this
    machine's network (the namespace would be this test process's); returns its code, the launcher's own lines and
    the signals its tasks were sent."""
    monkeypatch.setenv("SIGNALLED", str(tmp_path / "signalled"))
    out = io.StringIO()
    argv = [sys.executable, "-c", _FAKE_TASK, *roles]
    code = launcher.run(strategy, workers, 1, argv, out=out, network="host")
    lines = [line for line in out.getvalue().splitlines() if line.startswith("[launcher]") and " pid " not in line]
    signalled = (tmp_path / "signalled").read_text().splitlines() if (tmp_path / "signalled").exists() else []
    assert lines[0].startswith(
        "[launcher] note: --local_cluster_network=host: TensorFlow's servers listen on every network interface "
        "without authentication (ports "
    ), lines
    return code, lines[1:], signalled


def test_a_parameter_server_job_ends_without_signalling_its_servers(tmp_path, monkeypatch):
    """Once the chief is done the servers hold nothing to save: ended by SIGKILL, not by a signal that has each
    report a preemption (three `error: preempted` lines after a job that succeeded)."""
    code, lines, signalled = run_fake_job(tmp_path, monkeypatch, "chief 0=0")
    assert (code, lines, signalled) == (0, ["[launcher] job finished with exit code 0"], [])


def test_a_dead_parameter_server_leaves_the_chief_to_say_so(tmp_path, monkeypatch):
    """The chief, which loses its variables with the server, exits 5 naming it: that is the job's code, not the
    server's 137 (SIGKILL's, which a scheduler reads as out of memory)."""
    code, lines, signalled = run_fake_job(tmp_path, monkeypatch, "ps 0=die", "chief 0=5")
    assert code == 5
    assert lines == [
        "[launcher] ps 0 exited with -9; the chief stops too",
        "[launcher] chief 0 exited with 5; stopping the others",
        "[launcher] job finished with exit code 5",
    ]
    assert signalled == []
    # A chief that does not stop: after the grace period the launcher stops it, with the server's code.
    monkeypatch.setattr(launcher, "GRACE_SECONDS", 1)
    code, lines, signalled = run_fake_job(tmp_path, monkeypatch, "ps 0=die")
    assert code == 137
    assert lines == [
        "[launcher] ps 0 exited with -9; the chief stops too",
        "[launcher] the chief did not stop within 1 s of losing a server; stopping it",
        "[launcher] job finished with exit code 137",
    ]
    assert signalled == ["chief 0 SIGTERM"]


def test_a_tf_config_the_shell_left_set_is_said_not_read(tmp_path, monkeypatch):
    # Each task gets its own; the launcher did not say so, and refused the one it inherited for its faults.
    monkeypatch.setenv("TF_CONFIG", "garbage")
    code, lines, signalled = run_fake_job(tmp_path, monkeypatch, "chief 0=0")
    assert (code, lines, signalled) == (
        0,
        [
            "[launcher] this environment's TF_CONFIG is not read: each task gets its own, of this cluster",
            "[launcher] job finished with exit code 0",
        ],
        [],
    )


# The launcher in a process of its own, its tasks the fake ones above, each stopped as the launcher ends.
_LAUNCHER = """
import signal, sys
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal starts it: a suite run under nohup ignores SIGHUP
sys.path.insert(0, {root!r})
from engine.cluster import launcher
launcher.GRACE_SECONDS = 1  # what a server waits for the chief to save, as the launcher ends
task = "import sys; sys.path.insert(0, {root!r}); from engine.cluster import launcher\\n"
task += "getattr(launcher, 'end_with_the_launcher', int)()  # the old launcher's tasks stayed, as a test of it shows"
sys.exit(launcher.run("parameter_server", 1, 1, [sys.executable, "-c", task + "\\n" + {task!r}], network="host"))
"""


@pytest.mark.parametrize("ending", ["SIGKILL", "SIGHUP"])
def test_no_task_outlives_its_launcher_however_it_ends(tmp_path, monkeypatch, ending):
    # A launcher killed, or sent SIGHUP as its terminal closed, left its tasks running forever (parent pid 1).
    monkeypatch.setenv("SIGNALLED", str(tmp_path / "signalled"))
    program = _LAUNCHER.format(root=helpers.ROOT, task=_FAKE_TASK)
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    pids = [int(proc.stdout.readline().split(" pid ")[1].split()[0]) for _ in range(3)]  # chief, worker, ps
    time.sleep(1)  # each task past its start-up
    try:
        if ending == "SIGHUP":
            proc.stdout.close()  # the terminal is gone: the launcher's lines have no reader
        proc.send_signal(getattr(signal, ending))
        code = proc.wait(30)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _running(pid)]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    signalled = sorted((tmp_path / "signalled").read_text().splitlines())
    if ending == "SIGKILL":  # each task stopped as a preemption
        assert (code, signalled) == (-9, ["chief 0 SIGTERM", "ps 0 SIGTERM", "worker 0 SIGTERM"])
    else:  # a preemption of the chief, which saves; the servers, with nothing to save, ended after it
        assert (code, signalled) == (75, ["chief 0 SIGTERM"])


def _running(pid):
    """Whether process `pid` runs (a zombie, ended and not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_parameter_server_job_without_a_worker_left_ends(tmp_path, monkeypatch):
    # Every worker dead: the chief waited for one forever, and one signal could not stop it.
    code, lines, signalled = run_fake_job(tmp_path, monkeypatch, "worker 0=die")
    assert code == LOST_PEER_EXIT_CODE
    assert lines == [
        "[launcher] worker 0 exited with -9; the job goes on without it",
        "[launcher] every worker exited: the chief cannot train without one; stopping it",
        "[launcher] job finished with exit code 5",
    ]
    assert signalled == ["chief 0 SIGTERM"]


def test_a_worker_preempted_before_the_cluster_formed_has_the_others_preempted_too(tmp_path, monkeypatch):
    # It could not tell its peers, which waited --connect_timeout (300 s) for it and ended the job with exit 10.
    monkeypatch.setattr(launcher, "GRACE_SECONDS", 1)
    code, lines, signalled = run_fake_job(tmp_path, monkeypatch, "worker 1=75", strategy="multi_worker", workers=2)
    assert code == 75
    assert lines == [
        "[launcher] worker 0 still running 1 s after a preempted peer; SIGINT",
        "[launcher] job finished with exit code 75",
    ]
    assert signalled == ["worker 0 SIGINT"]


def test_a_lost_parameter_server_is_named(monkeypatch):
    spec = {"chief": ["localhost:1000"], "worker": ["localhost:1001"], "ps": ["localhost:1002"]}
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    # The chief's ParameterServerStrategy, without connecting to a cluster: it keeps its resolver to itself, and
    # its `cluster_resolver` (the extended strategy's) is None.
    strategy = tf.distribute.ParameterServerStrategy.__new__(tf.distribute.ParameterServerStrategy)
    strategy._cluster_resolver, strategy._extended = resolver, types.SimpleNamespace()
    assert strategy.cluster_resolver is None and distribute.is_parameter_server(strategy)
    error = tf.errors.UnavailableError(
        None,
        None,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1002: Connection refused\n"
        "Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling "
        "/tensorflow.eager.EagerService/Enqueue:",
    )
    config = Config(strategy="parameter_server", collective_timeout=5).cluster
    lost = distribute.explain_failure(strategy, config, error)
    assert str(lost) == (
        "lost ps 0 (localhost:1002): failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1002: "
        "Connection refused; a peer that dies or is silent for --collective_timeout=5s stops the job; restart every "
        "task of the job to resume from the last checkpoint"
    )
    assert isinstance(lost, PeerLost)
    # Raised outside the steps (the chief reading a variable from the server): the same, for launch.py's exit 5.
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}))
    assert str(distribute.lost_peer(config, error)) == str(lost)
    assert distribute.lost_peer(config, ValueError("not a peer's")) is None
    # Several at once: their count said nothing ("lost ps 0 (...): 2 root error(s) found.; a peer that ...").
    several = tf.errors.UnavailableError(None, None, f"2 root error(s) found.\n  (0) UNAVAILABLE: {error.message}")
    said = str(lost).replace("(localhost:1002): ", "(localhost:1002): UNAVAILABLE: ")
    assert str(distribute.explain_failure(strategy, config, several)) == said


def test_a_parameter_server_lost_during_a_save_is_a_lost_peer_not_a_full_disk(
    data_dir, one_device, tmp_path, monkeypatch
):
    """A server killed while the chief saved ended the job with `error: cannot write checkpoint for step 16 to ...:
    Graph execution error:` and exit 4 (fix the storage), not exit 5 naming the server (restart every task)."""
    from engine.run import build

    spec = {"chief": ["localhost:1000"], "worker": ["localhost:1001"], "ps": ["localhost:1002"]}
    checkpoints = checkpoint.Checkpoints(build.run(helpers.make_config(data_dir), one_device).state, str(tmp_path), 1)
    # What the chief's save raised as ps 0 was SIGKILLed (its message as TensorFlow 2.21 wrote it, trimmed).
    remote = "Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling /x:"
    lost = tf.errors.UnavailableError(
        None,
        None,
        "Graph execution error:\n\nDetected at node SaveV2/_7 defined at (most recent call last):\n"
        f"<stack traces unavailable>\n2 root error(s) found.\n  (0) UNAVAILABLE:  Socket closed\n{remote}\n"
        f"  (1) UNAVAILABLE:  Socket closed\n{remote}\n0 successful operations.",
    )

    def save(error):
        def raising(checkpoint_number):
            raise error

        monkeypatch.setattr(checkpoints.manager, "save", raising)
        checkpoints.save()

    with pytest.raises(tf.errors.UnavailableError):  # not CheckpointError, which launch.py ends with exit 4
        save(lost)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}))
    config = Config(strategy="parameter_server", collective_timeout=5).cluster
    assert str(distribute.lost_peer(config, lost)) == (  # launch.py's line for it, exit 5
        "lost ps 0 (localhost:1002): UNAVAILABLE:  Socket closed; a peer that dies or is silent for "
        "--collective_timeout=5s stops the job; restart every task of the job to resume from the last checkpoint"
    )
    # The storage's own failures stay the storage's, a server's shard's included.
    full = tf.errors.ResourceExhaustedError(None, None, f"No space left on device\n{remote}")
    with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoint for step 0 to .*No space left"):
        save(full)
    with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoint for step 0 to .*Unavailable"):
        save(tf.errors.UnavailableError(None, None, "Unavailable: the bucket did not answer"))


# A chief whose Python lock a native call holds (TensorFlow removing a retraced save function from every task of the
# cluster, as each checkpoint of a parameter-server job does, waits for a stopped worker with it held), as a
# silent peer (a socket that accepts and never answers) stays silent.
_HELD_CHIEF = """
import ctypes, socket, sys, time
sys.path.insert(0, {root!r})
import tensorflow as tf
from engine.cluster import resolvers
silent = socket.socket()
silent.bind(("127.0.0.1", 0))
silent.listen(8)  # the kernel accepts its connections; nothing ever answers them
address = "127.0.0.1:%d" % silent.getsockname()[1]
resolvers.watch_servers(tf.train.ClusterSpec({{"worker": [address]}}), 1.0)
print("holding", flush=True)
ctypes.PyDLL(None).sleep(30)  # a native call that keeps Python's lock, as TensorFlow's remove_function does
print("never here: the watch waited for the lock", flush=True)
"""


def test_a_silent_peer_ends_a_chief_whose_python_lock_is_held():
    """A worker stopped as the chief saved a checkpoint held the job for as long as it stayed stopped (40 s of 40
    with --collective_timeout=10): the watch was a Python thread, which cannot run while TensorFlow holds the lock."""
    proc = subprocess.run(
        [sys.executable, "-c", _HELD_CHIEF.format(root=ROOT)], capture_output=True, text=True, timeout=120
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == LOST_PEER_EXIT_CODE, proc.stdout + proc.stderr[-2000:]
    assert "holding" in proc.stdout and "never here" not in proc.stdout
    assert re.match(r"error: lost worker 0 \(127\.0\.0\.1:\d+\): no answer within --collective_timeout=1s", lines[-1])
    # Ended inside the native call that holds Python's lock (no "never here"), not after it: the watch is no Python
    # thread of the chief's. Not timed: a loaded machine takes longer than the call to import TensorFlow.


@pytest.mark.parametrize("strategy, job", [("multi_worker", "worker"), ("parameter_server", "ps")])
def test_a_task_whose_port_is_taken_is_one_line(tmp_path, strategy, job):
    """A TF_CONFIG naming a port another process holds ended in TensorFlow's traceback, exit 1:
    `tensorflow.python.framework.errors_impl.UnknownError: Could not start gRPC server`."""
    ports = helpers.free_ports(3)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", ports[0]))
        taken.listen(1)
        if strategy == "multi_worker":
            spec = {"worker": [f"localhost:{ports[0]}", f"localhost:{ports[1]}"]}
        else:
            spec = {
                "chief": [f"localhost:{ports[1]}"],
                "worker": [f"localhost:{ports[2]}"],
                job: [f"localhost:{ports[0]}"],
            }
        env = {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": job, "index": 0}})}
        result = launch(f"--workdir={tmp_path / 'run'}", f"--strategy={strategy}", "--connect_timeout=30", env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {job} 0 could not listen on localhost:{ports[0]}, its address in the cluster (Could not start gRPC "
        f"server): is port {ports[0]} in use by another process? Give this task a free port"
    )
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()  # nothing in the workdir touched


@pytest.mark.slow
def test_a_hung_parameter_server_ends_the_job_within_the_collective_timeout(tmp_path):
    """A stopped server fails no RPC: without a probe the chief waits for it forever."""
    proc = forkserver.popen(
        ["launch.py", f"--workdir={tmp_path}", "--strategy=parameter_server", "--local_workers=1"]
        + ["--num_ps=1", "--dataset=synthetic", "--hidden_sizes=8", "--train_steps=100000", "--steps_per_loop=50"]
        + ["--collective_timeout=5", "--connect_timeout=120"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids, addresses, output = {}, {}, []

    def kill_all():  # the tasks run in sessions of their own: the launcher's end does not end them
        for pid in [*pids.values(), proc.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    deadline = threading.Timer(180, kill_all)  # a job that hangs fails here instead of hanging the suite
    deadline.start()
    try:
        for line in proc.stdout:
            output.append(line)
            started = re.match(r"\[launcher\] (\w+ \d) pid (\d+) on (\S+)", line)
            if started:
                pids[started.group(1)], addresses[started.group(1)] = int(started.group(2)), started.group(3)
            if line.startswith("[chief 0] train step=") and "stopped" not in pids:
                os.kill(pids["ps 0"], signal.SIGSTOP)
                pids["stopped"] = pids["ps 0"]
        proc.wait(timeout=60)
    finally:
        deadline.cancel()
        kill_all()
    text = "".join(output)
    assert proc.returncode == LOST_PEER_EXIT_CODE == 5, text[-3000:]
    lines = text.splitlines()
    assert (
        f"[chief 0] error: lost ps 0 ({addresses['ps 0']}): no answer within --collective_timeout=5s (a stopped "
        "process or a host cut off); a peer that dies or is silent that long stops the job; restart every task of "
        "the job to resume from the last checkpoint"
    ) in lines
    assert lines[-2:] == [
        "[launcher] chief 0 exited with 5; stopping the others",
        "[launcher] job finished with exit code 5",
    ]
    assert "preempted" not in text


SLURM = {"SLURM_STEP_NODELIST": "gpu-node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"}


@pytest.fixture(autouse=True)
def _not_a_slurm_task(monkeypatch):
    """Tests run inside a Slurm job (a cluster's CI) see its own task's node and local index: the fake steps here
    name theirs, or none."""
    for name in ("SLURMD_NODENAME", "SLURM_LOCALID", "SLURM_DISTRIBUTION"):
        monkeypatch.delenv(name, raising=False)


def test_slurm_allocation_resolves_to_the_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {**SLURM, "SLURM_PROCID": "3"}.items():
        monkeypatch.setenv(name, value)
    resolver = distribute.cluster_resolver(
        Config(strategy="multi_worker", cluster_resolver="slurm", slurm_port_base=9000).cluster
    )
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["gpu-node07:9000", "gpu-node07:9001", "gpu-node08:9000", "gpu-node08:9001"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    ps_job = Config(strategy="parameter_server", cluster_resolver="slurm", num_ps=1)
    resolver = distribute.cluster_resolver(ps_job.cluster)
    assert {job: len(tasks) for job, tasks in resolver.cluster_spec().as_dict().items()} == {
        "chief": 1,
        "ps": 1,
        "worker": 2,
    }


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_PROCID": "abc"}, "SLURM_PROCID='abc' is not a whole number"),
        ({"SLURM_PROCID": "5"}, "SLURM_PROCID='5' is not a task's rank, below SLURM_STEP_NUM_TASKS=4"),
        ({"SLURM_STEP_NUM_TASKS": "x"}, "SLURM_STEP_NUM_TASKS='x' is not a whole number"),
        ({"SLURM_STEP_NODELIST": "node[a-b]"}, "SLURM_STEP_NODELIST='node[a-b]' is not a node list"),
    ],
)
def test_slurm_variables_slurm_would_not_set_are_one_line(monkeypatch, change, message):
    # Each was a traceback (ValueError, UnboundLocalError) and exit 1.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {**SLURM, "SLURM_PROCID": "0", **change}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(f"--cluster_resolver=slurm: {message}")):
        distribute.cluster_resolver(Config(strategy="multi_worker", cluster_resolver="slurm").cluster)
    for name, value in {**SLURM, "SLURM_PROCID": "0"}.items():  # a port past 65535: refused, not a timeout
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape("--slurm_port_base=65535: with 2 tasks on a node their ports run")):
        distribute.cluster_resolver(
            Config(strategy="multi_worker", cluster_resolver="slurm", slurm_port_base=65535).cluster
        )


def test_slurm_outside_srun_is_a_clear_error(monkeypatch):
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="--cluster_resolver=slurm: SLURM_PROCID is not set; run the job under srun"):
        distribute.cluster_resolver(Config(strategy="multi_worker", cluster_resolver="slurm").cluster)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"cluster_resolver": "kubernetes", "kubernetes_selector": "job=train"},
            "--cluster_resolver=kubernetes: reads one job of worker pods; --strategy=parameter_server needs chief, "
            "worker and ps jobs: give them in TF_CONFIG (a TFJob sets it)",
        ),
        (
            {"jit_compile": "true"},
            "--jit_compile=true: cannot compile the step with --strategy=parameter_server: an XLA program cannot read "
            "the variables on parameter servers (--jit_compile=auto compiles nothing there)",
        ),
        (
            {"deterministic": True},
            "--deterministic=true: cannot make --strategy=parameter_server reproducible: its workers apply their "
            "updates asynchronously, in the order they finish, so the same flags give other numbers each run; drop "
            "--deterministic, or use --strategy=multi_worker (synchronous)",
        ),
    ],
)
def test_a_parameter_server_job_refuses_what_it_cannot_run_before_tensorflow_starts(monkeypatch, settings, message):
    # Kubernetes' pods are one job of workers: TensorFlow said "There must be at least one ps."; an XLA program read
    # a parameter server's variable and failed inside the coordinator's first round; --deterministic was accepted,
    # and two runs of the same flags on two workers ended at other losses (0.84205, 0.8348).
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ConfigError) as refused:
        validate(Config(strategy="parameter_server", **settings))
    assert str(refused.value) == message


@pytest.mark.parametrize("jobs", [("chief", "worker"), ("chief", "ps"), ("worker", "ps")])
def test_a_parameter_server_tf_config_without_each_of_its_jobs_is_refused_naming_them(monkeypatch, jobs):
    # One without a worker job reached TensorFlow's "There must be at least one worker." as a traceback.
    tf_config = {"cluster": {job: [f"h:{i + 1}"] for i, job in enumerate(jobs)}, "task": {"type": jobs[0], "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    with pytest.raises(ConfigError) as refused:
        distribute.cluster_resolver(Config(strategy="parameter_server").cluster)
    assert str(refused.value).endswith(": --strategy=parameter_server needs 'chief', 'worker' and 'ps' jobs")


def _fake_kubernetes(monkeypatch, tmp_path, listings):
    """The kubernetes client as a pod sees it, its API answering each listing of pods with the next of `listings`
    ([(name, phase, ip)] each; the last one again after that); returns the selectors and namespaces it was asked."""
    import types

    from engine.cluster import schedulers

    asked = []

    def pod(name, phase, ip):
        return types.SimpleNamespace(
            metadata=types.SimpleNamespace(name=name, deletion_timestamp=None),
            status=types.SimpleNamespace(phase=phase, pod_ip=ip),
        )

    class CoreV1Api:
        def list_namespaced_pod(self, namespace, label_selector):
            asked.append((namespace, label_selector))
            pods = listings[min(len(asked), len(listings)) - 1]
            return types.SimpleNamespace(items=[pod(*p) for p in pods])

    config = types.SimpleNamespace(load_incluster_config=lambda: None, ConfigException=type("E", (Exception,), {}))
    client = types.SimpleNamespace(CoreV1Api=CoreV1Api, ApiException=type("A", (Exception,), {}))
    monkeypatch.setitem(sys.modules, "kubernetes", types.SimpleNamespace(config=config, client=client))
    (tmp_path / "namespace").write_text("team\n")
    monkeypatch.setattr(schedulers, "NAMESPACE_FILE", str(tmp_path / "namespace"))
    monkeypatch.setattr(schedulers, "_POLL_SECONDS", 0.01)
    monkeypatch.setattr(schedulers, "_PODS", {})
    return asked


def test_kubernetes_pods_resolve_to_the_cluster_once_every_one_runs(monkeypatch, tmp_path):
    # TensorFlow's KubernetesClusterResolver left the task's type and index None: MultiWorkerMirroredStrategy refused
    # to start ("you must also specify task_type and task_id") on every pod.
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("HOSTNAME", "train-worker-1")
    # A worker preempted and replaced: its pod stays, Failed, beside the new one, and is no task of the job.
    starting = [("train-worker-1", "Running", "10.0.0.7"), ("train-worker-0", "Pending", None)]
    running = [*starting[:1], ("train-worker-0", "Running", "10.0.0.5"), ("train-worker-0-old", "Failed", "10.0.0.2")]
    asked = _fake_kubernetes(monkeypatch, tmp_path, [starting, running])
    settings = Config(
        strategy="multi_worker", cluster_resolver="kubernetes", kubernetes_selector="job=train", connect_timeout=5
    ).cluster
    resolver = distribute.cluster_resolver(settings)
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.5:2222", "10.0.0.7:2222"]}  # by pod name
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert asked == [("team", "job=train")] * 2  # listed again until both ran; once in the process after that
    assert distribute.cluster_resolver(settings).task_id == 1 and len(asked) == 2


@pytest.mark.parametrize(
    "pods, hostname, settings, message",
    [
        (
            [("w-0", "Pending", None)],
            "w-0",
            {},
            "--kubernetes_selector=job=train: the cluster did not form within --connect_timeout=0.05s: w-0 not running",
        ),
        (
            [("w-0", "Running", "10.0.0.5")],
            "other-pod",
            {},
            "--kubernetes_selector=job=train: selects the pods w-0, not this one (other-pod): give the selector of "
            "this job's worker pods",
        ),
    ],
)
def test_kubernetes_pods_that_cannot_make_the_cluster_are_one_line(
    monkeypatch, tmp_path, pods, hostname, settings, message
):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("HOSTNAME", hostname)
    _fake_kubernetes(monkeypatch, tmp_path, [pods])
    from engine.cluster import schedulers

    monkeypatch.setattr(schedulers, "_own_address", lambda: "10.9.9.9")
    given = {"strategy": "multi_worker", "connect_timeout": 0.05, **settings}
    config = Config(cluster_resolver="kubernetes", kubernetes_selector="job=train", **given)
    with pytest.raises(ConfigError) as refused:
        distribute.cluster_resolver(config.cluster)
    assert str(refused.value) == message


@pytest.mark.slow
@pytest.mark.parametrize("present", [0, 1])
def test_unreachable_peer_is_named_within_the_connect_timeout(tmp_path, present):
    ports = helpers.free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": present}})
    started = time.monotonic()
    result = launch(
        f"--workdir={tmp_path}",
        "--strategy=multi_worker",
        "--connect_timeout=8",
        "--dataset=synthetic",
        timeout=120,
        env={"TF_CONFIG": tf_config},
    )
    print(f"unreachable peer reported after {time.monotonic() - started:.1f} s")
    # Its own code: not 137, which a scheduler reads as an out-of-memory kill.
    assert result.returncode == NOT_FORMED_EXIT_CODE == 10, result.stderr[-2000:]
    missing = 1 - present
    assert (
        f"error: could not form the cluster within --connect_timeout=8s: no answer from worker {missing} "
        f"(localhost:{ports[missing]})"
    ) in result.stderr


def test_tpu_start_up_sequence(monkeypatch):
    calls = []

    class FakeResolver:
        def __init__(self, tpu):
            calls.append(("resolve", tpu))

        def master(self):  # a TPU VM's own
            return ""

        def cluster_spec(self):
            return tf.train.ClusterSpec({})

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", FakeResolver)
    monkeypatch.setattr(
        tf.config, "experimental_connect_to_cluster", lambda r, **options: calls.append(("connect", type(r)))
    )
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", lambda r: calls.append(("initialize", type(r))))
    monkeypatch.setattr(tf.distribute, "TPUStrategy", lambda r: calls.append(("strategy", type(r))) or "strategy")
    assert distribute.create_strategy(Config(strategy="tpu", tpu="my-tpu").cluster) == "strategy"
    assert calls == [
        ("resolve", "my-tpu"),
        ("connect", FakeResolver),
        ("initialize", FakeResolver),
        ("strategy", FakeResolver),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "resnet", "transformer"])
def test_every_step_function_compiles_with_xla(data_dir, one_device, model):
    """What a TPU runs: the whole replica step (all-reduce and update included) and the eval step, each one XLA
    computation with static shapes and no Python side effects."""
    trainer = build.run(helpers.make_config(data_dir, model=model, clip_norm=1.0), one_device)
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    train = tf.function(trainer.program.train_step, jit_compile=True)
    assert "HloModule" in train.experimental_get_compiler_ir(batch)(stage="hlo")
    evaluate = tf.function(trainer.evaluator.eval_step, jit_compile=True)
    weighted = {**batch, "weight": tf.ones([batch["image"].shape[0]])}
    assert "HloModule" in evaluate.experimental_get_compiler_ir(weighted)(stage="hlo")
    out = one_device.run(tf.function(train), args=(batch,))
    assert bool(out["finite"]) and int(trainer.plans[0].optimizer.iterations.numpy()) == 1


def test_tf_data_service_serves_the_same_batches(data_dir):
    dispatcher = tf.data.experimental.service.DispatchServer()
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=dispatcher.target.split("://")[1])
    )
    try:
        config = helpers.make_config(data_dir)
        direct = [b["image"].numpy() for b in inputs.run_data(config).train_fn(tf.distribute.InputContext()).take(5)]
        served_config = dataclasses.replace(config, tf_data_service=dispatcher.target)
        served = [
            b["image"].numpy() for b in inputs.run_data(served_config).train_fn(tf.distribute.InputContext()).take(5)
        ]
        # The service's workers read the files, not this process: its summary's input_bytes_read said 0, as if a
        # streamed split had been read for nothing. None: not counted here.
        assert build.run(served_config, tf.distribute.OneDeviceStrategy("/cpu:0")).program.counts_bytes is False
        assert build.run(config, tf.distribute.OneDeviceStrategy("/cpu:0")).program.counts_bytes is True
    finally:
        # The worker first: left to garbage collection, the dispatcher could go first, and a worker stopping
        # without its dispatcher hung the test process (seen once in WorkerServer.__del__, TensorFlow 2.21).
        worker._stop()
        dispatcher._stop()
    assert sorted(b.tobytes() for b in served) == sorted(b.tobytes() for b in direct)


def test_tf_data_service_serves_each_run_its_own_batches_from_its_own_start(data_dir):
    """Two runs through one dispatcher, one after the other: each reads its own stream from its own position. (Both
    named their job train-0-0-0: the second joined the first's job and trained on its batches, from where it
    stopped: another seed's, or another dataset's.)"""
    dispatcher = tf.data.experimental.service.DispatchServer()
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=dispatcher.target.split("://")[1])
    )
    try:
        read = {}
        for seed in (1, 2):
            config = helpers.make_config(data_dir, seed=seed, tf_data_service=dispatcher.target)
            batches = inputs.run_data(config).train_fn(tf.distribute.InputContext()).take(2)
            read[seed] = [(b["index"].numpy(), b["image"].numpy()) for b in batches]
        direct = helpers.make_config(data_dir, seed=2)
        expected = [b["image"].numpy() for b in inputs.run_data(direct).train_fn(tf.distribute.InputContext()).take(2)]
    finally:
        worker._stop()
        dispatcher._stop()
    size = helpers.make_config(data_dir).global_batch_size
    assert sorted(np.concatenate([index for index, _ in read[2]]).tolist()) == list(range(2 * size))
    assert sorted(b.tobytes() for _, b in read[2]) == sorted(b.tobytes() for b in expected)


@pytest.mark.parametrize(
    "hostlist,hosts",
    [
        ("gpu[07-08,10],login1", ["gpu07", "gpu08", "gpu10", "login1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),  # the width of the first number pads them all
        ("solo", ["solo"]),
        # The text after a name's brackets was taken for a node of its own ("-ib"), and the nodes lost it.
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("r[1-2]n[1-2],x", ["r1n1", "r1n2", "r2n1", "r2n2", "x"]),
    ],
)
def test_slurms_compressed_node_list_expands_in_order(hostlist, hosts):
    from engine.cluster import schedulers

    assert schedulers.expand_hostlist(hostlist) == hosts


def test_slurms_tasks_per_node_expand_their_repeats():
    from engine.cluster import schedulers

    assert schedulers.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert schedulers.expand_counts("4") == [4]


@pytest.mark.parametrize("hostlist", ["node[01-03", "node[3-1]", "node[1-2,]", "", "a,,b", "n]1["])
def test_a_node_list_slurm_would_not_write_is_refused(hostlist):
    # Each expanded to made-up nodes ("node", "01-03"), or none, without a word.
    from engine.cluster import schedulers

    with pytest.raises(ValueError):
        schedulers.expand_hostlist(hostlist)


@pytest.mark.parametrize(
    "change, message",
    [
        # All 4 tasks were placed on gpu-node07, the other node's counts left out by zip().
        ({"SLURM_STEP_TASKS_PER_NODE": "4"}, "SLURM_STEP_TASKS_PER_NODE='4' counts 1 nodes, SLURM_STEP_NODELIST="),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)x"}, "SLURM_STEP_TASKS_PER_NODE='2(x2)x' is not tasks per node"),
        # srun --distribution=cyclic: task 1 runs on the second node; its address was gpu-node07:8889, where nothing
        # listens, and the cluster waited --connect_timeout to fail naming a peer that was up.
        (
            {
                "SLURM_PROCID": "1",
                "SLURMD_NODENAME": "gpu-node08",
                "SLURM_LOCALID": "0",
                "SLURM_DISTRIBUTION": "cyclic",
            },
            "task 1 runs on gpu-node08 as its local task 0 (SLURMD_NODENAME, SLURM_LOCALID), not on gpu-node07 as "
            "local task 1, where numbering node by node places it: run srun with --distribution=block "
            "(SLURM_DISTRIBUTION='cyclic')",
        ),
    ],
)
def test_a_slurm_step_the_cluster_cannot_be_worked_out_of_is_one_line(monkeypatch, change, message):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {**SLURM, "SLURM_PROCID": "0", **change}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(f"--cluster_resolver=slurm: {message}")):
        distribute.cluster_resolver(Config(strategy="multi_worker", cluster_resolver="slurm").cluster)


def test_a_slurm_task_where_the_block_distribution_places_it_resolves(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {**SLURM, "SLURM_PROCID": "2", "SLURMD_NODENAME": "gpu-node08", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    resolver = distribute.cluster_resolver(Config(strategy="multi_worker", cluster_resolver="slurm").cluster)
    assert resolver.cluster_spec().task_address("worker", 2) == "gpu-node08:8888"


def test_a_parameter_server_rounds_step_count_is_the_chiefs(data_dir, one_device):
    # A dead worker's function in flight runs again on another worker: its increments of the step and data-position
    # counters (variables on the servers) landed twice, and the run's checkpoints and a rerun read a step past the
    # one it logged (1512 for 1500). The chief counts the steps that ran and sets them.
    run = build.run(helpers.make_config(data_dir, hidden_sizes=(8,)), one_device)
    iterator, real = run.program.train_iterator(), run.program.input

    class RunAgain:
        def __getattr__(self, name):
            return getattr(real, name)

        def run(self, loop, iterator, steps, first_batch):
            out = real.run(loop, iterator, steps, first_batch)
            run.state.step.assign_add(3)  # a function of 3 steps, run twice
            run.state.batches.assign_add(3)
            return out

    run.program.input, run.program.coordinator = RunAgain(), object()
    assert run.program.run_steps(iterator, 5)["steps"] == 5
    assert (int(run.state.step.numpy()), int(run.state.batches.numpy())) == (5, 5)


def test_a_parameter_server_chief_leaves_out_the_coordinators_logs_of_failed_remote_functions(monkeypatch):
    # A parameter server killed mid-run printed 55 lines of "E... cluster_coordinator.py:906] Remote function on
    # worker ... failed with UnavailableError" and gRPC details before the chief's one line "error: lost ps 0 (...)".
    import logging

    logger = logging.getLogger("tensorflow")
    monkeypatch.setattr(logger, "filters", list(logger.filters))  # the filter leaves with the test
    monkeypatch.setattr(tf.distribute.coordinator, "ClusterCoordinator", lambda strategy: ("coordinating", strategy))
    assert distribute.coordinator("ps") == ("coordinating", "ps")
    distribute.coordinator("ps")  # a second run in one process adds no second filter
    assert logger.filters.count(distribute.COORDINATOR_LOGS) == 1
    kept = []
    monkeypatch.setattr(logger, "handlers", [type("Keep", (logging.Handler,), {"emit": lambda _, r: kept.append(r)})()])
    for path in ("/site-packages/tensorflow/python/distribute/coordinator/cluster_coordinator.py", "/engine/x.py"):
        logger.handle(logger.makeRecord("tensorflow", logging.ERROR, path, 906, "Remote function failed", (), None))
    assert [record.pathname for record in kept] == ["/engine/x.py"]
