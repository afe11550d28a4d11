"""A workdir holds one run: other settings are refused, one process trains at a time, the files stay consistent
through a kill at any moment, damaged bookkeeping is rebuilt from the checkpoints, and the other modes rebuild the
run from its config.json."""

import dataclasses
import gc
import json
import logging
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.util import event_pb2

from engine.run import build, loop
from engine.run import modes as evaluate
from engine.run.controller import Controller
from engine.run.program import TrainProgram
from engine.settings import plugins
from engine.settings.config import load_run_config, validate
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from engine.state import checkpoint, report
from engine.state import lock as lock_lib
from engine.state import workdir as workdir_lib
from research import ensemble
from tests import forkserver, helpers
from tests.helpers import DOC_PAGES, ROOT, bash_blocks, logged_steps


def files(workdir, names=("config.json", "metrics.jsonl", "eval.jsonl", "summary.json")):
    return {name: (workdir / name).read_bytes() for name in names}


def jsonl(path):
    return [json.loads(line) for line in open(path)]


def event_steps(directory, tag):
    """The steps of TensorBoard scalar `tag` over every events file in `directory`, sorted."""
    steps = []
    for path in tf.io.gfile.glob(os.path.join(directory, "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(record.numpy())
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return sorted(steps)


# 1. One run per workdir: its identity settings.


def test_a_run_with_other_settings_is_refused_naming_them(data_dir, one_device, tmp_path):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10)
    loop.train(config, one_device)
    before = files(tmp_path)
    with pytest.raises(ConfigError) as refused:
        loop.train(dataclasses.replace(config, learning_rate=0.01, seed=1, deterministic=True), one_device)
    message = str(refused.value)
    assert message.startswith(f"--workdir={tmp_path} holds a run with other settings")
    assert "--learning_rate=0.001 there, 0.01 here; --seed=0 there, 1 here" in message
    assert "deterministic" not in message and f"new --workdir ({tmp_path}-2 is free)" in message
    assert files(tmp_path) == before


def test_a_parameter_server_runs_settings_read_back_on_a_cluster_of_another_size(tmp_path, monkeypatch):
    # Trained with --local_workers=2 --num_ps=2 (its tasks save --num_ps=2 beside their TF_CONFIG), its resume or
    # evaluation on a TF_CONFIG cluster of three parameter servers refused the run's own config.json as a typed
    # --num_ps=2 is ("drop it"): no one could, and the run could not go on where it was moved.
    (tmp_path / "config.json").write_text(json.dumps({"strategy": "parameter_server", "num_ps": 2}))
    ps = ["localhost:3", "localhost:4", "localhost:5"]
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ps}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    saved = load_run_config(str(tmp_path))
    assert (saved.strategy, saved.num_ps) == ("parameter_server", 2)
    with pytest.raises(ConfigError, match="^--num_ps=2: the cluster is TF_CONFIG's, whose 'ps' job lists 3 "):
        validate(Config(strategy="parameter_server", num_ps=2, workdir=str(tmp_path)))  # typed: still refused


def test_a_run_resumed_from_its_checkpoint_of_step_0_says_it_resumed_at_0(data_dir, one_device, tmp_path, monkeypatch):
    # A process that ended after --save_initial's checkpoint and before its first step: the next one said "resumed
    # from step 0", and its summary that it had resumed nowhere (resumed_at null, as a run trained in one process).
    config = helpers.make_config(data_dir, str(tmp_path), save_initial=True, train_steps=2, steps_per_loop=1)

    def killed(controller):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Controller, "train", killed)
        with pytest.raises(KeyboardInterrupt):
            loop.train(config, one_device)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == ["ckpt-0"]
    summary = loop.train(config, one_device)
    assert (summary["resumed_at"], summary["step"]) == (0, 2)


@pytest.mark.slow
def test_same_command_resumes_more_steps_continue_and_cadence_never_blocks(
    data_dir, one_device, mirrored, tmp_path, capsys
):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, checkpoint_every=10)
    first = loop.train(config, one_device)
    assert loop.train(config, one_device) == first
    assert "already trained to step 20" in capsys.readouterr().out
    # Other cadence, logging and execution settings (two replicas instead of one), and more steps: it continues.
    longer = dataclasses.replace(
        config, train_steps=30, steps_per_loop=5, eval_every=5, checkpoint_every=5, keep_checkpoints=1
    )
    summary = loop.train(longer, mirrored)
    out = capsys.readouterr().out
    assert "resumed from step 20" in out and "--train_steps=30 (was 20): training on to step 30" in out
    assert summary["step"] == 30 and summary["num_replicas"] == 2
    assert first["resumed_at"] is None and summary["resumed_at"] == 20  # what its time and rate count from
    assert logged_steps(tmp_path) == [10, 20, 25, 30] and logged_steps(tmp_path, "eval.jsonl") == [20, 25, 30]
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == ["ckpt-30"]
    before = files(tmp_path)
    with pytest.raises(ConfigError, match=rf"--train_steps=25: the run in {tmp_path} is already at step 30"):
        loop.train(dataclasses.replace(longer, train_steps=25), one_device)
    assert files(tmp_path) == before


