"""`--local_workers=N`: a whole cluster on this machine, for development and tests.

Starts every task of a multi-worker (N workers) or parameter-server (a chief, N workers, --num_ps
parameter servers) job as a process running this same command with TF_CONFIG set to free
localhost ports; prefixes each line of their output with the task's name; stops the rest when a
task that matters fails; returns the job's exit code. On Linux the tasks share a network namespace of
their own that holds only loopback (--local_cluster_network=loopback): TensorFlow's servers listen on
every interface, unauthenticated, and run the graphs they are sent. Without --local_workers the same
flags run unchanged on a real cluster. No TensorFlow here: the tasks import it, the launcher does not,
and every task checks its TF_CONFIG here before TensorFlow starts.
"""

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from engine.cluster.signals import LOST_PEER_EXIT_CODE, PREEMPTED_EXIT_CODE

GRACE_SECONDS = 10  # after SIGTERM, before SIGKILL


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
    for line in proc.stdout:  # read to its end whatever becomes of `out`: a task blocks on a full pipe
        _say(out, f"[{name}] {line}")


def _say(out, text):
    """Writes `text` to `out`, flushed; nothing where `out` is gone (the launcher's terminal closed, a pipe's reader
    ended): the job goes on, and is stopped as the signal that came with it says."""
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        pass


# The environment variable that names, in a task the launcher started, the file descriptor of a pipe whose other
# end the launcher alone holds, which reads as ended once the launcher has, however it ended; and the seconds the
# task waits then before it stops: "FD:SECONDS" (end_with_the_launcher).
LAUNCHER_FD = "ENGINE_LAUNCHER_FD"


def end_with_the_launcher():
    """In a task the launcher started: SIGTERM to itself, once, as the launcher ends, however it ends (SIGKILL too),
    which stops the task as a preemption (a trainer saves and exits, a server stops): no task is left running
    without it. A server waits GRACE_SECONDS first, as the launcher's own stop does: a parameter-server chief saves
    from its servers. Call it once SIGNALS are installed (its thread must not take the signal itself). Nothing for a
    process the launcher did not start. (Not prctl's parent-death signal: a launcher's threads each send it again
    as they end, and a second SIGTERM exits without saving.)"""
    given = os.environ.pop(LAUNCHER_FD, None)  # popped: what this task starts is not the launcher's
    if given is None:
        return
    fd, _, seconds = given.partition(":")

    def wait():
        while os.read(int(fd), 1):  # the launcher writes nothing: its end reads as end of file
            pass
        time.sleep(float(seconds or 0))
        # No one reads this task's output any more (the launcher copied it): a line written to its pipe would end
        # the task before it saved.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="launcher", daemon=True).start()


def run(strategy, workers, num_ps, argv, out=sys.stdout, network="loopback"):
    """Runs the job; `argv` is the command line of one task (without --local_workers). With `network` loopback
    this process moves into a network namespace of its own first (isolate_network); 2 where it cannot."""
    if network == "loopback" and not _isolated():
        return 2
    cluster = cluster_for(strategy, workers, num_ps)
    # Each task holds the reading end, this process alone the writing one: it closes as this process ends.
    ended, alive = os.pipe()
    # The job is done when its trainers are: every worker (multi-worker), or the chief (parameter servers,
    # whose workers and servers serve until stopped). A parameter-server worker that dies is not fatal:
    # the chief's coordinator moves its work to the others.
    trainer = "worker" if strategy == "multi_worker" else "chief"
    tasks = {
        f"{job} {index}": _start(job, index, cluster, argv, out, f"{ended}:{0 if job == trainer else GRACE_SECONDS}")
        for job, addresses in cluster.items()
        for index in range(len(addresses))
    }
    os.close(ended)
    _say_where(cluster, network, out)
    if os.environ.get("TF_CONFIG", "").strip():  # nor checked: each task's own replaces it
        _say(out, "[launcher] this environment's TF_CONFIG is not read: each task gets its own, of this cluster\n")
    trainers = [n for n in tasks if n.startswith(trainer)]
    code = _supervise(tasks, trainers, out)
    os.close(alive)  # every task has ended
    code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
    _say(out, f"[launcher] job finished with exit code {code}\n")
    return code


