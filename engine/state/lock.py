"""One process at a time trains in a workdir: workdir/train.lock for the life of a `with` block.

The lock: workdir/train.lock, created exclusively (O_CREAT|O_EXCL, atomic on local disks and on NFSv3+, Lustre,
GPFS and CephFS), holds the holder's pid, host, process start time and a heartbeat the holder rewrites every
HEARTBEAT_SECONDS. A second process is refused naming the holder; a lock whose process is gone (in this process
table: its pid is dead or is another process now) or whose heartbeat stopped for STALE_SECONDS (another host or
container: watched on our own clock) is taken over.
Object stores (a "://" path such as gs://) have no exclusive create: there the lock is written and read back,
which catches a second run unless both start within about a second. A refused run (the lock's `with` block ends
in an exception) removes the directories the lock created for it when they are still empty: refused means
nothing written.
"""

import contextlib
import json
import os
import socket
import threading
import time
import uuid

import tensorflow as tf

from engine.cluster.signals import SIGNALS
from engine.settings.errors import ConfigError
from engine.state.files import (
    is_local,
    local_path,
    make_workdir,
    missing_directories,
    open_new,
    replace_text,
    writing,
)

LOCK_NAME = "train.lock"
HEARTBEAT_SECONDS = 10.0  # how often the holder rewrites its heartbeat
STALE_SECONDS = 60.0  # a heartbeat unchanged this long (watched by us, so no clock skew) means its holder is gone
_ANCIENT_SECONDS = 3600.0  # a heartbeat this old by the clocks is stale at once (far beyond any clock skew)