def test_with_a_compile_cache_a_run_with_nothing_left_to_train_traces_nothing(
    data_dir, one_device, tmp_path, capsys, monkeypatch
):
    """--compile_cache traces the step before restoring (loop.train); a rerun of a finished run, and one refused for
    fewer --train_steps, are told by the newest checkpoint's name and trace nothing before they end."""
    traced = []
    trace = TrainProgram.trace
    monkeypatch.setattr(TrainProgram, "trace", lambda self: traced.append(1) or trace(self))
    workdir = tmp_path / "run"
    config = helpers.make_config(
        data_dir, str(workdir), train_steps=4, steps_per_loop=2, jit_compile="true", compile_cache=str(tmp_path / "c")
    )
    first = loop.train(config, one_device)
    assert traced == [1]
    assert loop.train(config, one_device) == first and "already trained to step 4" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=rf"--train_steps=2: the run in {workdir} is already at step 4"):
        loop.train(dataclasses.replace(config, train_steps=2), one_device)
    assert traced == [1]
    summary = loop.train(dataclasses.replace(config, train_steps=6), one_device)  # one that trains on traces first
    assert summary["step"] == 6 and traced == [1, 1]


def _readme_commands():
    """Every `python launch.py` command of the bash blocks of the README and then of the docs/ pages, in order, as
    argument lists."""
    pages = [page for page in DOC_PAGES if page != "BUILD.md"]  # BUILD.md: cluster commands, one per host
    commands = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as f:
            lines = [line for block in bash_blocks(f.read()) for line in block]
        for line in lines:
            words = shlex.split(line.split(" #")[0])
            if "launch.py" in words:
                commands.append(words[words.index("launch.py") + 1 :])
    return commands


def test_readme_commands_pasted_in_order_never_meet_another_run(monkeypatch):
    """The README's commands, run in order from a fresh checkout: no train command lands in a workdir that holds
    a run with other settings, and every eval, export and ensemble names a workdir trained before."""
    monkeypatch.chdir(ROOT)
    from absl import flags

    import launch  # defines the flags
    from engine.settings.config import for_evaluation
    from engine.settings.identity import identity_changes

    runs, checked = {}, 0
    for args in _readme_commands():
        if "--help" in args or any(a.startswith("--flagfile=runs/") for a in args):
            continue  # a file a previous command writes (tune's best.flags)
        if any(a.startswith("--task=") and a[7:] not in plugins.names("task") for a in args):
            continue  # "Fork it": tests/test_fork.py runs these in a copy that holds the fork's files
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["launch.py", *args])
        config = launch._config_from_flags()
        checked += 1
        if config.mode == "train":
            saved = runs.get(config.workdir)
            assert saved is None or not identity_changes(saved, config), (args, identity_changes(saved, config))
            assert saved is None or config.train_steps >= saved.train_steps, args
            runs[config.workdir] = config
        elif config.mode in ("eval", "continuous_eval", "export"):
            assert config.workdir in runs, args
            for_evaluation(config, runs[config.workdir], config.workdir)
        elif config.mode == "ensemble":
            assert all(m in runs for m in config.members.split(",")), args
    flags.FLAGS.unparse_flags()
    assert checked >= 10


def test_a_checkpoint_of_another_model_names_the_variable_by_path(data_dir, one_device, tmp_path):
    """A workdir without config.json (written before it existed): the checkpoint's own check still speaks, naming
    a variable by its path (checkpoints key variables by path, never by position)."""
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10)
    loop.train(config, one_device)
    os.remove(tmp_path / "config.json")
    with pytest.raises(ConfigError) as refused:
        loop.train(dataclasses.replace(config, model="resnet"), one_device)
    message = str(refused.value)
    assert re.search(r"the checkpoint has models/model/mlp/dense/\S+ \[\d+(, \d+)?\] that this run lacks", message)
    assert message.endswith("give this run a new --workdir")


# 2. One process at a time.


