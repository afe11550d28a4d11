"""Preemption: a multi-worker job stops at one saved step whichever worker the scheduler signals; outside the
training loop (start-up, continuous evaluation; Ctrl-C while a cluster forms) a signal ends the process at once.
A resumed run evaluates the evaluation step it stopped at, once, and reports the train loss of a run never stopped."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from engine.cluster.signals import PREEMPTED_EXIT_CODE
from engine.run import loop, program
from engine.run.program import TrainProgram
from engine.settings.errors import Preempted
from engine.state import checkpoint
from tests import helpers
from tests.helpers import checkpoint_tensors, logged_steps

ROUND = 500  # steps per round (over a second of training on 2 cores): the signal lands inside the second one
FINAL = 2 * ROUND + 20  # the resumed run ends past the second round, wherever the signal stopped it


@contextlib.contextmanager
def running(workdir, *args, env=None):
    """`python launch.py --workdir=workdir *args`, killed if still running when the block ends."""
    proc = helpers.start_launch(workdir, *args, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def worker_env(cluster, index):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}


def wait_until(condition, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_job(workdir, data_dir, train_steps, signalled=None):
    """A 2-worker job; worker `signalled` gets SIGTERM once the first round is logged. Returns the workers'
    (returncode, stdout, stderr)."""
    cluster = {"worker": [f"localhost:{p}" for p in helpers.free_ports(2)]}
    args = [
        f"--data_dir={data_dir}",
        "--strategy=multi_worker",
        "--deterministic",
        f"--steps_per_loop={ROUND}",
        "--checkpoint_every=0",
        "--hidden_sizes=32",
        "--connect_timeout=120",
        "--collective_timeout=120",
        f"--train_steps={train_steps}",
    ]
    with running(workdir, *args, env=worker_env(cluster, 0)) as chief:
        with running(workdir, *args, env=worker_env(cluster, 1)) as other:
            procs = [chief, other]
            if signalled is not None:
                wait_until(lambda: logged_steps(workdir), chief)
                procs[signalled].send_signal(signal.SIGTERM)
            outputs = [p.communicate(timeout=240) for p in procs]
            return [(p.returncode, *output) for p, output in zip(procs, outputs)]


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    results = run_job(workdir, data_dir, FINAL)
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:]
    return workdir


@pytest.mark.parametrize("signalled", [0, 1], ids=["chief", "worker1"])
@pytest.mark.slow
def test_sigterm_to_one_worker_stops_every_worker_at_one_saved_step(data_dir, tmp_path, uninterrupted, signalled):
    results = run_job(tmp_path, data_dir, 1_000_000, signalled)
    assert [code for code, _, _ in results] == [PREEMPTED_EXIT_CODE] * 2, [err[-1500:] for _, _, err in results]
    last_lines = [err.strip().splitlines()[-1] for _, _, err in results]
    stopped = int(re.search(r"at step (\d+);", last_lines[0]).group(1))
    assert ROUND < stopped < FINAL  # inside the second round: the step loop itself noticed
    saved = os.path.join(tmp_path, "checkpoints", f"ckpt-{stopped}")
    for index, line in enumerate(last_lines):
        cause = "stopped by SIGTERM" if index == signalled else "stopped by a peer worker's signal"
        assert (
            line == f"error: preempted: {cause} at step {stopped}; checkpoint {saved}; run the same command to resume"
        )
    assert checkpoint.latest(tmp_path / "checkpoints") == saved
    assert not any(name.startswith(".worker") for name in os.listdir(tmp_path / "checkpoints"))
    assert logged_steps(tmp_path) == [ROUND, stopped]

    results = run_job(tmp_path, data_dir, FINAL)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:]
    assert f"resumed from step {stopped}" in results[0][1]
    # No step redone, none lost: the resumed rounds end at the next multiple of ROUND and at the end.
    assert logged_steps(tmp_path) == [ROUND, stopped] + ([2 * ROUND] if stopped < 2 * ROUND else []) + [FINAL]
    (path_a, a), (path_b, b) = checkpoint_tensors(uninterrupted), checkpoint_tensors(tmp_path)
    assert path_a.endswith(f"ckpt-{FINAL}") and path_b.endswith(f"ckpt-{FINAL}") and a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.slow
def test_workers_that_restore_different_steps_are_refused_before_they_train(data_dir, tmp_path):
    # Each worker on a disk of its own: worker 0 resumed from step 2, worker 1 started at 0. The chief logged and
    # saved steps 3 and 4 of replicas that disagreed, then both ended in a traceback (a collective's shape mismatch).
    chief, other = tmp_path / "chief", tmp_path / "other"
    args = [f"--data_dir={data_dir}", "--dataset=synthetic", "--hidden_sizes=32", "--steps_per_loop=2"]
    assert helpers.launch(f"--workdir={chief}", *args, "--train_steps=2").returncode == 0
    cluster = {"worker": [f"localhost:{p}" for p in helpers.free_ports(2)]}
    args += ["--strategy=multi_worker", "--train_steps=4", "--connect_timeout=120", "--collective_timeout=120"]
    with (
        running(chief, *args, env=worker_env(cluster, 0)) as first,
        running(other, *args, env=worker_env(cluster, 1)) as second,
    ):
        outputs = [p.communicate(timeout=240)[1] for p in (first, second)]
    assert [first.returncode, second.returncode] == [2, 2], [err[-2000:] for err in outputs]
    said = "(each restored what its workdir holds): every worker must read the same workdir, on storage they all see"
    assert outputs[0].strip().splitlines()[-1] == (
        f"error: --workdir={chief}: this worker starts at step 2, another worker of the job at step 0 {said} (a "
        "node's own disk gives each its own)"
    )
    assert f"this worker starts at step 0, another worker of the job at step 2 {said}" in outputs[1]
    assert logged_steps(chief) == [2] and checkpoint.latest(chief / "checkpoints").endswith("ckpt-2")


def signals_blocked(pid):
    """True once launch.py installed the preemption watcher (it blocks SIGTERM in the main thread)."""
    with open(f"/proc/{pid}/status") as f:
        blocked = int(re.search(r"^SigBlk:\s+([0-9a-f]+)", f.read(), re.M).group(1), 16)
    return bool(blocked & (1 << (signal.SIGTERM - 1)))


def test_sigterm_during_start_up_exits_at_once_saving_nothing(data_dir, tmp_path):
    with running(tmp_path, f"--data_dir={data_dir}", "--hidden_sizes=32") as proc:
        wait_until(lambda: signals_blocked(proc.pid), proc)  # the watcher is up; TensorFlow is still loading
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert err.strip().splitlines() == [
        "error: preempted: stopped by SIGTERM outside the training loop (nothing to save)"
    ]
    assert not os.path.exists(tmp_path / "checkpoints") and logged_steps(tmp_path) == []


def _slow_flag_checks(tmp_path, tasks_only=False):
    """The environment of a launch.py whose flag checks stop in a fake tensorflow-datasets (--dataset=mnist imports
    it), which prints "checking" first; `tasks_only`: only in a task (TF_CONFIG set), not in the launcher."""
    fake = tmp_path / "fake" / "tensorflow_datasets"
    fake.mkdir(parents=True)
    wait = "import os, time\nif 'TF_CONFIG' in os.environ or not {}:\n    print('checking', flush=True)\n"
    (fake / "__init__.py").write_text(wait.format(tasks_only) + "    time.sleep(300)\nbuilder_cls = str\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "fake"), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("signum,code,verb", [(signal.SIGTERM, 75, "preempted"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_while_the_flags_are_checked_is_one_line(tmp_path, signum, code, verb):
    # Before the watcher was up (imports, flag checks) Ctrl-C ended in a KeyboardInterrupt traceback, killed by
    # SIGINT; SIGTERM killed the process, 143 and no word, where a preemption is 75.
    with running(tmp_path / "run", "--dataset=mnist", env=_slow_flag_checks(tmp_path)) as proc:
        assert proc.stdout.readline() == "checking\n"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    name = signal.Signals(signum).name
    assert (proc.returncode, err.splitlines()) == (
        code,
        [f"error: {verb}: stopped by {name} outside the training loop (nothing to save)"],
    )


def test_ctrl_c_as_local_workers_start_stops_each_in_one_line(tmp_path):
    # The launcher forwarded it to tasks still importing: a traceback from each, killed by SIGINT.
    args = ["--strategy=multi_worker", "--local_workers=2", "--local_cluster_network=host", "--dataset=mnist"]
    with running(tmp_path / "run", *args, env=_slow_flag_checks(tmp_path, tasks_only=True)) as proc:
        seen = [proc.stdout.readline() for _ in range(5)]  # two tasks started, the network, two checking
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert sorted(line for line in seen if "checking" in line) == ["[worker 0] checking\n", "[worker 1] checking\n"]
    said = "error: interrupted: stopped by SIGINT outside the training loop (nothing to save)"
    assert proc.returncode == 130 and err == "", err[-2000:]
    assert sorted(out.splitlines()) == [
        "[launcher] job finished with exit code 130",
        f"[worker 0] {said}",
        f"[worker 1] {said}",
    ]


def test_ctrl_c_while_the_cluster_forms_ends_the_process_at_once(tmp_path):
    # Worker 1 never comes: worker 0 waits for it inside TensorFlow, which holds Python's lock meanwhile.
    cluster = {"worker": [f"localhost:{p}" for p in helpers.free_ports(2)]}
    host, port = cluster["worker"][0].split(":")

    def listening():
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return True
        return False

    args = ["--strategy=multi_worker", "--dataset=synthetic", "--connect_timeout=300"]
    with running(tmp_path, *args, env=worker_env(cluster, 0)) as proc:
        wait_until(listening, proc)  # its server is up: it is waiting for the peer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # far less than --connect_timeout
    assert proc.returncode == -signal.SIGINT, err[-2000:]  # SIGINT's default action: the shell reports 130
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("signum,code,verb", [(signal.SIGTERM, 75, "preempted"), (signal.SIGINT, 130, "interrupted")])
def test_continuous_eval_exits_on_the_first_signal(data_dir, tmp_path, signum, code, verb):
    with running(tmp_path, "--mode=continuous_eval", f"--data_dir={data_dir}", "--eval_timeout=300") as proc:
        assert proc.stdout.readline().startswith("continuous_eval: following")  # polling for checkpoints
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    name = signal.Signals(signum).name
    assert (
        err.strip().splitlines()[-1] == f"error: {verb}: stopped by {name} outside the training loop (nothing to save)"
    )


def test_ctrl_c_in_training_saves_and_says_interrupted(data_dir, tmp_path):
    # Rounds of 20000 steps last seconds even at 8000 steps a second: the signal lands inside the second one.
    args = [f"--data_dir={data_dir}", "--hidden_sizes=32", "--steps_per_loop=20000", "--train_steps=1000000"]
    with running(tmp_path, *args, "--checkpoint_every=0") as proc:
        wait_until(lambda: logged_steps(tmp_path), proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    stopped = int(re.search(r"at step (\d+);", err).group(1))
    saved = os.path.join(tmp_path, "checkpoints", f"ckpt-{stopped}")
    assert err.strip().splitlines()[-1] == (
        f"error: interrupted: stopped by SIGINT at step {stopped}; checkpoint {saved}; run the same command to resume"
    )
    assert checkpoint.latest(tmp_path / "checkpoints") == saved and logged_steps(tmp_path) == [20000, stopped]


# ---- A run preempted inside training, resumed in the same process: what it reports ----------------------------

# Windows of 5 steps, an evaluation at each window's end; the same numbers in every run of them.
WINDOWS = dict(
    train_steps=10, steps_per_loop=5, eval_every=5, checkpoint_every=0, jit_compile=False, deterministic=True
)


def _stop_at_round(monkeypatch, first_step):
    """The round that starts at `first_step` runs with the stop flag set, as a signal during its first step sets it."""
    real = TrainProgram.run_round

    def run_round(self, iterator, steps, extras=frozenset()):
        if int(self.state.step.numpy()) == first_step:
            self.stop.assign(True)
        return real(self, iterator, steps, extras)

    monkeypatch.setattr(TrainProgram, "run_round", run_round)


def _jsonl(workdir, name):
    return [json.loads(line) for line in open(os.path.join(workdir, name))]


@pytest.fixture(scope="module")
def straight(data_dir, one_device, tmp_path_factory):
    """The run never interrupted: (workdir, summary)."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    return workdir, loop.train(helpers.make_config(data_dir, workdir, **WINDOWS), one_device)