def _start_time(pid):
    """A process's start time in clock ticks since boot (Linux), so a reused pid is not taken for its holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _machine():
    """Where a pid means this process table: the host, its boot and the pid namespace (a container has its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = namespace = None
    return {"host": socket.gethostname(), "boot": boot, "pid_namespace": namespace}


def _alive_here(holder):
    """True or False for a holder in this process table, None when it is elsewhere (another host or container) and
    only its heartbeat tells."""
    if any(holder.get(key) != value for key, value in _machine().items()):
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    started = _start_time(pid)
    return started is None or holder.get("started") is None or started == holder["started"]


class Lock:
    """workdir/train.lock for the life of a `with` block (see the module's docstring)."""

    def __init__(self, workdir, log=print, doing="training", name=LOCK_NAME):
        # `doing` is what a refused process is told the holder does ("tuning study 'x'" for a tuner); `name`: the
        # lock's file (a continuous_eval sidecar holds one of its own, beside the trainer's train.lock).
        self.workdir, self.log, self.doing = workdir, log, doing
        self.path = local_path(os.path.join(workdir, name))
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = None
        self._created = []

    def __enter__(self):
        self._created = missing_directories(self.workdir)
        make_workdir(self.workdir)
        try:
            self.acquire()
        except BaseException:
            self._remove_created()
            raise
        return self

    def __exit__(self, kind, *exc):
        self.release()
        if kind is not None:
            self._remove_created()

    def _remove_created(self):
        """Removes the directories this lock created, deepest first, while they are empty (a refused run)."""
        for directory in self._created:
            try:
                os.rmdir(directory)
            except OSError:
                return  # something was written there: it stays

    def _record(self):
        return {
            "pid": os.getpid(),
            **_machine(),
            "started": _start_time(os.getpid()),
            "token": self.token,
            "doing": self.doing,
            "heartbeat": time.time(),
        }

    def acquire(self):
        while True:
            if self._create(json.dumps(self._record())):
                self._thread = threading.Thread(target=self._heartbeat, name="workdir-lock", daemon=True)
                self._thread.start()
                # A signal that exits at once (outside the training loop: its final evaluation, a sidecar) leaves
                # no lock behind: exit 75 says "run the same command", on whichever host.
                SIGNALS.on_exit(self.token, self._drop)
                return
            with writing(self.path):  # a lock the run cannot read (a folder in its place) it cannot take: exit 4
                raw = self._read()
            if raw is None:
                continue  # released between our create and our read: try again
            holder = _parse(raw)
            if not holder and self._age() < 5.0:
                time.sleep(0.1)  # just created, not yet written
                continue
            if self._holder_is_alive(holder, raw):
                raise ConfigError(
                    f"--workdir={self.workdir}: another run is {holder.get('doing', 'training')} here: pid "
                    f"{holder.get('pid')} on host "
                    f"{holder.get('host')} (last heartbeat {_ago(holder)}; {self.path}). Wait for it or stop it, "
                    "or use another --workdir"
                )
            if self._take_over(raw):
                self.log(
                    f"warning: took over {self.path} from pid {holder.get('pid')} on host {holder.get('host')}, "
                    "which is gone"
                )

    def _holder_is_alive(self, holder, raw):
        alive = _alive_here(holder)
        if alive is not None:
            return alive
        heartbeat = holder.get("heartbeat")
        if not isinstance(heartbeat, (int, float)) or time.time() - heartbeat > _ANCIENT_SECONDS:
            return False
        # Another host: alive if its heartbeat moves while we watch (our own clock only: no skew).
        self.log(
            f"{self.path} is held by pid {holder.get('pid')} on host {holder.get('host')}: waiting up to "
            f"{STALE_SECONDS:.0f} s for its heartbeat"
        )
        deadline = time.monotonic() + STALE_SECONDS
        while time.monotonic() < deadline:
            time.sleep(min(1.0, STALE_SECONDS / 10))
            now = self._read()
            if now is None:
                return False  # released: free to take
            if now != raw:
                return True  # a heartbeat, or a new holder: not ours to take
        return False

    def _create(self, content):
        if is_local(self.path):
            try:
                fd = open_new(self.path)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(content)
            return True
        if tf.io.gfile.exists(self.path):
            return False
        with tf.io.gfile.GFile(self.path, "w") as f:
            f.write(content)
        time.sleep(1.0)  # a run that wrote at the same moment: the object store keeps the last write
        return self._read() == content

    def _read(self):
        try:
            with tf.io.gfile.GFile(self.path) as f:
                return f.read()
        except tf.errors.NotFoundError:
            return None

    def _age(self):
        try:
            return time.time() - tf.io.gfile.stat(self.path).mtime_nsec / 1e9
        except tf.errors.NotFoundError:
            return 0.0

    def _take_over(self, raw):
        """Removes a stale lock whose content is `raw`; False when someone else moved first."""
        if not is_local(self.path):
            if self._read() != raw:
                return False
            tf.io.gfile.remove(self.path)
            return True
        grave = f"{self.path}.stale-{self.token}"
        try:
            os.rename(self.path, grave)  # atomic: of several restarters exactly one moves it
        except FileNotFoundError:
            return False
        with open(grave) as f:
            moved = f.read()
        if moved != raw:  # we moved a lock someone has just taken: give it back
            with contextlib.suppress(FileExistsError):
                os.link(grave, self.path)
            os.remove(grave)
            return False
        os.remove(grave)
        return True

    def _heartbeat(self):
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                if _parse(self._read() or "").get("token") != self.token:
                    self.log(f"warning: {self.path} was removed or taken over by another run; stop this one")
                    return
                self._write(json.dumps(self._record()))
            except (OSError, tf.errors.OpError):
                pass  # a full disk or a network blip: the next heartbeat tries again

    def _write(self, content):
        if not is_local(self.path):
            with tf.io.gfile.GFile(self.path, "w") as f:
                f.write(content)
            return
        replace_text(self.path, content)

    def release(self):
        SIGNALS.discard(self.token)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drop()

    def _drop(self):
        """Removes the lock's file where it is still this holder's. Also what an exit at once on a signal runs
        (Signals.on_exit): without waiting for the heartbeat thread, which a slow storage may hold."""
        self._stop.set()
        with contextlib.suppress(OSError, tf.errors.OpError):
            if _parse(self._read() or "").get("token") == self.token:
                tf.io.gfile.remove(self.path)


def _parse(raw):
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}  # torn by a kill between create and write: stale once its (absent) heartbeat is
    return holder if isinstance(holder, dict) else {}


def _ago(holder):
    heartbeat = holder.get("heartbeat")
    if not isinstance(heartbeat, (int, float)):
        return "unknown"
    return f"{max(0.0, time.time() - heartbeat):.0f} s ago"