@pytest.mark.slow
def test_a_second_process_is_refused_and_a_dead_ones_lock_is_taken_over(data_dir, one_device, tmp_path, capsys):
    settings = dict(data_dir=data_dir, workdir=str(tmp_path), hidden_sizes=(32,), steps_per_loop=10)
    settings.update(checkpoint_every=50)
    args = helpers.as_flags(settings)
    first = forkserver.popen(
        ["launch.py", *args, "--train_steps=1000000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while (not logged_steps(tmp_path) or logged_steps(tmp_path)[-1] < 60) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ConfigError) as refused:
            loop.train(validate(Config(**settings, train_steps=5)), one_device)
        assert f"another run is training here: pid {first.pid} on host {socket.gethostname()}" in str(refused.value)
    finally:
        first.kill()
        first.communicate()
    assert (tmp_path / "train.lock").exists()  # left by the killed process
    saved = int(checkpoint.latest(tmp_path / "checkpoints").rsplit("-", 1)[1])
    summary = loop.train(validate(Config(**settings, train_steps=saved + 10)), one_device)
    out = capsys.readouterr().out
    assert f"took over {tmp_path / 'train.lock'} from pid {first.pid}" in out and f"resumed from step {saved}" in out
    assert summary["step"] == saved + 10 and logged_steps(tmp_path) == list(range(10, saved + 11, 10))
    assert event_steps(tmp_path / "train", "loss") == list(range(10, saved + 11, 10))  # TensorBoard too
    assert not (tmp_path / "train.lock").exists()


def _foreign_lock(path, heartbeat):
    holder = dict(pid=12345, host="another-host", boot="x", started=1, token="theirs", heartbeat=heartbeat)
    path.write_text(json.dumps(holder))


def test_a_lock_of_another_host_is_taken_only_when_its_heartbeat_stops(tmp_path, monkeypatch):

    monkeypatch.setattr(lock_lib, "STALE_SECONDS", 1.0)
    lock_file = tmp_path / lock_lib.LOCK_NAME
    _foreign_lock(lock_file, time.time())
    beating = threading.Event()

    def heartbeat():  # the other host's run, alive
        while not beating.wait(0.05):
            _foreign_lock(lock_file, time.time())

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        with pytest.raises(ConfigError, match="another run is training here: pid 12345 on host another-host"):
            lock_lib.Lock(str(tmp_path), log=lambda line: None).acquire()
    finally:
        beating.set()
        thread.join()
    # Its heartbeat stopped: taken after STALE_SECONDS, released at the end.
    with lock_lib.Lock(str(tmp_path), log=lambda line: None) as lock:
        assert json.loads(lock_file.read_text())["token"] == lock.token
    assert not lock_file.exists()


def test_on_a_file_system_without_exclusive_create_the_lock_is_written_and_read_back():
    """ram:// stands in for an object store (gs://): no O_EXCL there."""

    with lock_lib.Lock("ram://object_store_run", log=lambda line: None):
        with pytest.raises(ConfigError, match=f"another run is training here: pid {os.getpid()} on host"):
            lock_lib.Lock("ram://object_store_run").acquire()
    assert not tf.io.gfile.exists("ram://object_store_run/train.lock")


# 3. A kill at any moment of the end of a run.


class Killed(BaseException):
    """A kill: nothing after it runs (the test process itself survives)."""


@pytest.mark.slow
@pytest.mark.parametrize("killed_in", ["final_evaluation", "summary"])
def test_a_kill_after_the_final_save_leaves_the_files_of_an_uninterrupted_run(
    data_dir, one_device, tmp_path, monkeypatch, killed_in
):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, eval_every=10)
    if killed_in == "summary":  # after the final eval line
        monkeypatch.setattr(report.Report, "summary", lambda self, summary: (_ for _ in ()).throw(Killed()))
    else:  # after the final checkpoint, before its evaluation
        monkeypatch.setattr(Controller, "_final_evaluation", lambda self, step: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        loop.train(config, one_device)
    assert checkpoint.latest(tmp_path / "checkpoints").endswith("ckpt-20") and not (tmp_path / "summary.json").exists()
    monkeypatch.undo()
    summary = loop.train(config, one_device)
    metrics, evals = jsonl(tmp_path / "metrics.jsonl"), jsonl(tmp_path / "eval.jsonl")
    assert [r["step"] for r in metrics] == [10, 20] and [r["step"] for r in evals] == [10, 20]
    assert event_steps(tmp_path / "train", "loss") == [10, 20] and event_steps(tmp_path / "eval", "accuracy") == [
        10,
        20,
    ]
    saved = json.load(open(tmp_path / "summary.json"))
    assert saved == summary and saved["train_loss"] == metrics[-1]["loss"] and saved["train_loss"] is not None
    assert saved["examples_per_sec"] == pytest.approx(metrics[-1]["examples_per_sec"])
    assert saved["eval"] == {k: v for k, v in evals[-1].items() if k != "step"}


# 4. Leftovers of saves a kill cut short.


def test_leftovers_of_killed_saves_are_removed(data_dir, one_device, tmp_path):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10, checkpoint_every=10)
    loop.train(config, one_device)
    for step in (20, 30):
        temp = tmp_path / "checkpoints" / f"ckpt-{step}_temp"
        temp.mkdir()
        (temp / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 2_000_000)
    loop.train(dataclasses.replace(config, train_steps=20), one_device)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "checkpoint",
        "ckpt-10.data-00000-of-00001",
        "ckpt-10.index",
        "ckpt-20.data-00000-of-00001",
        "ckpt-20.index",
    ]