def test_a_resumed_run_evaluates_the_step_it_stopped_at_and_keeps_the_train_loss(
    data_dir, one_device, tmp_path, monkeypatch, straight
):
    config = helpers.make_config(data_dir, str(tmp_path), **WINDOWS)
    # On an accelerator a stop comes at the round's end: here step 5, where an evaluation is due, skipped as the
    # run stops. The resumed run evaluates it.
    monkeypatch.setattr(program, "stops_each_step", lambda strategy: False)
    _stop_at_round(monkeypatch, 0)
    with pytest.raises(Preempted, match="at step 5;"):
        loop.train(config, one_device)
    assert logged_steps(tmp_path, "eval.jsonl") == []
    monkeypatch.undo()
    _stop_at_round(monkeypatch, 5)  # on a CPU at the step: after step 6, inside the last window (steps 6-10)
    with pytest.raises(Preempted, match="at step 6;"):
        loop.train(config, one_device)
    monkeypatch.undo()
    summary = loop.train(config, one_device)

    assert _jsonl(tmp_path, "eval.jsonl") == _jsonl(straight[0], "eval.jsonl")  # steps 5 and 10, once each
    assert summary["eval"] == straight[1]["eval"]
    records, uninterrupted = _jsonl(tmp_path, "metrics.jsonl"), _jsonl(straight[0], "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 6, 10] and [r["step"] for r in uninterrupted] == [5, 10]
    assert [r["skipped_steps"] for r in records] == [0, 0, 0]
    # Each line holds the mean since its previous line (step 6; steps 7-10). The summary's train_loss is the mean
    # over the last window, steps 6-10, as the run never interrupted reports it.
    assert records[0]["loss"] == uninterrupted[0]["loss"] and records[2]["loss"] != uninterrupted[1]["loss"]
    assert summary["train_loss"] == straight[1]["train_loss"] == uninterrupted[1]["loss"]


def test_a_run_stopped_where_its_own_actions_are_due_keeps_their_records(data_dir, one_device, tmp_path, monkeypatch):
    # A fork's actions (here histograms and update ratios, due every 5 steps) record the round a signal stops the run
    # at, before the checkpoint and the stop: the resumed run starts after that step and never records it again.
    settings = dict(WINDOWS, actions="histograms,update_ratios", histogram_every=5, update_ratio_every=5)

    def recorded(workdir):
        values = helpers.tensorboard_values(os.path.join(workdir, "train"), lambda v: "/" in v.tag)
        return {tag: sorted(steps) for tag, steps in values.items() if tag.startswith(("weights/", "update_ratio/"))}

    straight = str(tmp_path / "straight")
    loop.train(helpers.make_config(data_dir, straight, **settings), one_device)
    config = helpers.make_config(data_dir, str(tmp_path / "stopped"), **settings)
    monkeypatch.setattr(program, "stops_each_step", lambda strategy: False)  # an accelerator's: at the round's end
    _stop_at_round(monkeypatch, 0)
    with pytest.raises(Preempted, match="at step 5;"):
        loop.train(config, one_device)
    monkeypatch.undo()
    loop.train(config, one_device)
    expected = recorded(straight)
    assert expected and all(steps == [5, 10] for steps in expected.values()), expected
    assert recorded(config.workdir) == expected


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_signal_that_exits_at_once_leaves_no_lock_behind(tmp_path, signum, code):
    # Outside the training loop (its final evaluation, a sidecar) a signal exits at once: the workdir's lock goes
    # with it. Left behind, a restart in another container (a rescheduled pod) waited a minute for its heartbeat and
    # then warned of taking over a lock "from pid N, which is gone".
    script = (
        "import sys, time\n"
        f"sys.path.insert(0, {helpers.ROOT!r})\n"
        "from engine.cluster.signals import SIGNALS\n"
        "SIGNALS.install()\n"
        "from engine.state.lock import Lock\n"
        f"with Lock({str(tmp_path)!r}):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        assert os.path.exists(tmp_path / "train.lock")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1].endswith("outside the training loop (nothing to save)")
    assert not os.path.exists(tmp_path / "train.lock")