def _isolated():
    """isolate_network(), or False after saying on stderr why it could not and what the alternative costs."""
    try:
        isolate_network()
    except OSError as e:
        why = UNSHARE_FAILURES.get(e.errno, e.strerror)
        print(
            f"error: --local_cluster_network=loopback: cannot give the local cluster a network of its own "
            f"({why}); --local_cluster_network=host runs it on this machine's network, where its servers listen "
            "on every interface without authentication: use that only on a trusted network",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def _start(job, index, cluster, argv, out, ended):
    """Starts task `index` of `job` with its TF_CONFIG and `ended`, "FD:SECONDS": the reading end of the pipe that
    says when this process ends, and how long the task waits then (end_with_the_launcher); a thread copies its
    output to `out`, each line prefixed with the task's name."""
    name = f"{job} {index}"
    task_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "TF_CONFIG": task_config, LAUNCHER_FD: ended},
        pass_fds=(int(ended.partition(":")[0]),),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        # Its own session: a terminal's Ctrl-C reaches the launcher alone, which forwards it once. Sent to
        # the whole process group as well, a worker would see it twice, and a second signal exits unsaved.
        start_new_session=True,
    )
    threading.Thread(target=_stream, args=(proc, name, out), daemon=True).start()
    _say(out, f"[launcher] {name} pid {proc.pid} on {cluster[job][index]}\n")
    return proc


def _say_where(cluster, network, out):
    """Who can reach the tasks' servers, which listen without authentication."""
    ports = ", ".join(address.rpartition(":")[2] for addresses in cluster.values() for address in addresses)
    if network == "loopback":
        said = (
            f"[launcher] the tasks share a network namespace that holds only loopback: their servers (ports {ports}) "
            "cannot be reached from outside it, and the tasks cannot reach the network (--local_cluster_network=host "
            "gives them this machine's)\n"
        )
    else:
        # TensorFlow's gRPC server binds 0.0.0.0:PORT, hard-coded (grpc_server_lib.cc), with no option to bind
        # 127.0.0.1 instead; gRPC makes that a dual-stack [::]:PORT socket.
        said = (
            f"[launcher] note: --local_cluster_network=host: TensorFlow's servers listen on every network interface "
            f"without authentication (ports {ports}): run this on a trusted network only, or firewall these ports\n"
        )
    _say(out, said)


def _supervise(tasks, trainers, out):
    """The job's exit status (_wait), with SIGTERM and SIGINT forwarded to the trainers meanwhile, and SIGHUP (its
    terminal closed) once, as SIGTERM, unless it is ignored (nohup); every task stopped after (_stop)."""
    servers = [n for n in tasks if n not in trainers]
    forwarded = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGHUP: signal.SIGTERM}
    previous = {signum: signal.getsignal(signum) for signum in forwarded}
    told = set()  # what was forwarded: a second signal makes a trainer exit unsaved

    def forward(signum, frame):  # preemption reaches every trainer, which saves and exits
        if signum != signal.SIGHUP or signum not in told:  # a closed terminal may send SIGHUP more than once
            told.update([signum, *trainers])
            for n in trainers:
                tasks[n].send_signal(forwarded[signum])

    for signum, handler in previous.items():
        if signum != signal.SIGHUP or handler != signal.SIG_IGN:
            signal.signal(signum, forward)
    try:
        return _wait(tasks, trainers, out, told)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop([tasks[n] for n in trainers], [tasks[n] for n in servers])