def test_a_save_killed_before_its_index_was_written_is_removed_and_the_run_starts_again(
    data_dir, one_device, tmp_path, capsys
):
    # TensorFlow moves a save's data files into place, then writes its index, then the manager the state file: a kill
    # between left ckpt-10's data alone, which every rerun called the only checkpoint, damaged, and refused (exit 2)
    # until checkpoints/ was moved away by hand.
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10, checkpoint_every=10)
    first = loop.train(config, one_device)
    for name in ("checkpoints/ckpt-10.index", "checkpoints/checkpoint", "summary.json"):
        os.remove(tmp_path / name)
    summary = loop.train(config, one_device)
    removed = f"removed {tmp_path}/checkpoints/ckpt-10's data files: a save that a kill stopped before it wrote the "
    assert removed in capsys.readouterr().out
    assert summary["step"] == 10 and summary["eval"] == first["eval"]  # from step 0 again, alike
    # A checkpoint the state file lists is one that was saved: its index gone is damage, refused as it was.
    os.remove(tmp_path / "checkpoints" / "ckpt-10.index")
    with pytest.raises(ConfigError, match="every checkpoint in .* is unreadable"):
        loop.train(config, one_device)
    assert os.path.exists(tmp_path / "checkpoints" / "ckpt-10.data-00000-of-00001")


def test_a_rollback_removes_the_checkpoints_of_the_steps_it_discarded(data_dir, one_device, tmp_path):
    # Rolled back to ckpt-20 from a round after a preemption's ckpt-37, a run preempted again at step 30 resumed from
    # ckpt-37, the newest: the steps the rollback had discarded, diverging again.
    trainer = build.run(helpers.make_config(data_dir, str(tmp_path), hidden_sizes=(8,)), one_device)
    checkpoints = checkpoint.Checkpoints(trainer.state, str(tmp_path), keep=3)
    for step in (10, 20, 37):
        trainer.state.step.assign(step)
        checkpoints.save()
    checkpoint.restore(checkpoints.checkpoint, checkpoints.directory + "/ckpt-20")
    assert [os.path.basename(p) for p in checkpoints.discard_after(20)] == ["ckpt-37"]
    trainer.state.step.assign(30)
    checkpoints.save()
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(checkpoints.directory)] == [
        "ckpt-30",
        "ckpt-20",
        "ckpt-10",
    ]  # the three kept are real ones: the manager forgot ckpt-37
    assert os.path.basename(tf.train.latest_checkpoint(checkpoints.directory)) == "ckpt-30"


def test_save_initials_checkpoint_of_step_0_is_never_rotated_away(data_dir, one_device, tmp_path, capsys):
    # --keep_checkpoints rotated --save_initial's ckpt-0 away at its first save past the kept count: the initial weights
    # a user asked for, to hold a fork's step against, were gone by the run's end.
    config = helpers.make_config(
        data_dir, str(tmp_path / "run"), save_initial=True, train_steps=3, checkpoint_every=1, keep_checkpoints=1
    )
    loop.train(dataclasses.replace(config, steps_per_loop=1, hidden_sizes=(8,)), one_device)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path / "run" / "checkpoints")] == [
        "ckpt-3",
        "ckpt-0",
    ]
    # A step 0 the state file lists (saved without --save_initial, for --on_nan=rollback) is kept too once it is given,
    # unsaid: no warning of a state file rebuilt.
    trainer = build.run(helpers.make_config(data_dir, str(tmp_path / "old"), hidden_sizes=(8,)), one_device)
    checkpoint.Checkpoints(trainer.state, str(tmp_path / "old"), keep=2).save()
    capsys.readouterr()
    checkpoints = checkpoint.Checkpoints(trainer.state, str(tmp_path / "old"), keep=2, keep_initial=True)
    for step in (10, 20, 30):
        trainer.state.step.assign(step)
        checkpoints.save()
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(checkpoints.directory)]
    assert names == ["ckpt-30", "ckpt-20", "ckpt-0"] and "warning" not in capsys.readouterr().out
    # A resume without --save_initial: its step 0 was listed again ("warning: ... rebuilt from the files") and rotated
    # away at the next save.
    checkpoints = checkpoint.Checkpoints(trainer.state, str(tmp_path / "run"), keep=1)
    trainer.state.step.assign(4)
    checkpoints.save()
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(checkpoints.directory)]
    assert names == ["ckpt-4", "ckpt-0"] and "warning" not in capsys.readouterr().out


