"""The suite's fork server: the processes the tests start (`python launch.py ...`, the worker scripts) forked from
one process that has imported TensorFlow, Keras and the engine once, instead of each importing them again.

Why: importing them is about 4 of the 8 CPU-seconds of a two-step `python launch.py` run on the suite's 2-core
machines, and the tests start well over a hundred such processes.

What a forked child is: a new process with its own pid (SIGKILL and SIGTERM reach it as they would a fresh one),
forked before any TensorFlow op ran in the server, so its TensorFlow runtime (devices, threads, the cluster) starts
at its own first op as in a fresh interpreter. It runs the script as `__main__` with the request's argv,
environment, working directory, stdin, stdout and stderr, and exits as Python would (non-daemon threads joined,
atexit handlers run, a KeyboardInterrupt ending it by SIGINT).

What it is not: a fresh interpreter. The server's modules are not imported again (a source file edited during the
session is not seen, nor is it by the test process), and variables read while TensorFlow is imported cannot
change: a request whose environment differs from the server's in anything but RUNTIME_KEYS, or that asks for what
a fork cannot give (preexec_fn, another interpreter's flags), runs as a plain subprocess.

    proc = forkserver.popen(["launch.py", "--train_steps=2"], stdout=subprocess.PIPE, text=True)

returns an object with subprocess.Popen's pid, returncode, stdout, stderr, poll, wait, communicate, send_signal,
terminate and kill; `run` is subprocess.run's counterpart. The children's CPU time is added to CHILD_CPU (the
server's children are not the test process's, so resource.RUSAGE_CHILDREN does not see them; tests/cpu_usage.py
adds it).
"""

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the server imports before it forks: everything a launch.py run imports that takes time.
PRELOAD = (
    "tensorflow",
    "keras",
    "tensorflow_datasets",
    "engine.run.build",
    "engine.cluster.launcher",
    "research.tune",
)
# Environment variables the engine and the tests read at run time, after TensorFlow's import: a child may differ
# from the server in these and nothing else.
RUNTIME_KEYS = frozenset({"TF_CONFIG", "SIGNALLED", "PYTEST_CURRENT_TEST"})
# The environment the server starts with: the test process's as the session began (before any test's monkeypatch).
START_ENV = dict(os.environ)
CHILD_CPU = [0.0]  # CPU-seconds of the forked children that have been waited for
LINGER = 10  # seconds the server waits, once the test process has ended, for the children it forked to end

_server = None  # (the server's Popen, our end of its socket), started on first use
_lock = threading.Lock()


# The client: the test process.


class Process:
    """A forked child, used as a subprocess.Popen is."""

    def __init__(self, args, pid, status, stdout, stderr, text):
        self.args, self.pid, self.returncode = args, pid, None
        self._status, self._text = status, text
        self.stdout = _reader(stdout, text)
        self.stderr = _reader(stderr, text)
        self._chunks = {}

    def poll(self):
        return self.wait(0, raising=False)

    def wait(self, timeout=None, raising=True):
        if self.returncode is None:
            ready = _readable(self._status, timeout)
            if not ready:
                if raising:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                return None
            report = json.loads(_read_all(self._status))
            os.close(self._status)
            self.returncode = report["returncode"]
            CHILD_CPU[0] += report["cpu"]
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if input is not None:
            raise ValueError("forkserver.Process.communicate takes no input")
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None and not s.closed]
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                self._chunks.setdefault(stream, [])
                selector.register(stream.fileno(), selectors.EVENT_READ, stream)
            while selector.get_map():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = selector.select(left)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in events:
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        self._chunks[key.data].append(data)
                    else:
                        selector.unregister(key.fd)
                        key.data.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [self._decoded(s) for s in (self.stdout, self.stderr)]
        return out[0], out[1]

    def _decoded(self, stream):
        if stream is None:
            return None
        data = b"".join(self._chunks.get(stream, []))
        if self._text:
            return data.decode().replace("\r\n", "\n").replace("\r", "\n")
        return data

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(args, *, cwd=ROOT, env=None, stdin=None, stdout=None, stderr=None, text=False, **kwargs):
    """`python *args` (a script and its arguments, or "-m", a module and its arguments) as a forked child, or as a
    subprocess.Popen where a fork would differ from a fresh interpreter (see the module's docstring)."""
    env = dict(os.environ if env is None else env)
    differs = {k for k in set(env) | set(START_ENV) if env.get(k) != START_ENV.get(k)}
    if kwargs or differs - RUNTIME_KEYS or stdin == subprocess.PIPE or args[0].startswith("-") and args[0] != "-m":
        return subprocess.Popen(
            [sys.executable, *args], cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text, **kwargs
        )
    theirs = []  # the descriptors the child gets, closed here once sent
    try:
        child_in, _ = _end(stdin, 0, theirs)
        child_out, out = _end(stdout, 1, theirs)
        child_err, err = (child_out, None) if stderr == subprocess.STDOUT else _end(stderr, 2, theirs)
        status, status_w = os.pipe()
        theirs.append(status_w)
        request = json.dumps({"argv": list(args), "env": env, "cwd": os.path.abspath(cwd)}).encode()
        with _lock:
            socket.send_fds(_connection(), [request], [child_in, child_out, child_err, status_w])
    finally:
        for fd in theirs:
            os.close(fd)
    pid = int(_read_line(status))
    return Process(args, pid, status, out, err, text)


