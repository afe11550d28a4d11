"""The soak run: long jobs through periodic checkpoints and SIGTERM-restart cycles, watching every process.

    nice python -m bench.soak --minutes=30     # the table in bench/RESULTS.md (about 70 min in all)
    python -m bench.soak --jobs=mlp --minutes=0.1 --sample_seconds=1 --warmup_seconds=1   # tests/test_soak.py

Two jobs run side by side: a 2-worker multi_worker job (MLP 32,32 on the bundled digits; its workers are
started here with TF_CONFIG on localhost ports, as engine/launcher.py does, so each has a pid to sample and to
signal) and a mirrored one (2 logical CPUs, a tiny ResNet with synchronized batch norm on synthetic data).
Each trains for --minutes in --cycles legs. A leg ends with SIGTERM to one process, as a scheduler preempting
tasks one by one sends it: the multi-worker job's chief in odd cycles, worker 1 in even ones. Every process of
the job must then stop at the same step, save it and exit 75, and the same command must resume from exactly
that step. After the last cycle each job resumes once more and finishes a few rounds; an uninterrupted run of
the same steps (--deterministic, as the soaked run) must end with a bit-equal checkpoint: weights, optimizer
slots, counters. Start-ups, stops and that check come on top of --minutes (the check about as long again).

Every --sample_seconds, each live process's threads, RSS and open files (/proc/<pid>) are recorded. Growth
per hour is the slope fitted over each process's samples once it has trained for --warmup_seconds, pooled
over its restarts (each pid keeps its own intercept: a restart resets what a leak piled up, not its rate).

Exit code 0 when every cycle stopped and resumed exactly, nothing grew without bound and the weights matched;
1 otherwise, with the reasons last. Everything (each process's log of each leg, checkpoints) stays in --workdir.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from engine.cluster.launcher import cluster_for
from engine.cluster.signals import PREEMPTED_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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

# Growth per hour above which a quantity grows without bound, and the least rise over the sampled time that
# counts: about what a leak at the limit piles up over a 30-minute soak's sampled time (0.4 to 0.5 hours).
# Healthy workers hold their threads, RSS and files flat once they train (bench/RESULTS.md); checkpoint saves
# add about 4 threads and 2 files for a second or two, and RSS settles within the first minute. The leaks
# this is here for are far above the limits: a thread per collective is hundreds a second; a file left open
# per checkpoint, hundreds an hour. 100 MiB/hour is 2.4 GiB a day: enough to take a worker down in a long job.
LIMITS = {"threads": (50, 20), "rss_mib": (100, 50), "files": (20, 8)}
QUANTITIES = tuple(LIMITS)

STOP_SECONDS = 180  # after SIGTERM, until every process of the job has saved and exited (niced, on a busy machine)
START_SECONDS = 240  # from a leg's start until its chief logs a round (cluster forming, tracing)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="training time of each job, over all its legs")
    parser.add_argument("--cycles", type=int, default=0, help="SIGTERM-restart cycles per job; 0: one per 5 min, 2+")
    parser.add_argument("--sample_seconds", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warmup_seconds", type=float, default=60.0, help="training left out of the growth fits")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs to run: " + ", ".join(JOBS))
    parser.add_argument("--workdir", default="", help="where runs and logs go; empty: a new temporary directory")
    parser.add_argument("--data_dir", default="", help="tensorflow-datasets directory; empty: <workdir>/data")
    parser.error = lambda message: parser.exit(2, f"error: {message}\n")  # one line, as launch.py's errors
    args = parser.parse_args(argv)

    def bad(flag, why):
        parser.exit(2, f"error: --{flag}={getattr(args, flag)}: {why}\n")

    if not args.minutes > 0:
        bad("minutes", "must be a positive number")
    if args.cycles < 0:
        bad("cycles", "must be zero or positive")
    if not args.sample_seconds > 0:
        bad("sample_seconds", "must be a positive number")
    if not args.warmup_seconds >= 0:
        bad("warmup_seconds", "must be zero or positive")
    if not args.jobs or any(j not in JOBS for j in args.jobs.split(",")):
        bad("jobs", f"must name some of {', '.join(JOBS)}")
    args.jobs = args.jobs.split(",")
    args.cycles = args.cycles or max(2, round(args.minutes / 5))
    if args.workdir and os.path.exists(args.workdir) and os.listdir(args.workdir):
        bad("workdir", "exists and is not empty (a soak starts from nothing)")
    return args


class Sampler:
    """Samples the threads, RSS and open files of every registered process every `every` seconds.

    A process is `starting` until its log shows a trained round, then `training`, then `stopping` once it is
    signalled; only `training` samples after the warm-up enter the growth fits (start-up loads TensorFlow and
    traces; a stopping process saves and tears down)."""

    def __init__(self, every):
        self.every, self.t0 = every, time.monotonic()
        self.samples = []  # dicts: t, role, phase, leg, pid, threads, rss_mib, files, state, trained_for
        self.live = {}  # pid -> dict(role, phase, leg, training=time or None, stopping=time or None)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.add(os.getpid(), "driver", "driver", "")
        self.mark(os.getpid(), "training")

    def now(self):
        return time.monotonic() - self.t0

    def add(self, pid, role, phase, leg):
        with self.lock:
            self.live[pid] = dict(role=role, phase=phase, leg=leg, training=None, stopping=None)

    def mark(self, pid, state):
        with self.lock:
            if pid in self.live and self.live[pid][state] is None:
                self.live[pid][state] = self.now()

    def children(self):
        with self.lock:
            return [pid for pid in self.live if pid != os.getpid()]

    def remove(self, pid):
        with self.lock:
            self.live.pop(pid, None)

    def run(self):
        while not self.done.wait(self.every - self.now() % self.every):
            self.sample()

    def sample(self):
        t = self.now()
        with self.lock:
            live = [(pid, dict(info)) for pid, info in self.live.items()]
        for pid, info in live:
            try:
                with open(f"/proc/{pid}/status") as f:
                    status = f.read()
                files = len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                continue  # gone since it was registered
            rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
            if rss is None:
                continue  # a zombie: exited, not yet reaped
            state = "starting" if info["training"] is None else "training" if info["stopping"] is None else "stopping"
            self.samples.append(
                dict(
                    t=t,
                    pid=pid,
                    role=info["role"],
                    phase=info["phase"],
                    leg=info["leg"],
                    threads=int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1)),
                    rss_mib=int(rss.group(1)) / 1024,
                    files=files,
                    state=state,
                    trained_for=t - info["training"] if state == "training" else None,
                )
            )


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
        saved = _latest_checkpoint(os.path.join(self.root, f"{self.name}-soak", "checkpoints"))
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
        details = [f"{role} {_code(codes[role])}: {log.last_line()}" for role, (_, log) in (procs or {}).items()]
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


def _latest_checkpoint(directory):
    if not os.path.isdir(directory):
        return None
    steps = [int(m.group(1)) for m in (re.fullmatch(r"ckpt-(\d+)\.index", f) for f in os.listdir(directory)) if m]
    return max(steps, default=None)


def _code(code):
    if code is None:
        return "still running"
    return f"exit {code} ({signal.Signals(-code).name})" if code < 0 else f"exit {code}"


def growth(samples, key, warmup):
    """(slope per hour, hours sampled) of samples[key] once each process has trained for `warmup` seconds,
    fitted with one intercept per pid: None when no pid has two such samples."""
    num = den = hours = 0.0
    for pid in {s["pid"] for s in samples}:
        mine = [s for s in samples if s["pid"] == pid and _settled(s, warmup)]
        if len(mine) < 2:
            continue
        t = np.array([s["t"] for s in mine]) / 3600
        y = np.array([s[key] for s in mine], dtype=float)
        num += float(np.sum((t - t.mean()) * (y - y.mean())))
        den += float(np.sum((t - t.mean()) ** 2))
        hours += t[-1] - t[0]
    return (num / den, hours) if den else None


def _settled(sample, warmup):
    return sample["state"] == "training" and sample["trained_for"] >= warmup


def growth_table(sampler, warmup):
    """Markdown rows per process (role and phase), and the list of quantities that grew without bound."""
    lines = [
        "| process | samples | threads start -> end | RSS MiB start -> end | files start -> end "
        "| threads/h | RSS MiB/h | files/h | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    grew, unjudged = [], []
    groups = {}
    for s in sampler.samples:
        groups.setdefault((s["role"], s["phase"]), []).append(s)
    for (role, phase), samples in sorted(groups.items(), key=lambda item: _order(item[0])):
        settled = [s for s in samples if _settled(s, warmup)] or samples
        first, last = settled[0], settled[-1]
        ends = [f"{first[k]:.0f} -> {last[k]:.0f}" for k in QUANTITIES]
        slopes, verdict = [], []
        for key in QUANTITIES:
            fit = growth(samples, key, warmup)
            if fit is None:
                slopes.append("n/a")
                continue
            slope, hours = fit
            slopes.append(f"{slope:+.1f}")
            limit, floor = LIMITS[key]
            if slope > limit and slope * hours > floor:
                verdict.append(f"{key} grows")
        name = role if role == "driver" else f"{role} ({phase})"
        if "n/a" in slopes and role != "driver":
            unjudged.append(name)
        grew += [f"{name}: {v} ({slopes[QUANTITIES.index(v.split()[0])]} per hour)" for v in verdict]
        label = ", ".join(verdict) or ("too few samples" if "n/a" in slopes else "flat")
        lines.append(f"| {name} | {len(samples)} | {' | '.join(ends)} | {' | '.join(slopes)} | {label} |")
    return lines, grew, unjudged


def _order(key):
    role, phase = key
    return (role == "driver", phase != "soak", role)


def time_table(sampler):
    """Markdown: one row per sample time, a column per process: leg and state, threads / RSS MiB / files."""
    rows, columns = {}, []
    for s in sampler.samples:
        column = s["role"] if s["phase"] in ("soak", "driver") else f"{s['role']} ({s['phase']})"
        if column not in columns:
            columns.append(column)
        leg = "" if s["phase"] != "soak" else "F" if s["leg"] == "final" else f"L{s['leg']}"
        state = "" if s["state"] == "training" else s["state"]
        values = f"{s['threads']} / {s['rss_mib']:.0f} / {s['files']}"
        rows.setdefault(s["t"], {})[column] = " ".join(v for v in (leg, state, values) if v)
    columns.sort(key=lambda c: (c == "driver", "(" in c, c))
    lines = ["| min | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for t, cells in sorted(rows.items()):
        lines.append(f"| {t / 60:.2f} | " + " | ".join(cells.get(c, "-") for c in columns) + " |")
    return lines


def cycle_table(jobs):
    lines = [
        "| job | cycle | SIGTERM to | after step | stopped at (each process) | newest ckpt | exit codes | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        for c in job.cycles:
            stops = ", ".join(str(v) for v in c["stops"].values())
            codes = ", ".join(_code(v).removeprefix("exit ") for v in c["codes"].values())
            row = [job.name, c["cycle"], c["victim"], c["after"], stops, c["saved"], codes, f"{c['seconds']:.1f}"]
            lines.append("| " + " | ".join(str(v) for v in row) + " |")
    return lines


def compare_weights(soaked, reference):
    """(tensors, differing, max abs difference) between the newest checkpoints of two workdirs. Run in a
    child process: TensorFlow in this one would add its few hundred MiB to the driver's sampled RSS."""
    code = f"from bench.soak import _compare; print(_compare({soaked!r}, {reference!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def _compare(*workdirs):
    import tensorflow as tf

    tensors = []
    for workdir in workdirs:
        directory = os.path.join(workdir, "checkpoints")
        reader = tf.train.load_checkpoint(os.path.join(directory, f"ckpt-{_latest_checkpoint(directory)}"))
        names = [n for n in reader.get_variable_to_shape_map() if "save_counter" not in n]
        tensors.append({n: reader.get_tensor(n) for n in names})
    soaked, reference = tensors
    if soaked.keys() != reference.keys():
        return json.dumps([len(reference), len(soaked.keys() ^ reference.keys()), None])
    differing = [n for n in soaked if not np.array_equal(soaked[n], reference[n])]
    worst = max((float(np.max(np.abs(soaked[n].astype(float) - reference[n]))) for n in differing), default=0.0)
    return json.dumps([len(soaked), len(differing), worst])


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def prepare_data(data_dir):
    """The bundled digits, prepared once: workers that prepare them at the same time would race."""
    code = (
        "import sources.digits, tensorflow_datasets as tfds; tfds.builder('digits', data_dir=%r).download_and_prepare()"
    )
    subprocess.run([sys.executable, "-c", code % data_dir], cwd=ROOT, check=True, capture_output=True)