def test_a_setting_config_json_holds_that_this_engine_does_not_know_is_named_and_kept(
    data_dir, one_device, tmp_path, capsys
):
    # One a newer engine wrote, or one written by hand: a resume dropped it unsaid, and wrote config.json without it.
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=1, steps_per_loop=1, hidden_sizes=(8,))
    loop.train(config, one_device)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "lr_warmup_fraction": 0.3}))
    capsys.readouterr()
    assert loop.train(dataclasses.replace(config, train_steps=2), one_device)["step"] == 2
    said = (
        f"warning: {tmp_path / 'config.json'} holds settings this engine does not know, ignored here and kept in that "
        "file: lr_warmup_fraction=0.3 (another version of the engine's, a plugin file's no longer here, or a typo)"
    )
    assert said in capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "config.json").read_text())["lr_warmup_fraction"] == 0.3
    evaluate.run_config(dataclasses.replace(config, mode="eval"), "eval")
    assert said in capsys.readouterr().out.splitlines()
    # Also where the run saved no checkpoint yet (killed before its first): the same run, its config.json rewritten.
    shutil.rmtree(tmp_path / "checkpoints")
    assert loop.train(dataclasses.replace(config, train_steps=2), one_device)["step"] == 2
    assert said in capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "config.json").read_text())["lr_warmup_fraction"] == 0.3


# 5. Damaged bookkeeping; damaged checkpoints in --mode=eval.


def test_a_damaged_state_file_is_rebuilt_from_the_checkpoints(data_dir, one_device, tmp_path, capsys):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, checkpoint_every=10, keep_checkpoints=2)
    loop.train(config, one_device)
    (tmp_path / "checkpoints" / "checkpoint").write_bytes(b'all_model_checkpoint_paths: "zz\x00\xff"\n')
    summary = loop.train(dataclasses.replace(config, train_steps=30), one_device)
    out = capsys.readouterr().out
    assert "checkpoint is unreadable" in out and "resumed from step 20" in out and summary["step"] == 30
    # The rebuilt state knew ckpt-10: keeping two deleted it.
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["ckpt-30", "ckpt-20"]
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-30")


def test_eval_falls_back_from_a_damaged_newest_checkpoint(data_dir, one_device, tmp_path, capsys):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, checkpoint_every=10)
    loop.train(config, one_device)
    newest = checkpoint.latest(tmp_path / "checkpoints")
    data_file = newest + ".data-00000-of-00001"
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    capsys.readouterr()
    result = evaluate.evaluate(dataclasses.replace(config, mode="eval"), one_device)
    assert f"checkpoint {newest} is unreadable" in capsys.readouterr().out
    assert result["step"] == 10 and result["checkpoint"].endswith("ckpt-10")


# 6. --mode=eval, continuous_eval and export rebuild the run from its config.json.


@pytest.mark.slow
def test_other_modes_rebuild_the_run_from_its_config_json(data_dir, one_device, tmp_path):
    transformer = dict(
        model="transformer", transformer_layers=1, transformer_dim=16, transformer_heads=2, transformer_mlp_dim=32
    )
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, eval_split="validation", **transformer)
    trained = loop.train(config, one_device)
    given = validate(Config(mode="eval", workdir=str(tmp_path), data_dir=data_dir))  # --mode=eval --workdir=W
    on_test = evaluate.evaluate(given, one_device)
    assert on_test["step"] == 20 and on_test["split"] == "test" and on_test["eval"]["examples"] == 360
    given = dataclasses.replace(given, eval_split="validation", eval_batch_size=40)
    evaluated = evaluate.evaluate(given, one_device)
    assert evaluated["split"] == "validation" and evaluated["eval"]["examples"] == 180
    assert evaluated["eval"]["accuracy"] == trained["eval"]["accuracy"]
    assert evaluated["eval"]["loss"] == pytest.approx(trained["eval"]["loss"], rel=1e-5)
    with pytest.raises(ConfigError, match=rf"--model=resnet: {tmp_path} was trained with --model=transformer"):
        evaluate.evaluate(dataclasses.replace(given, model="resnet"), one_device)
    follow = dataclasses.replace(given, mode="continuous_eval", eval_timeout=60)
    results = evaluate.follow(follow, one_device, poll_seconds=0.1)  # stops at the run's own last step
    assert [r["step"] for r in results] == [20] and results[0]["accuracy"] == trained["eval"]["accuracy"]
    assert (tmp_path / "eval_test.json").exists() and (tmp_path / "eval_validation.json").exists()
    export_dir = evaluate.export(dataclasses.replace(given, mode="export"))
    assert os.path.exists(os.path.join(export_dir, "saved_model.pb"))


