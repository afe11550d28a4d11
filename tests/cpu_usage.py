"""Where the suite's CPU time goes: `python -m pytest -p tests.cpu_usage` ends with the CPU-seconds of each module,
its own process's and those of the processes its tests started (launch.py runs, worker processes), the modules
in order of cost, then the costliest tests.

The suite's budget is in CPU-seconds (README): on two cores, wall time is about half of them at best, and
a timed wall-clock figure on a shared machine says more about the neighbours than about the suite. A test's
children are counted once they have been waited for, killed ones too (resource.RUSAGE_CHILDREN, and the fork server's
report for those it forked).
"""

import collections
import json
import os
import resource
import sys
import tempfile
import time

import pytest

LOG = "ENGINE_TESTS_CPU_LOG"  # the file every test process appends its records to
SHOWN = 15  # the costliest tests listed after the modules


def _cpu(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _started():
    """CPU-seconds of the processes this one started and waited for: its own children, and those tests/forkserver.py
    forked for it (the fork server's children, which RUSAGE_CHILDREN does not see)."""
    forked = sys.modules.get("tests.forkserver")
    return _cpu(resource.RUSAGE_CHILDREN) + (forked.CHILD_CPU[0] if forked else 0.0)


def pytest_configure(config):
    # Set before pytest -n starts its worker processes, which inherit it.
    # A path given in the environment keeps the records there after the report (one JSON line a test).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if LOG in os.environ:
        config._cpu_usage_log, config._cpu_usage_keep = os.environ[LOG], True
        open(os.environ[LOG], "w").close()
    else:
        handle, path = tempfile.mkstemp(prefix="engine-tests-cpu-", suffix=".jsonl")
        os.close(handle)
        os.environ[LOG] = path
        config._cpu_usage_log, config._cpu_usage_keep = path, False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Wall-clock time, not monotonic: the report lines up the starts of tests run in different processes.
    own, children, started = _cpu(resource.RUSAGE_SELF), _started(), time.time()
    yield
    record = {
        "test": item.nodeid,
        "own": _cpu(resource.RUSAGE_SELF) - own,
        "children": _started() - children,
        "wall": time.time() - started,
        # Which test process ran it, and when: the report's lines on each process's idle time.
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "start": started,
    }
    with open(os.environ[LOG], "a") as f:
        f.write(json.dumps(record) + "\n")


def summary(records, shown=SHOWN):
    """The report's lines from the tests' records."""
    modules = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        module = modules[r["test"].split("::")[0]]
        module[0] += r["own"]
        module[1] += r["children"]
        module[2] += 1
    own, children = sum(m[0] for m in modules.values()), sum(m[1] for m in modules.values())
    lines = [
        f"CPU-seconds of {len(records)} tests: {own + children:.0f} ({own:.0f} in pytest's processes, "
        f"{children:.0f} in processes the tests started; start-up and collection not included)"
    ]
    lines.append("   total      own  started  tests  module")
    for name, (o, c, n) in sorted(modules.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        lines.append(f"{o + c:8.1f} {o:8.1f} {c:8.1f} {n:6d}  {name}")
    lines.extend(_workers(records))
    lines.append(f"the {shown} costliest tests:")
    for r in sorted(records, key=lambda r: -(r["own"] + r["children"]))[:shown]:
        lines.append(f"{r['own'] + r['children']:8.1f} {r['own']:8.1f} {r['children']:8.1f}  {r['test']}")
    # A test whose wall time is well above its CPU time held its test process while using less than a core: its
    # processes waited (a timeout, a poll, a peer's start) or stood aside while the other test process's work held
    # the cores; the first is time two cores spend on nothing.
    lines.append(f"the {shown} tests with the most wall time beyond their CPU time:")
    lines.append("  beyond     wall      CPU  test")
    waits = sorted(records, key=lambda r: -(r["wall"] - r["own"] - r["children"]))[:shown]
    for r in waits:
        cpu = r["own"] + r["children"]
        lines.append(f"{r['wall'] - cpu:8.1f} {r['wall']:8.1f} {cpu:8.1f}  {r['test']}")
    return lines


def _workers(records):
    """A line per test process: how long its tests ran against the span from the session's first test's start to
    its last test's end. The difference is time that process held no test (it waited for a module to take, or had
    none left while another finished): on two cores, wall time the suite could have used."""
    timed = [r for r in records if "start" in r]
    if not timed:
        return []
    first, last = min(r["start"] for r in timed), max(r["start"] + r["wall"] for r in timed)
    lines = [f"test processes over the {last - first:.0f} s from the first test's start to the last one's end:"]
    for worker in sorted({r["worker"] for r in timed}):
        mine = [r for r in timed if r["worker"] == worker]
        busy, done = sum(r["wall"] for r in mine), max(r["start"] + r["wall"] for r in mine)
        lines.append(
            f"  {worker}: {len(mine)} tests, {busy:.0f} s running them, idle {last - first - busy:.0f} s "
            f"({last - done:.0f} s of it after its last test)"
        )
    return lines


def pytest_terminal_summary(terminalreporter, config):
    path = getattr(config, "_cpu_usage_log", None)
    if path is None:  # a worker process: the controlling one reports
        return
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not config._cpu_usage_keep:
        os.remove(path)
    terminalreporter.section("CPU time")
    for line in summary(records):
        terminalreporter.write_line(line)
