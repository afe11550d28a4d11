"""SIGTERM and SIGINT as a graceful stop. No TensorFlow import here: launch.py installs this before
TensorFlow starts its threads."""

import contextlib
import os
import signal
import sys
import threading

LOST_PEER_EXIT_CODE = 5  # a peer of the cluster lost (engine/cluster/resolvers.py PeerLost): restart the job
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", as a scheduler's restart policy reads it
INTERRUPTED_EXIT_CODE = 130  # the shell's code for Ctrl-C


class Signals:
    """Turns SIGTERM/SIGINT into a graceful stop.

    Inside the training loop (`watch`), a signal sets a flag that the replica step all-reduces with the
    gradients, so every worker stops after the same step and saves it. Anywhere else there is nothing to
    save: the process exits at once with the same code. A second signal exits at once too.

    `install()` must run before TensorFlow starts its threads (launch.py calls it first): it blocks the
    signals in every thread and waits for them in one, so they are seen even while the main thread is
    inside a long tf.function call.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal = None
        self._flag = None
        self._lock = threading.Lock()
        self._watcher = None  # the thread that waits for the signals, once install() started it
        self._stderr = 2
        # What an exit at once must still undo: a workdir's lock (engine/state/lock.py), which a restart on another
        # host or container would otherwise wait a minute for, as for a crashed holder's. {id: callable}
        self._releases = {}

    def on_exit(self, key, release):
        """Has `release()` run before the process exits at once on a signal (outside the training loop, a second
        signal), until `discard(key)`. Not under self._lock: the watcher holds it as it exits, and a release
        discards itself (one dict operation, atomic)."""
        self._releases[key] = release

    def discard(self, key):
        self._releases.pop(key, None)

    def _release_all(self):
        for release in list(self._releases.values()):
            try:
                release()
            except Exception:  # noqa: BLE001  (exiting: a release that fails leaves what a kill leaves)
                pass

    def exit_until_installed(self):
        """Until install(): SIGTERM and SIGINT exit at once, with the run's code and one error line, as outside the
        training loop, not in a KeyboardInterrupt traceback from wherever start-up was (Ctrl-C as flags are read, or
        forwarded by --local_workers' launcher to tasks still importing). Also where the process started with them
        ignored (a script's background job ignores SIGINT), as install()'s watcher takes them then too (blocked,
        Linux queues an ignored signal for sigwait): a scheduler's or a person's signal is heard before and after
        alike. --local_workers' launcher, which never installs, forwards them to its tasks meanwhile
        (engine/cluster/launcher.py)."""
        for signum in self.SIGNALS:
            signal.signal(signum, self._exit_at_start)

    def _exit_at_start(self, signum, frame):
        self.signal = signum
        self._exit_now()

    def install(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        self._stderr = os.dup(2)  # launch.py silences fd 2 while TensorFlow loads; the last words must show
        self._watcher = threading.Thread(target=self._watch, name="preemption", daemon=True)
        self._watcher.start()

    def _watch(self):
        while True:
            received = signal.sigwait(self.SIGNALS)
            with self._lock:
                if self.signal is not None:  # the first one's save takes too long for whoever sent this
                    self._last_words(f"second {signal.Signals(received).name}: exiting without saving")
                    self._release_all()
                    os._exit(128 + received)
                self.signal = received
                if self._flag is None:
                    self._exit_now()
                try:
                    self._flag.assign(True)
                except Exception as e:  # noqa: BLE001  (TensorFlow's errors: this module imports none)
                    # The flag lives with the variables: on a parameter server that is gone, setting it fails. The
                    # loop cannot be stopped at a step then, and a watcher that died here would see no signal again.
                    text = (getattr(e, "message", None) or str(e)).strip().splitlines() or [type(e).__name__]
                    self._last_words(
                        f"{self.cause}, but the training loop cannot be told to stop at a step (setting its stop "
                        f"flag failed: {text[0]}): exiting without saving"
                    )
                    self._release_all()
                    os._exit(self.exit_code)

    @contextlib.contextmanager
    def watch(self, flag):
        """Within this block a signal sets `flag` (a boolean tf.Variable) for the loop to stop at a step and save;
        a signal that comes as the block ends normally, too late for the loop, exits then."""
        with self._lock:
            self._flag = flag
        try:
            yield
        except BaseException:
            with self._lock:
                self._flag = None
            raise
        with self._lock:
            self._flag = None
            if self.signal is not None:
                self._exit_now("after the training loop, its last step saved")

    def interruptible(self, wait, *args, **kwargs):
        """Returns wait(*args, **kwargs), run so that Ctrl-C ends the process at once (status 130), as SIGINT
        does by default: for a wait inside TensorFlow's native code that holds Python's lock (a cluster forming
        while a peer never comes), where neither the watcher nor a handler can run.

        The main thread unblocks SIGINT: the kernel offers a signal sent to a process to its main thread first,
        and a default action needs no Python. It does so before it starts the thread that runs `wait`, which
        blocks SIGINT again for itself and the threads TensorFlow starts from it: once `wait` holds the lock,
        the main thread runs no more Python. SIGTERM cannot be treated so: TensorFlow installs its own handler
        for it while the cluster forms (its preemption notifier), which only records it. SIGTERM stays with the
        watcher, which acts once the wait ends; --connect_timeout bounds the wait.
        """
        if self._watcher is None or threading.current_thread() is not threading.main_thread():
            return wait(*args, **kwargs)
        outcome = {}

        def run():
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
            try:
                outcome["value"] = wait(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001  (raised again in the main thread)
                outcome["error"] = e

        handler = signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        try:
            thread = threading.Thread(target=run, name=getattr(wait, "__name__", "wait"), daemon=True)
            thread.start()
            thread.join()
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
            signal.signal(signal.SIGINT, handler)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _exit_now(self, where="outside the training loop (nothing to save)"):
        self._last_words(f"{self.cause} {where}")
        self._release_all()
        os._exit(self.exit_code)

    def _last_words(self, message):
        """The error line, where there is anyone to read it: a closed pipe or terminal must not stop the exit."""
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(self._stderr, f"error: {message}\n".encode())
        except (OSError, ValueError):
            pass

    @property
    def cause(self):
        """What stopped the run, as the error line says it. No signal here: a peer worker's stopped this one."""
        if self.signal is None:
            return "preempted: stopped by a peer worker's signal"
        verb = "interrupted" if self.signal == signal.SIGINT else "preempted"
        return f"{verb}: stopped by {signal.Signals(self.signal).name}"

    @property
    def exit_code(self):
        return INTERRUPTED_EXIT_CODE if self.signal == signal.SIGINT else PREEMPTED_EXIT_CODE


SIGNALS = Signals()