def test_evaluation_follows_a_run_whose_checkpoints_are_damaged_rotated_or_evaluated_already(
    data_dir, one_device, tmp_path, capsys, monkeypatch
):
    config = helpers.make_config(
        data_dir, str(tmp_path), train_steps=20, checkpoint_every=10, keep_checkpoints=5, hidden_sizes=(8,)
    )
    loop.train(config, one_device)
    given = validate(Config(mode="eval", workdir=str(tmp_path), data_dir=data_dir))
    directory = tmp_path / "checkpoints"
    # A run still training rotated away the checkpoints listed (--keep_checkpoints): they are listed again, not called
    # damaged ("no readable checkpoint (all 2 are damaged)" before).
    listings, listed = iter([[str(directory / "ckpt-98"), str(directory / "ckpt-99")]]), evaluate._checkpoint_paths
    monkeypatch.setattr(evaluate, "_checkpoint_paths", lambda config: next(listings, None) or listed(config))
    assert evaluate.evaluate(given, one_device)["step"] == 20
    monkeypatch.undo()
    assert "unreadable" not in capsys.readouterr().out
    # --checkpoint naming the folder: it was taken for a checkpoint of the run two folders up ("a checkpoint of /tmp").
    folder = dataclasses.replace(given, checkpoint=str(directory))
    with pytest.raises(ConfigError) as refused:
        evaluate.evaluate(folder, one_device)
    assert str(refused.value) == (
        f"--checkpoint={directory}: no such checkpoint (expected {directory}.index); a folder of checkpoints: name "
        f"one, as --checkpoint={directory / 'ckpt-20'}"
    )
    # continuous_eval: the newest checkpoint damaged, it says so and evaluates the previous one (it waited out
    # --eval_timeout and said no checkpoint appeared)...
    data = next(directory.glob("ckpt-20.data-*"))
    data.write_bytes(data.read_bytes()[:100])
    follow = dataclasses.replace(given, mode="continuous_eval", eval_timeout=1.5)
    assert [r["step"] for r in evaluate.follow(follow, one_device, poll_seconds=0.1)] == [10]
    assert "warning: checkpoint " in capsys.readouterr().out
    # ... and, restarted, goes on from its records: step 10 is not evaluated, nor recorded, twice.
    assert [r["step"] for r in evaluate.follow(follow, one_device, poll_seconds=0.1)] == [10]
    assert logged_steps(str(tmp_path), "continuous_eval.jsonl") == [10]
    # Another split's evaluations are not this one's: it evaluates step 10 on its own split.
    validation = evaluate.follow(dataclasses.replace(follow, eval_split="validation"), one_device, poll_seconds=0.1)
    assert [(r["step"], r["split"], r["examples"]) for r in validation] == [(10, "validation", 180)]
    assert logged_steps(str(tmp_path), "continuous_eval.jsonl") == [10, 10]
    # Each split's TensorBoard curve is its own (one folder held both splits' step 10, mixed in one curve).
    on_test = json.loads(open(tmp_path / "continuous_eval.jsonl").readline())
    for split, record in (("test", on_test), ("validation", validation[0])):
        scalars = helpers.tensorboard_values(str(tmp_path / "continuous_eval" / split), lambda value: True)
        assert {tag: list(by_step) for tag, by_step in scalars.items()} == {"loss": [10], "accuracy": [10]}
        assert float(scalars["loss"][10]) == pytest.approx(record["loss"], rel=1e-6)
    assert on_test["loss"] != validation[0]["loss"]


def test_evaluation_goes_on_after_a_checkpoint_rotated_away_part_way_through_its_restore(
    data_dir, one_device, tmp_path, capsys, monkeypatch
):
    # A run still training (--keep_checkpoints=1, a save every step) deleted ckpt-20 after TensorFlow had restored
    # some of its values: the restore's checkpoint object kept ckpt-20's deferred restorations, so every later
    # restore through it failed, and the sidecar stopped with "error: checkpoint .../ckpt-10 does not fit this run:
    # its objects differ from this run's (another model?)", exit 2 (eval and export too).
    from tensorflow.python.checkpoint import functional_saver

    config = helpers.make_config(
        data_dir, str(tmp_path), train_steps=20, checkpoint_every=10, keep_checkpoints=5, hidden_sizes=(8,)
    )
    loop.train(config, one_device)
    directory = tmp_path / "checkpoints"
    saved = {path.name: path.read_bytes() for path in directory.iterdir()}
    read = functional_saver.io_ops.restore_v2

    def rotated_as_read(prefix, *args, **kwargs):  # ckpt-20 rotated away after its first values were read
        values = read(prefix, *args, **kwargs)
        if prefix.numpy().decode().endswith("ckpt-20"):
            for path in directory.glob("ckpt-20.*"):
                path.unlink()
        return values

    given = validate(Config(mode="eval", workdir=str(tmp_path), data_dir=data_dir))
    expected = evaluate.evaluate(dataclasses.replace(given, checkpoint=str(directory / "ckpt-10")), one_device)
    monkeypatch.setattr(functional_saver.io_ops, "restore_v2", rotated_as_read)
    follow = dataclasses.replace(given, mode="continuous_eval", eval_timeout=1.5)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        results = evaluate.follow(follow, one_device, poll_seconds=0.1)
        gc.collect()  # the failed restore's leftovers, and what TensorFlow logs of them (some 20 lines: now none)
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert not [line for line in logged if "unrestored values" in line or "could not be found" in line], logged[:3]
    assert [(r["step"], r["checkpoint"]) for r in results] == [(10, str(directory / "ckpt-10"))]
    assert (results[0]["accuracy"], results[0]["loss"]) == (expected["eval"]["accuracy"], expected["eval"]["loss"])
    for name, content in saved.items():  # as the trainer left it
        (directory / name).write_bytes(content)
    evaluated = evaluate.evaluate(given, one_device)
    assert (evaluated["step"], evaluated["checkpoint"]) == (10, str(directory / "ckpt-10"))
    assert evaluated["eval"] == expected["eval"]
    assert "unreadable" not in capsys.readouterr().out