def run(args, *, timeout=None, capture_output=False, check=False, stdout=None, stderr=None, **kwargs):
    """subprocess.run's counterpart: the child's CompletedProcess."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = popen(args, stdout=stdout, stderr=stderr, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _end(spec, inherited, theirs):
    """The descriptor the child gets for its standard stream `inherited` (0, 1 or 2; `spec` as subprocess takes
    it) and our end of its pipe (None when it is not a pipe: stdin never is, popen runs that as a subprocess)."""
    ours = None
    if spec is None:
        fd = os.dup(inherited)
    elif spec == subprocess.PIPE:
        ours, fd = os.pipe()
    elif spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if inherited == 0 else os.O_WRONLY)
    else:
        fd = os.dup(spec if isinstance(spec, int) else spec.fileno())
    theirs.append(fd)
    return fd, ours


def _reader(fd, text):
    if fd is None:
        return None
    return open(fd, "r" if text else "rb", closefd=True)


def _readable(fd, timeout):
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def _read_line(fd):
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise RuntimeError("the fork server's child ended before it was started (see the server's stderr)")
        data += chunk
    return data


def _read_all(fd):
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _connection():
    global _server
    if _server is None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
            cwd=ROOT,
            env=START_ENV,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        _server = (proc, ours)
        atexit.register(_stop)
    return _server[1]


def _stop():
    proc, sock = _server
    sock.close()  # the server's recv ends: it reaps its waiters and exits
    try:
        proc.wait(timeout=LINGER + 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# The server.


def one_thread_per_op():
    """One thread for each TensorFlow op's own work, set before the first op: in the test processes (conftest.py)
    and in the fork server, so every child it forks too. `pytest -n 3` runs three test processes on two cores, and
    a second thread per op there only waits for a core another process holds (the suite took 15 % less CPU time).
    The same setting on both sides also keeps a test's own run and its child's summing alike: the number of
    threads splits some float32 reductions differently, in the last bit."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)


def serve(fd):
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        __import__(name)
    one_thread_per_op()
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 4)
        if not message:
            break
        request = json.loads(message)
        if os.fork() == 0:
            try:
                sock.close()
                _wait_for_child(request, fds)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        _reap()
    # The test process has ended: the waiters of children that have exited are reaped (their children's CPU time
    # counts in this process's, so in the session's), and those of children a failed test left running are left
    # to init after a while, as a test process's own subprocesses would be, instead of holding its exit.
    deadline = time.monotonic() + LINGER
    while _reap() and time.monotonic() < deadline:
        time.sleep(0.05)


def _reap():
    """Reaps the waiters that have exited; whether any are still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _wait_for_child(request, fds):
    """The waiter between the server and the child: forks the child, writes its pid, then its exit status and CPU
    time, on the status pipe."""
    stdin, stdout, stderr, status = fds
    pid = os.fork()
    if pid == 0:
        os.close(status)
        _child(request, stdin, stdout, stderr)
    for fd in (stdin, stdout, stderr):
        os.close(fd)
    quiet = os.open(os.devnull, os.O_RDWR)  # nor does it keep the test process's own streams open
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    os.write(status, f"{pid}\n".encode())
    _, code, usage = os.wait4(pid, 0)
    report = {"returncode": os.waitstatus_to_exitcode(code), "cpu": usage.ru_utime + usage.ru_stime}
    os.write(status, json.dumps(report).encode())
    os.close(status)


def _child(request, stdin, stdout, stderr):
    """Runs the request's script as `__main__` and exits as the interpreter would; never returns."""
    import runpy
    import traceback

    code = 1
    try:
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        for fd in {stdin, stdout, stderr} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = request["cwd"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        _finish()
    finally:
        os._exit(code)


def _exit_code(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _finish():
    """What the interpreter does at exit before it ends the process: joins the non-daemon threads, runs the atexit
    handlers, flushes the standard streams."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    serve(int(sys.argv[1]))
