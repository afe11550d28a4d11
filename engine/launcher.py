"""`--local_workers=N`: a whole cluster on this machine, for development and tests.

Starts every task of a multi-worker (N workers) or parameter-server (a chief, N workers, --num_ps
parameter servers) job as a process running this same command with TF_CONFIG set to free
localhost ports; prefixes each line of their output with the task's name; stops the rest when a
task that matters fails; returns the job's exit code. Without --local_workers the same flags run
unchanged on a real cluster. No TensorFlow here: the tasks import it, the launcher does not, and
every task checks its TF_CONFIG here before TensorFlow starts.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from engine.config import ConfigError
from engine.preemption import PREEMPTED_EXIT_CODE

GRACE_SECONDS = 10  # after SIGTERM, before SIGKILL


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
    return parsed


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def cluster_for(strategy, workers, num_ps):
    jobs = {"worker": workers} if strategy == "multi_worker" else {"chief": 1, "worker": workers, "ps": num_ps}
    ports = iter(free_ports(sum(jobs.values())))
    return {job: [f"localhost:{next(ports)}" for _ in range(count)] for job, count in jobs.items()}


def _stream(proc, name, out):
    for line in proc.stdout:
        out.write(f"[{name}] {line}")
        out.flush()


def run(strategy, workers, num_ps, argv, out=sys.stdout):
    """Runs the job; `argv` is the command line of one task (without --local_workers)."""
    cluster = cluster_for(strategy, workers, num_ps)
    tasks = {}
    for job, addresses in cluster.items():
        for index in range(len(addresses)):
            task_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
            proc = subprocess.Popen(
                argv,
                env={**os.environ, "TF_CONFIG": task_config},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                # Its own session: a terminal's Ctrl-C reaches the launcher alone, which forwards it once. Sent to
                # the whole process group as well, a worker would see it twice, and a second signal exits unsaved.
                start_new_session=True,
            )
            name = f"{job} {index}"
            tasks[name] = proc
            threading.Thread(target=_stream, args=(proc, name, out), daemon=True).start()
            out.write(f"[launcher] {name} pid {proc.pid} on {addresses[index]}\n")
    # TensorFlow's gRPC server binds 0.0.0.0:PORT, hard-coded (grpc_server_lib.cc), with no option to bind
    # 127.0.0.1 instead; gRPC makes that a dual-stack [::]:PORT socket. Say so, since nobody can fix it here.
    ports = ", ".join(address.rpartition(":")[2] for addresses in cluster.values() for address in addresses)
    out.write(
        f"[launcher] note: TensorFlow's servers listen on every network interface without authentication (ports "
        f"{ports}): use --local_workers on a trusted network, or firewall these ports\n"
    )
    out.flush()
    # The job is done when its trainers are: every worker (multi-worker), or the chief (parameter servers,
    # whose workers and servers serve until stopped). A parameter-server worker that dies is not fatal:
    # the chief's coordinator moves its work to the others.
    trainers = [n for n in tasks if n.startswith("worker")] if strategy == "multi_worker" else ["chief 0"]
    fatal = set(trainers) | {n for n in tasks if n.startswith("ps")}
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum in previous:  # preemption reaches every trainer, which saves and exits
        signal.signal(signum, lambda signum, frame: [tasks[n].send_signal(signum) for n in trainers])
    noted, code = set(), None
    try:
        while code is None:
            time.sleep(0.2)
            for name, proc in tasks.items():
                status = proc.poll()
                if status in (None, 0) or name in noted:
                    continue
                noted.add(name)
                if name in trainers and status in STOPPED_AND_SAVED:
                    continue  # preempted: the other trainers stop at the same step and are still saving it
                if name in fatal:
                    out.write(f"[launcher] {name} exited with {status}; stopping the others\n")
                    code = status
                    break
                out.write(f"[launcher] {name} exited with {status}; the job goes on without it\n")
            if code is None and all(tasks[n].poll() is not None for n in trainers):
                code = max(tasks[n].returncode for n in trainers)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(tasks.values())
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    out.write(f"[launcher] job finished with exit code {code}\n")
    out.flush()
    return code


# A trainer's exit after a signal, its checkpoint saved (SIGTERM, SIGINT): not a failure of the job.
STOPPED_AND_SAVED = (PREEMPTED_EXIT_CODE, 128 + signal.SIGINT)


def _stop(procs):
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