def test_a_second_continuous_eval_of_one_split_is_refused(data_dir, one_device, tmp_path):
    # Two sidecars of one workdir and split each evaluated every checkpoint and appended it: continuous_eval.jsonl
    # held step 20 twice, and continuous_eval/test two events files with the same points.
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=20, hidden_sizes=(8,))
    loop.train(config, one_device)
    follow = validate(Config(mode="continuous_eval", workdir=str(tmp_path), data_dir=data_dir, eval_timeout=1.5))
    with lock_lib.Lock(str(tmp_path), doing="evaluating", name="continuous_eval_test.lock"):
        with pytest.raises(
            ConfigError, match=rf"--workdir={tmp_path}: another run is evaluating here: pid {os.getpid()}"
        ):
            evaluate.follow(follow, one_device, poll_seconds=0.1)
        assert not (tmp_path / "continuous_eval.jsonl").exists()
        # Another split's sidecar is not this one's.
        validation = evaluate.follow(dataclasses.replace(follow, eval_split="validation"), one_device, poll_seconds=0.1)
        assert [(r["step"], r["split"]) for r in validation] == [(20, "validation")]
    assert [r["step"] for r in evaluate.follow(follow, one_device, poll_seconds=0.1)] == [20]
    assert [(r["step"], r["split"]) for r in jsonl(tmp_path / "continuous_eval.jsonl")] == [
        (20, "validation"),
        (20, "test"),
    ]
    assert not list(tmp_path.glob("continuous_eval_*.lock"))


@pytest.mark.parametrize(
    "saved,why",
    [
        ({"model": 5}, "model=5: must be a string"),
        ([1, 2, 3], "must be a JSON object of settings, not list"),
        ({"global_batch_size": "x"}, 'global_batch_size="x": must be an integer'),
    ],
)
def test_a_members_bad_config_json_is_refused_like_a_bad_flag(tmp_path, saved, why):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(saved))
    config = helpers.make_config("", str(tmp_path / "ensemble"), mode="ensemble", members=f"{tmp_path / 'a'},b")
    with pytest.raises(ConfigError) as refused:
        ensemble.ensemble(config)
    assert str(refused.value) == f"{tmp_path / 'a' / 'config.json'}: {why}"


def test_launch_refuses_a_bad_member_config_in_one_line(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model": 5}')
    proc = helpers.launch("--mode=ensemble", f"--members={tmp_path / 'a'},{tmp_path / 'b'}", f"--workdir={tmp_path}/e")
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"error: {tmp_path / 'a' / 'config.json'}: model=5: must be a string"
    )


# Export of a mixed_bfloat16 run.


def test_a_mixed_bfloat16_run_exports_float32_that_tflite_converts(data_dir, one_device, tmp_path):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10, precision="mixed_bfloat16")
    loop.train(config, one_device)
    export_dir = evaluate.export(dataclasses.replace(config, mode="export"))
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    interpreter = tf.lite.Interpreter(model_content=tf.lite.TFLiteConverter.from_saved_model(export_dir).convert())
    runner = interpreter.get_signature_runner("serving_default")
    images = np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32)
    np.testing.assert_allclose(runner(images=images)["logits"], served(images=images)["logits"].numpy(), atol=1e-4)


# Issue 10, defect 9: a disk that fills up between checkpoints.