def _wait(tasks, trainers, out, told=()):
    """The job's exit status, once its trainers are done or a task that matters failed. `told`: the trainers a
    signal was forwarded to."""
    noted, lost, deadline, preempted, nudged = set(), None, None, None, set()
    workers = [n for n in tasks if n.startswith("worker") and n not in trainers]  # a parameter-server job's
    while True:
        time.sleep(0.2)
        for name, proc in tasks.items():
            status = proc.poll()
            if status in (None, 0) or name in noted:
                continue
            noted.add(name)
            if name in trainers and (status in STOPPED_AND_SAVED or name in nudged):
                # Preempted: the other trainers stop at the same step and are still saving it. Stopped before the
                # training loop, it could not tell them: they are told after the grace period.
                preempted = preempted or time.monotonic() + GRACE_SECONDS
                continue
            if name in trainers:
                _say(out, f"[launcher] {name} exited with {status}; stopping the others\n")
                return status
            if name.startswith("ps"):
                # The job cannot go on without it. The chief finds out and says so (exit 5): give it the time.
                _say(out, f"[launcher] {name} exited with {status}; the chief stops too\n")
                lost, deadline = lost or status, deadline or time.monotonic() + GRACE_SECONDS
                continue
            _say(out, f"[launcher] {name} exited with {status}; the job goes on without it\n")
        if all(tasks[n].poll() is not None for n in trainers):
            return max(tasks[n].returncode for n in trainers if n not in nudged)
        if preempted is not None and time.monotonic() > preempted:
            # SIGINT: forming its cluster, a task waits where only SIGINT's default action ends it (interruptible)
            nudged = {n for n in trainers if tasks[n].poll() is None and n not in told}
            late = ", ".join(sorted(nudged))
            if nudged:
                _say(out, f"[launcher] {late} still running {GRACE_SECONDS} s after a preempted peer; SIGINT\n")
            for n in nudged:
                tasks[n].send_signal(signal.SIGINT)
            preempted = float("inf")  # once
        if workers and all(tasks[n].poll() is not None for n in workers):
            _say(out, "[launcher] every worker exited: the chief cannot train without one; stopping it\n")
            return LOST_PEER_EXIT_CODE
        if deadline is not None and time.monotonic() > deadline:
            _say(out, f"[launcher] the chief did not stop within {GRACE_SECONDS} s of losing a server; stopping it\n")
            return lost


# Why unshare(2) refuses a user namespace, as its manual page says.
UNSHARE_FAILURES = {
    errno.EPERM: "unshare: not permitted; user namespaces are disabled or restricted here (a container's seccomp "
    "profile, kernel.apparmor_restrict_unprivileged_userns)",
    errno.ENOSPC: "unshare: no user namespace left to make; sysctl user.max_user_namespaces limits them",
    errno.EUSERS: "unshare: no user namespace left to make; sysctl user.max_user_namespaces limits them",
    errno.EINVAL: "unshare: the launcher already runs threads, and only a single-threaded process may make a user "
    "namespace",
}

# Linux's clone flags (linux/sched.h), for unshare(2), and the interface requests that bring loopback up.
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def isolate_network():
    """Moves this process, and every process it starts from now on, into a new network namespace holding only
    a loopback interface, which it brings up. Root needs nothing else; otherwise (or root without CAP_SYS_ADMIN,
    as in a container) the namespace is made inside a new user namespace, which maps this process's own user
    and group to themselves. Raises OSError saying why it could not. Call it before any thread starts: the
    kernel makes a user namespace only for a single-threaded process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "unshare"):
        raise OSError(errno.ENOSYS, "this system has no network namespaces (Linux only)")
    if libc.unshare(CLONE_NEWNET) != 0:
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        _map_ids(uid, gid)  # the new user namespace maps no one yet
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def _map_ids(uid, gid):
    """Every user and group to itself where this process may (CAP_SETUID and CAP_SETGID: root), else its own
    alone: then it gives up setgroups(2), as the kernel requires of an unprivileged mapping."""
    try:
        _write("/proc/self/uid_map", "0 0 4294967295")
    except PermissionError:
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
    try:
        _write("/proc/self/gid_map", "0 0 4294967295")
    except PermissionError:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


# A trainer's exit after a signal, its checkpoint saved (SIGTERM, SIGINT): not a failure of the job.
STOPPED_AND_SAVED = (PREEMPTED_EXIT_CODE, 128 + signal.SIGINT)


def _stop(trainers, servers):
    """SIGTERM to the trainers still running, which save (a parameter-server chief from its servers) and exit;
    then SIGKILL to the servers, which hold nothing more to save: stopped by a signal, each would report a
    preemption that is none."""
    trainers = [p for p in trainers if p.poll() is None]
    for p in trainers:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in trainers:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in servers:
        if p.poll() is None:
            p.kill()
            p.wait()
