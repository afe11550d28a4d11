"""The soak's jobs (bench/soak.py): each one's processes, started as launch.py's workers, and its legs: trained,
ended by SIGTERM to one process, checked to stop at one step, save it and exit 75, and resumed from exactly it;
then a final leg beside an uninterrupted run of the same steps."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from bench.common import ROOT
from engine.cluster.launcher import cluster_for
from engine.cluster.signals import PREEMPTED_EXIT_CODE

# The jobs: name -> worker processes (0: one process, no cluster) and their flags. Constant learning rate:
# the soaked run's --train_steps is open-ended until its last cycle, and a schedule would depend on it.
JOBS = {
    "mlp": (
        2,
        [
            "--strategy=multi_worker",
            "--hidden_sizes=32,32",
            "--global_batch_size=64",
            "--steps_per_loop=100",
            "--checkpoint_every=500",
            "--connect_timeout=120",
        ],
    ),
    "resnet": (
        0,
        [
            "--strategy=mirrored",
            "--num_cpu_devices=2",
            "--model=resnet",
            "--resnet_depth=8",
            "--resnet_width=4",
            "--dataset=synthetic",
            "--synthetic_shape=8,8,3",
            "--synthetic_examples=512",
            "--global_batch_size=16",
            "--steps_per_loop=20",
            "--checkpoint_every=100",
        ],
    ),
}
COMMON = ["--deterministic", "--seed=3", "--keep_checkpoints=2"]
OPEN_ENDED = 10**9  # --train_steps of the soaked legs: they end by SIGTERM
FINAL_ROUNDS = 3  # the last leg resumes and trains this many --steps_per_loop rounds to the end

STOP_SECONDS = 180  # after SIGTERM, until every process of the job has saved and exited (niced, on a busy machine)
START_SECONDS = 240  # from a leg's start until its chief logs a round (cluster forming, tracing)


class Log:
    """A process's output file, read as it grows: the steps of its `train step=` lines."""

    def __init__(self, path):
        self.path, self.offset, self.last_step = path, 0, None

    def update(self):
        """Reads what was appended since the last call; returns the last step logged so far (None: none)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            new = f.read()
        new = new[: new.rfind(b"\n") + 1]  # whole lines only
        self.offset += len(new)
        steps = re.findall(rb"^train step=(\d+)", new, re.M)
        if steps:
            self.last_step = int(steps[-1])
        return self.last_step

    def text(self):
        with open(self.path, errors="replace") as f:
            return f.read()

    def last_line(self):
        lines = [line for line in self.text().splitlines() if line.strip()]
        return lines[-1][:300] if lines else "(no output)"

    def stopped_at(self):
        # "stopped by SIGTERM at step N" from the signalled process; the others learn of it from the step's
        # all-reduce and say so in their own words.
        found = re.search(r"stopped by [^\n]*? at step (\d+)", self.text())
        return int(found.group(1)) if found else None

    def resumed_at(self):
        found = re.search(r"^resumed from step (\d+)", self.text(), re.M)
        return int(found.group(1)) if found else 0


class Job:
    """One training job: its command, its processes, the legs it has run and what went wrong."""

    def __init__(self, name, root, data_dir, sampler, say):
        self.name, self.root, self.sampler, self.say = name, root, sampler, say
        self.workers, flags = JOBS[name]
        self.flags = [*COMMON, *flags, f"--data_dir={data_dir}"]
        self.roles = [f"{name} worker {i}" for i in range(self.workers)] or [name]
        self.cycles = []  # one dict per SIGTERM-restart cycle
        self.failures = []
        self.final_step = None
        self.compared = None  # (tensors, differing, max abs difference) of the final checkpoints

    def start(self, phase, leg, train_steps):
        """Starts every process of the job; returns {role (and phase, but for the soaked run): (Popen, Log)}."""
        workdir = os.path.join(self.root, f"{self.name}-{phase}")
        cluster = cluster_for("multi_worker", self.workers, 0) if self.workers else None
        procs = {}
        for index, role in enumerate(self.roles):
            env = dict(os.environ)
            if cluster:
                env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            path = os.path.join(self.root, "logs", f"{role.replace(' ', '-')}-{phase}-{leg}.log")
            with open(path, "w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "launch.py", f"--workdir={workdir}", f"--train_steps={train_steps}", *self.flags],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            procs[role if phase == "soak" else f"{role} ({phase})"] = (proc, Log(path))
            self.sampler.add(proc.pid, role, phase, leg)
        return procs

    def fail(self, why):
        self.failures.append(f"{self.name}: {why}")
        self.say(f"{self.name}: FAILED: {why}")

    def soak(self, cycles, leg_seconds):
        """The soaked run: `cycles` legs that each train `leg_seconds` and end in SIGTERM, then a leg that
        resumes and runs a few rounds to its end while, side by side, an uninterrupted run does the same steps.
        Returns the final step, or None after a failure (in self.failures)."""
        resumed = 0
        for cycle in range(1, cycles + 1):
            procs = self.start("soak", cycle, OPEN_ENDED)
            try:
                resumed = self._cycle(cycle, leg_seconds, procs, resumed)
            finally:
                self._end(procs)
            if resumed is None:
                return None
        end = resumed + FINAL_ROUNDS * int(_flag(self.flags, "steps_per_loop"))
        self.say(f"{self.name}: the final leg to step {end}, and the same steps uninterrupted")
        final, reference = self.start("soak", "final", end), self.start("reference", 1, end)
        procs = {**final, **reference}
        timeout = 2 * cycles * leg_seconds + START_SECONDS + 300
        try:
            codes = self._poll(procs, timeout, until_all=True, end=end)
        finally:
            self._end(procs)
        if any(code is None for code in codes.values()):
            return self._failed(f"final leg and reference run: not done within {timeout:.0f} s (killed)", procs, codes)
        if any(codes.values()):
            return self._failed("final leg and reference run: expected exit code 0 from every process", procs, codes)
        for what, group, start in (("final leg", final, resumed), ("uninterrupted reference run", reference, 0)):
            said = next(iter(group.values()))[1].resumed_at()
            if said != start:
                return self._failed(f"{what}: resumed from step {said}, not {start}")
        return end

    def _cycle(self, cycle, leg_seconds, procs, resumed):
        """One leg: trains for `leg_seconds` after its first round, SIGTERM to one process, checks the stop.
        Returns the step every process stopped and saved at, or None after a failure."""
        chief, leg = procs[self.roles[0]], f"leg {cycle}"
        codes = self._poll(procs, START_SECONDS, until=lambda: chief[1].last_step is not None)
        if chief[1].last_step is None:
            why = "exited" if any(c is not None for c in codes.values()) else f"trained no round in {START_SECONDS} s"
            return self._failed(f"{leg}: {why} before its SIGTERM", procs, codes)
        if chief[1].resumed_at() != resumed:
            return self._failed(f"{leg}: resumed from step {chief[1].resumed_at()}, not {resumed}", procs, codes)
        codes = self._poll(procs, leg_seconds)
        if any(c is not None for c in codes.values()):
            return self._failed(f"{leg}: exited before its SIGTERM", procs, codes)
        victim = self.roles[(cycle - 1) % len(self.roles)]
        what = f"cycle {cycle}: SIGTERM to {victim} after step {chief[1].last_step}"
        self.cycles.append(dict(cycle=cycle, victim=victim, after=chief[1].last_step))
        for proc, _ in procs.values():
            self.sampler.mark(proc.pid, "stopping")
        procs[victim][0].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        codes = self._poll(procs, STOP_SECONDS, until_all=True)
        stops = {role: log.stopped_at() for role, (_, log) in procs.items()}
        saved = latest_checkpoint(os.path.join(self.root, f"{self.name}-soak", "checkpoints"))
        self.cycles[-1].update(codes=codes, stops=stops, saved=saved, seconds=time.monotonic() - sent)
        if any(code is None for code in codes.values()):
            return self._failed(f"{what}: still running {STOP_SECONDS} s later (killed)", procs, codes)
        if any(code != PREEMPTED_EXIT_CODE for code in codes.values()):
            return self._failed(f"{what}: expected exit code {PREEMPTED_EXIT_CODE} from every process", procs, codes)
        if len(set(stops.values())) != 1:
            return self._failed(f"{what}: the processes stopped at steps {stops}", procs, codes)
        if saved != stops[self.roles[0]]:
            return self._failed(
                f"{what}: stopped at step {stops[self.roles[0]]}, newest checkpoint {saved}", procs, codes
            )
        seconds = self.cycles[-1]["seconds"]
        self.say(f"{self.name} {what}: every process stopped at step {saved}, saved it, exit 75 in {seconds:.1f} s")
        return saved

    def _failed(self, why, procs=None, codes=None):
        """Records a failure with each process's exit code and last line; returns None."""
        details = [f"{role} {exit_text(codes[role])}: {log.last_line()}" for role, (_, log) in (procs or {}).items()]
        self.fail("; ".join([why, *details]))
        return None

    def _poll(self, procs, timeout, until=None, until_all=False, end=None):
        """Watches a leg for up to `timeout` seconds: marks each process as training once it has logged a round
        (and as stopping once it has logged step `end`). Returns early when `until()` holds or a process has
        ended (every process, with `until_all`). Returns {role: exit code, or None while it runs}."""
        deadline = time.monotonic() + timeout
        while True:
            for proc, log in procs.values():
                step = log.update()
                if step is not None:
                    self.sampler.mark(proc.pid, "training")
                if end is not None and step is not None and step >= end:
                    self.sampler.mark(proc.pid, "stopping")  # the final evaluation, save and exit
            codes = {role: proc.poll() for role, (proc, _) in procs.items()}
            ended = [code is not None for code in codes.values()]
            if (all(ended) if until_all else any(ended)) or (until and until()) or time.monotonic() >= deadline:
                return codes
            time.sleep(0.2)

    def _end(self, procs):
        """Kills what is left of a leg (after a failure) and stops sampling its processes."""
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self.sampler.remove(proc.pid)


def _flag(flags, name):
    return next(f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}="))


def latest_checkpoint(directory):
    if not os.path.isdir(directory):
        return None
    steps = [int(m.group(1)) for m in (re.fullmatch(r"ckpt-(\d+)\.index", f) for f in os.listdir(directory)) if m]
    return max(steps, default=None)


def exit_text(code):
    if code is None:
        return "still running"
    return f"exit {code} ({signal.Signals(-code).name})" if code < 0 else f"exit {code}"


def cycle_table(jobs):
    lines = [
        "| job | cycle | SIGTERM to | after step | stopped at (each process) | newest ckpt | exit codes | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        for c in job.cycles:
            stops = ", ".join(str(v) for v in c["stops"].values())
            codes = ", ".join(exit_text(v).removeprefix("exit ") for v in c["codes"].values())
            row = [job.name, c["cycle"], c["victim"], c["after"], stops, c["saved"], codes, f"{c['seconds']:.1f}"]
            lines.append("| " + " | ".join(str(v) for v in row) + " |")
    return lines