@pytest.mark.slow
def test_a_disk_full_between_checkpoints_ends_in_one_error_line(data_dir, tmp_path):
    def small_disk():  # files may not grow past 16 KiB: the TensorBoard events fill up within a few dozen steps
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    proc = subprocess.run(
        [sys.executable, "launch.py", f"--workdir={tmp_path}", f"--data_dir={data_dir}", "--hidden_sizes=32"]
        + ["--steps_per_loop=1", "--checkpoint_every=0", "--train_steps=5000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **helpers.without_xla_cache()},
        preexec_fn=small_disk,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert len(lines) == 1 and re.fullmatch(rf"error: cannot write {tmp_path}/\S+: File too large", lines[0]), lines
    assert not (tmp_path / "train.lock").exists()


def test_a_run_that_saved_no_checkpoint_leaves_its_workdir_to_a_corrected_command(data_dir, one_device, tmp_path):
    # A run refused as its first batches load (bad data, a source setting to correct) has written its config.json and
    # nothing it could resume from: the corrected command trains there, as a second try of the first would.
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=4, hidden_sizes=(8,))
    os.makedirs(tmp_path, exist_ok=True)
    workdir_lib.write_config(config, types.SimpleNamespace(class_names=None))  # what it left: settings, no checkpoint
    corrected = dataclasses.replace(config, hidden_sizes=(16,))
    summary = loop.train(corrected, one_device)
    assert summary["step"] == 4 and load_run_config(str(tmp_path)).hidden_sizes == (16,)
    with pytest.raises(ConfigError, match="holds a run with other settings"):  # now it has a checkpoint
        loop.train(config, one_device)


def test_eval_of_another_runs_checkpoint_never_replaces_this_workdirs_results(data_dir, one_device, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    loop.train(helpers.make_config(data_dir, str(ours), train_steps=2), one_device)
    loop.train(helpers.make_config(data_dir, str(theirs), train_steps=2, seed=3), one_device)
    evaluate.evaluate(helpers.make_config(data_dir, str(ours), mode="eval"), one_device)
    before = files(ours, ("config.json", "summary.json", "eval_test.json"))
    other = str(theirs / "checkpoints" / "ckpt-2")
    for mode in ("eval", "export"):
        given = helpers.make_config(data_dir, str(ours), mode=mode, checkpoint=other)
        with pytest.raises(ConfigError, match=rf"^--checkpoint={other}: a checkpoint of {theirs}, not of --workdir"):
            (evaluate.evaluate(given, one_device) if mode == "eval" else evaluate.export(given))
        assert (
            files(ours, ("config.json", "summary.json", "eval_test.json")) == before and not (ours / "export").exists()
        )
    # A study's or an ensemble's workdir (no config.json): eval_test.json and export/ landed beside its results.
    for job, held in (("study", "study.json"), ("ensemble", "summary.json")):
        (tmp_path / job).mkdir()
        (tmp_path / job / held).write_text("{}")
        for mode in ("eval", "export"):
            given = helpers.make_config(data_dir, str(tmp_path / job), mode=mode, checkpoint=other)
            with pytest.raises(ConfigError) as refused:
                evaluate.evaluate(given, one_device) if mode == "eval" else evaluate.export(given)
            assert str(refused.value) == (
                f"--checkpoint={other}: --workdir={tmp_path / job} holds another job's results "
                f"({tmp_path / job / held}), which this would stand beside as their own; use --workdir={theirs}"
            )
        assert os.listdir(tmp_path / job) == [held]


def test_what_config_json_keeps_of_a_source_reads_back_exactly_or_is_not_kept():
    from engine.state import kept_source

    spec = {"features": tf.TensorSpec([11], tf.float32), "tokens": tf.TensorSpec([4, 2], tf.int32)}
    info = {
        "feature_mean": np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
        "target_std": np.float64(1 / 3),
        "class_names": ("ant", "bée"),
        "vocabulary": ["x", "\n"],
        "num_classes": 3,
        "weight_counts_targets": True,
        "nothing": None,
        "nested": {"ids": np.array([[1], [2]], np.int64)},
    }
    saved = json.loads(json.dumps(kept_source.record(spec, info)))  # as config.json holds it
    read_spec, read = kept_source.source(saved)
    assert read_spec == spec
    assert read.keys() == info.keys()
    for name in ("feature_mean", "target_std"):
        assert type(read[name]) is type(info[name]) and read[name].dtype == info[name].dtype
        np.testing.assert_array_equal(read[name], info[name])
    assert read["feature_mean"].shape == (2, 3)
    assert read["nested"]["ids"].dtype == np.int64 and read["nested"]["ids"].tolist() == [[1], [2]]
    assert [read[k] for k in ("class_names", "vocabulary", "num_classes", "weight_counts_targets", "nothing")] == [
        ("ant", "bée"),
        ["x", "\n"],
        3,
        True,
        None,
    ]
    # What JSON cannot hold exactly, or too much of it, is not kept: export and sampling read the data then.
    for unkept in (object(), b"bytes", float("nan"), np.array([np.inf]), {1: "one"}, np.zeros(300_000)):
        assert kept_source.record(spec, {"value": unkept}) is None
    assert kept_source.source({"spec": {}}) is None  # edited by hand: the data is read