def main(argv=None):
    args = parse_args(argv)
    root = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    try:
        os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    except OSError as e:
        print(f"error: --workdir={args.workdir}: cannot write there ({e.strerror})", file=sys.stderr)
        return 2
    data_dir = args.data_dir or os.path.join(root, "data")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    sampler = Sampler(args.sample_seconds)

    def say(text):
        print(f"[{sampler.now() / 60:5.1f} min] {text}", flush=True)

    seconds = args.minutes * 60
    say(
        f"soak of {', '.join(args.jobs)} for {args.minutes:g} min: {args.cycles} SIGTERM-restart cycles each, "
        f"a sample every {args.sample_seconds:g} s, fits after {args.warmup_seconds:g} s of each process; {root}"
    )
    if "mlp" in args.jobs and not args.data_dir:
        prepare_data(data_dir)
    jobs = [Job(name, root, data_dir, sampler, say) for name in args.jobs]
    threading.Thread(target=sampler.run, daemon=True).start()

    def soak(job):
        try:
            job.final_step = job.soak(args.cycles, seconds / args.cycles)
        except Exception as e:  # a bug here: still report what was measured, and fail
            job.fail(f"the soak itself failed: {e!r}")
        if job.final_step is not None:
            try:
                job.compared = compare_weights(*(os.path.join(root, f"{job.name}-{p}") for p in ("soak", "reference")))
            except subprocess.CalledProcessError as e:
                job.fail(f"could not compare the checkpoints: {(e.stderr.strip().splitlines() or ['?'])[-1]}")

    # A soak stopped by SIGTERM or Ctrl-C must not leave its open-ended jobs training.
    signal.signal(signal.SIGTERM, _interrupt)
    threads = [threading.Thread(target=soak, args=(job,), daemon=True) for job in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        for pid in sampler.children():
            os.kill(pid, signal.SIGKILL)
        print(f"error: the soak was interrupted; its runs and logs are in {root}", file=sys.stderr)
        return 130
    sampler.done.set()
    sampler.sample()  # the driver's state at the end

    print("\nSamples: leg (L1.. soaked legs, F the final one), state, threads / RSS MiB / open files\n")
    print("\n".join(time_table(sampler)))
    print(
        f"\nGrowth per hour: slope after {args.warmup_seconds:g} s of each process's training, pooled over restarts\n"
    )
    lines, grew, unjudged = growth_table(sampler, args.warmup_seconds)
    print("\n".join(lines))
    print("\nSIGTERM-restart cycles\n")
    print("\n".join(cycle_table(jobs)))
    print("\nFinal weights: soaked run vs an uninterrupted run of the same steps (--deterministic)\n")
    print("| job | steps | tensors | differing | max abs difference | result |\n|---|---|---|---|---|---|")
    failures = [f for job in jobs for f in job.failures] + [f"grows without bound: {g}" for g in grew]
    failures += [f"too few samples after warm-up to judge growth: {name}" for name in unjudged]
    for job in jobs:
        compared = job.compared
        if compared is None:
            print(f"| {job.name} | {job.final_step or '-'} | - | - | - | not compared: the runs failed |")
            continue
        count, differing, worst = compared  # worst is None when the checkpoints hold different tensors
        print(
            f"| {job.name} | {job.final_step} | {count} | {differing} | {'-' if worst is None else f'{worst:.3g}'} "
            f"| {'bit-equal' if not differing else 'DIFFERENT'} |"
        )
        if differing:
            failures.append(f"{job.name}: {differing} of {count} tensors differ from the uninterrupted run")
    print()
    if failures:
        print("soak FAILED:\n" + "\n".join(f"- {f}" for f in failures))
        return 1
    print(f"soak PASSED in {sampler.now() / 60:.1f} min; runs and logs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
