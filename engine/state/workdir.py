"""A workdir holds one run: its settings (config.json) say which, and one process at a time trains in it.

The identity check: a train run started in a workdir whose config.json has other identity settings
(engine/identity.py IDENTITY_SETTINGS: model, data, optimizer, schedule, seed, batch, precision, reported split)
is refused, naming each setting, before anything is written; the same command resumes, a higher
--train_steps continues, cadence and execution settings never block.

The lock: workdir/train.lock, created exclusively (O_CREAT|O_EXCL, atomic on local disks and on NFSv3+, Lustre,
GPFS and CephFS), holds the holder's pid, host, process start time and a heartbeat the holder rewrites every
HEARTBEAT_SECONDS. A second process is refused naming the holder; a lock whose process is gone (in this process
table: its pid is dead or is another process now) or whose heartbeat stopped for STALE_SECONDS (another host or
container: watched on our own clock) is taken over.
Object stores (a "://" path such as gs://) have no exclusive create: there the lock is written and read back,
which catches a second run unless both start within about a second. A refused run (the lock's `with` block ends
in an exception) removes the directories the lock created for it when they are still empty: refused means
nothing written.

Writing inside a workdir never goes through a symbolic link planted there (a link would let whoever can write
the workdir make the run overwrite a file elsewhere): a file is written to a fresh temporary name no one can
guess, created exclusively and without following links, then renamed over its target (a link at the target is
replaced, not followed); a log appended to is opened without following links, and a link there is refused.
Object stores have no links: there TensorFlow's file system writes as it is.
"""

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid

import tensorflow as tf

from engine.settings.config import first_line, load_run_config
from engine.settings.errors import CheckpointError, ConfigError
from engine.settings.fields import show
from engine.settings.identity import identity_changes

LOCK_NAME = "train.lock"
STUDY_NAME = "study.json"  # what marks a tuner's workdir (research/tune.py), which a train run is refused
HEARTBEAT_SECONDS = 10.0  # how often the holder rewrites its heartbeat
STALE_SECONDS = 60.0  # a heartbeat unchanged this long (watched by us, so no clock skew) means its holder is gone
_ANCIENT_SECONDS = 3600.0  # a heartbeat this old by the clocks is stale at once (far beyond any clock skew)


def check_same_run(config):
    """Refuses (ConfigError) a train run in a workdir that holds a tuning study or a run with other identity
    settings; returns the saved Config, or None in a new workdir."""
    study = os.path.join(config.workdir, STUDY_NAME)
    if tf.io.gfile.exists(study):  # its summary.json is the study's, which this run's would replace
        raise ConfigError(
            f"--workdir={config.workdir} holds a tuning study ({study}): a train run needs a --workdir of its own; "
            "the study's trials train in its trials/ folder"
        )
    saved = load_run_config(config.workdir)
    if saved is None:
        return None
    changes = identity_changes(saved, config)
    if changes:
        listed = "; ".join(f"--{name}={show(old)} there, {show(new)} here" for name, old, new in changes)
        hint = ""
        if [name for name, _, _ in changes] == ["eval_split"]:
            hint = f" (to evaluate it on another split: --mode=eval --workdir={config.workdir} --eval_split=...)"
        raise ConfigError(
            f"--workdir={config.workdir} holds a run with other settings ({os.path.join(config.workdir, 'config.json')}"
            f"): {listed}. Rerun it with its own settings to resume it, or give this run a new --workdir"
            f" ({_free_name(config.workdir)} is free){hint}"
        )
    return saved


def _free_name(workdir):
    base = workdir.rstrip("/")
    return next(f"{base}-{n}" for n in range(2, 10_000) if not tf.io.gfile.exists(f"{base}-{n}"))


def _local(path):
    return "://" not in path


def local_path(path):
    """A local path as TensorFlow's file system reads it (a/../b is b even where a does not exist, which the
    kernel's own lookup refuses), so that os calls and tf.io.gfile calls name the same file."""
    return os.path.normpath(path) if _local(path) else path


def _open_new(path):
    """A file descriptor of `path`, created here and now: never an existing file, never through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def _link_refused(path):
    """OSError for a symbolic link found where the run writes (its message names the link's target)."""
    return OSError(
        errno.ELOOP,
        f"it is a symbolic link (to {os.readlink(path)}); a run writes only inside its workdir: remove the link",
        path,
    )


def replace_text(path, text):
    """Writes `text` (str, or bytes: a figure, an .npz) to `path` atomically (a reader or a kill never sees half a
    file), never through a link (see the module's docstring). Raises OSError or tf.errors.OpError for the caller
    to name."""
    binary = isinstance(text, bytes)
    if not _local(path):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with tf.io.gfile.GFile(tmp, "wb" if binary else "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, path, overwrite=True)
        return
    path = local_path(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = _open_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text if binary else text.encode("utf-8"))
        os.replace(tmp, path)  # renames over a link at `path` itself: its target is untouched
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def append_text(path, text):
    """Appends `text` to the log `path`, created if missing; a link there is refused (CheckpointError, like any
    failed write of the run's files), never appended through."""
    try:
        if not _local(path):
            with tf.io.gfile.GFile(path, "a") as f:
                f.write(text)
            return
        path = local_path(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP and os.path.islink(path):
                raise _link_refused(path) from None
            raise
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from None


def make_workdir(path):
    """Creates the workdir and checks that a file can be written there (CheckpointError naming it: exit 4)."""
    try:
        tf.io.gfile.makedirs(path)
        if _local(path):
            probe = os.path.join(local_path(path), f".write_probe-{uuid.uuid4().hex}")
            fd = _open_new(probe)
            try:
                os.write(fd, b"probe")
            finally:
                os.close(fd)
                os.remove(probe)
            return
        probe = os.path.join(path, f".write_probe-{uuid.uuid4().hex}")
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("probe")  # GFile opens the file at its first write
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as e:
        why = e.strerror if isinstance(e, OSError) else first_line(e)
        raise CheckpointError(f"--workdir={path}: cannot write there ({why})") from None


def _missing_directories(path):
    """The directories from `path` up that do not exist yet, deepest first (what creating `path` makes)."""
    missing = []
    path = local_path(os.path.abspath(path)) if _local(path) else path
    while _local(path) and not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


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

    def __init__(self, workdir, log=print, doing="training"):
        # `doing` is what a refused process is told the holder does ("tuning study 'x'" for a tuner).
        self.workdir, self.log, self.doing = workdir, log, doing
        self.path = local_path(os.path.join(workdir, LOCK_NAME))
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = None
        self._created = []

    def __enter__(self):
        self._created = _missing_directories(self.workdir)
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
                return
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
        if _local(self.path):
            try:
                fd = _open_new(self.path)
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
        if not _local(self.path):
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
        if not _local(self.path):
            with tf.io.gfile.GFile(self.path, "w") as f:
                f.write(content)
            return
        replace_text(self.path, content)

    def release(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
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
