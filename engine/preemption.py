"""SIGTERM and SIGINT as a graceful stop. No TensorFlow import here: launch.py installs this before
TensorFlow starts its threads."""

import os
import signal
import threading

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", as a scheduler's restart policy reads it


class Preemption:
    """Turns SIGTERM/SIGINT into a graceful stop: a flag the replica step reads, all-reduced with the
    gradients so every worker stops after the same step.

    `install()` must run before TensorFlow starts its threads (launch.py calls it first): it blocks the
    signals in every thread and waits for them in one, so they are seen even while the main thread is
    inside a long tf.function call. A second signal exits at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal = None
        self._flags = []
        self._lock = threading.Lock()

    def install(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        threading.Thread(target=self._watch, name="preemption", daemon=True).start()

    def _watch(self):
        while True:
            received = signal.sigwait(self.SIGNALS)
            if self.signal is not None:
                os._exit(128 + received)
            with self._lock:
                self.signal = received
                for flag in self._flags:
                    flag.assign(True)

    def watch(self, flag):
        """Sets `flag` (a boolean tf.Variable) when a signal arrives, or now if one already has."""
        with self._lock:
            self._flags.append(flag)
            if self.signal is not None:
                flag.assign(True)

    @property
    def signal_name(self):
        return signal.Signals(self.signal).name if self.signal is not None else "request"

    @property
    def exit_code(self):
        return PREEMPTED_EXIT_CODE if self.signal == signal.SIGTERM else 128 + int(self.signal)


PREEMPTION = Preemption()
