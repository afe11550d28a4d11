"""What the soak watches (bench/soak.py): every live process's threads, RSS and open files, sampled from /proc, and
their growth per hour once each process trains, fitted over its restarts."""

import os
import re
import threading
import time

import numpy as np

# Growth per hour above which a quantity grows without bound, and the least rise over the sampled time that
# counts: about what a leak at the limit piles up over a 30-minute soak's sampled time (0.4 to 0.5 hours).
# Healthy workers hold their threads, RSS and files flat once they train (bench/RESULTS.md); checkpoint saves
# add about 4 threads and 2 files for a second or two, and RSS settles within the first minute. The leaks
# this is here for are far above the limits: a thread per collective is hundreds a second; a file left open
# per checkpoint, hundreds an hour. 100 MiB/hour is 2.4 GiB a day: enough to take a worker down in a long job.
LIMITS = {"threads": (50, 20), "rss_mib": (100, 50), "files": (20, 8)}
QUANTITIES = tuple(LIMITS)


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
