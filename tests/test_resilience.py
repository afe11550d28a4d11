"""Long jobs that survive: kill and resume exactly, preemption, damaged and mismatched checkpoints, NaN,
a dead worker, a full disk, evaluation modes and export."""

import dataclasses
import glob
import json
import os
import re
import resource
import signal
import time

import numpy as np
import pytest
import tensorflow as tf

from engine.cluster import signals as preemption
from engine.data import datasets as data
from engine.run import build, loop, serving
from engine.run import modes as evaluate
from engine.settings.errors import ConfigError, TrainingError
from engine.state import checkpoint, held
from tests import helpers
from tests.helpers import checkpoint_tensors, logged_steps


def launch(workdir, *args, timeout=300, **popen):
    proc = helpers.start_launch(workdir, *args, **popen)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.parametrize("strategy", [{}, dict(strategy="mirrored", num_cpu_devices=2)], ids=["one_device", "mirrored"])
@pytest.mark.slow
def test_sigkill_and_restart_equals_uninterrupted(data_dir, tmp_path, strategy, capsys):
    settings = dict(
        data_dir=data_dir,
        deterministic=True,
        seed=5,
        train_steps=300,
        steps_per_loop=10,
        checkpoint_every=100,
        hidden_sizes=(256, 256),
        warmup_steps=20,
        lr_schedule="cosine",
        **strategy,
    )
    # The run never killed trains in this process (the same Config, strategy and programs launch.py builds); the
    # killed runs are launch.py's, the second of them restarted from the first one's checkpoint as a user would,
    # and the last restart runs in this process again.
    helpers.in_process_run({**settings, "workdir": str(tmp_path / "straight")})
    args = helpers.as_flags(settings)
    killed = tmp_path / "killed"
    # Each kill comes just after a checkpoint, so that the rounds a fast machine runs between the kill being asked
    # for and taking effect (two on a CI machine) still leave it between checkpoints.
    kill_points = [helpers.kill_after(helpers.start_launch(killed, *args), killed, step) for step in (110, 210)]
    capsys.readouterr()
    helpers.in_process_run({**settings, "workdir": str(killed)})
    assert f"resumed from step {kill_points[-1] // 100 * 100}" in capsys.readouterr().out
    assert all(p % 100 for p in kill_points), kill_points  # killed between checkpoints: work was redone

    straight, resumed = (json.load(open(d / "summary.json")) for d in (tmp_path / "straight", killed))
    assert resumed["step"] == straight["step"] == 300
    assert resumed["train_loss"] == straight["train_loss"] and resumed["eval"] == straight["eval"]
    records = [[json.loads(line) for line in open(d / "metrics.jsonl")] for d in (tmp_path / "straight", killed)]
    assert [r["step"] for r in records[1]] == [r["step"] for r in records[0]] == list(range(10, 301, 10))
    assert [r["loss"] for r in records[1]] == [r["loss"] for r in records[0]]
    (path_a, a), (path_b, b) = checkpoint_tensors(tmp_path / "straight"), checkpoint_tensors(killed)
    assert path_a.endswith("ckpt-300") and path_b.endswith("ckpt-300") and a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_restart_redoes_nothing(data_dir, tmp_path, capsys):
    # A round of 20000 steps lasts seconds even where this model trains 8000 steps a second (a 2-core Zen 4), so a
    # SIGTERM sent a moment after the first round is logged lands inside the second.
    settings = dict(data_dir=data_dir, steps_per_loop=20000, checkpoint_every=0, hidden_sizes=(32,))
    proc = helpers.start_launch(tmp_path, *helpers.as_flags(settings), "--train_steps=1000000")
    deadline = time.monotonic() + 180
    while not logged_steps(tmp_path) and time.monotonic() < deadline:  # the first round is done
        time.sleep(0.02)
    time.sleep(0.1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    print(f"SIGTERM to exit: {time.monotonic() - sent:.2f} s")
    assert proc.returncode == preemption.PREEMPTED_EXIT_CODE, err[-2000:]
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", err).group(1))
    assert (out + err).count("stopped by SIGTERM") == 1  # said once, as the last line (the console said it twice)
    assert 20000 < stopped < 40000  # inside the second round: the step loop itself noticed
    assert err.strip().splitlines()[-1].startswith("error: preempted: stopped by SIGTERM")
    assert checkpoint.list_checkpoints(tmp_path / "checkpoints")[0].endswith(f"ckpt-{stopped}")
    assert logged_steps(tmp_path) == [20000, stopped]

    capsys.readouterr()
    # The restart, in this process: launch.py's Config for the same flags and more steps.
    helpers.in_process_run({**settings, "workdir": str(tmp_path), "train_steps": stopped + 30})
    assert f"resumed from step {stopped}" in capsys.readouterr().out
    # The resumed run's rounds end at the next multiple of 20000, if it comes first, and at the end.
    expected = [20000, stopped] + ([40000] if stopped + 30 > 40000 else []) + [stopped + 30]
    assert logged_steps(tmp_path) == expected
    assert json.load(open(tmp_path / "summary.json"))["step"] == stopped + 30


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_data", "missing_index"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(data_dir, one_device, tmp_path, capsys, damage):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=30, checkpoint_every=10)
    loop.train(config, one_device)
    latest = checkpoint.list_checkpoints(tmp_path / "checkpoints")[0]
    assert latest.endswith("ckpt-30")
    if damage == "truncated_data":
        data_file = latest + ".data-00000-of-00001"
        with open(data_file, "r+b") as f:
            f.truncate(os.path.getsize(data_file) // 2)
    else:
        os.remove(latest + ".index")
    capsys.readouterr()
    summary = loop.train(dataclasses.replace(config, train_steps=40), one_device)
    out = capsys.readouterr().out
    assert f"checkpoint {latest} is unreadable" in out and "trying the previous one" in out
    assert "resumed from step 20" in out
    assert summary["step"] == 40 and logged_steps(tmp_path) == [10, 20, 30, 40]


@pytest.mark.parametrize(
    "change,message",
    [
        # The workdir's config.json refuses them (tests/test_workdir.py: the checkpoint's own check without one).
        (dict(hidden_sizes=(48, 32)), "--hidden_sizes=32,32 there, 48,32 here"),
        (dict(model="resnet"), "--model=mlp there, resnet here"),
    ],
)
def test_checkpoint_of_another_model_is_refused(data_dir, one_device, tmp_path, change, message):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10, checkpoint_every=10)
    loop.train(config, one_device)
    before = {name: open(tmp_path / name, "rb").read() for name in ("metrics.jsonl", "summary.json")}
    with pytest.raises(ConfigError, match=message):
        loop.train(dataclasses.replace(config, train_steps=20, **change), one_device)
    for name, content in before.items():
        assert open(tmp_path / name, "rb").read() == content
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")] == ["ckpt-10"]


def test_a_checkpoint_of_another_engine_version_is_refused_as_such_changing_nothing(data_dir, one_device, tmp_path):
    """A checkpoint that holds a piece of state this engine never saves (a newer engine's), in a workdir whose
    config.json says the same settings: refused in one line naming it and the engine version, not "a run with other
    settings saved it"."""
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=10, checkpoint_every=10)
    run = build.run(config, one_device)
    loop.train(config, one_device)
    path = str(tmp_path / "checkpoints" / "ckpt-10")
    checkpoint.restore(tf.train.Checkpoint(**run.state.tracked()), path)
    for name in glob.glob(path + ".*"):
        os.remove(name)
    tf.train.Checkpoint(**run.state.tracked(), grad_noise=tf.Variable(0.5)).write(path)  # as a newer engine's
    before = {name: open(tmp_path / name, "rb").read() for name in ("metrics.jsonl", "summary.json", "config.json")}
    with pytest.raises(ConfigError) as refused:
        loop.train(dataclasses.replace(config, train_steps=20), one_device)
    message = str(refused.value)
    assert f"checkpoint {path} does not fit this run: it holds grad_noise, which this engine never saves" in message
    assert "finish that run with the engine version that wrote it" in message and "other settings" not in message
    assert all(open(tmp_path / name, "rb").read() == content for name, content in before.items())


def _poison(monkeypatch, bad_batches):
    """Global batches `bad_batches` of the training stream carry a NaN (one device: one batch per step)."""
    real_prepare = data.prepare

    def prepare(*args, **kwargs):
        loaded = real_prepare(*args, **kwargs)

        def train_fn(ctx, start_batch=0, **kwargs):
            ds = loaded.train_fn(ctx, start_batch, **kwargs).enumerate(start_batch)
            bad = lambda i, x: tf.where(tf.reduce_any(tf.equal(i, bad_batches)), x * np.nan, x)  # noqa: E731
            return ds.map(lambda i, b: {**b, "image": bad(i, b["image"])})

        return dataclasses.replace(loaded, train_fn=train_fn, gather=None)  # through the poisoned pipeline

    monkeypatch.setattr(data, "prepare", prepare)


def test_nan_stops_naming_the_steps_and_the_last_good_checkpoint(data_dir, one_device, tmp_path, monkeypatch):
    _poison(monkeypatch, [23, 24])
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=40, steps_per_loop=5, checkpoint_every=10)
    with pytest.raises(TrainingError, match=r"between steps 21 and 25 .*ckpt-20"):
        loop.train(config, one_device)
    path, tensors = checkpoint_tensors(tmp_path)
    assert path.endswith("ckpt-20")  # the NaN overwrote nothing
    assert all(np.all(np.isfinite(t)) for t in tensors.values() if getattr(t, "dtype", None) == np.float32)


def test_nan_rollback_discards_every_step_since_the_checkpoint_and_says_so(
    data_dir, one_device, tmp_path, monkeypatch, capsys
):
    # Batches 27-29 (of steps 28-30) are poisoned: the round of steps 26-30 ends non-finite, and the rollback to
    # ckpt-20 undoes the finite round 21-25 too. The run reads on from batch 30: steps 21-30's batches are never
    # trained. (Each of the three steps its own poisoned batch: whether the NaN weights of step 28 alone make steps
    # 29 and 30 non-finite depends on the CPU; oneDNN's fused ReLU on an AVX-512 EPYC maps NaN to 0, and those
    # steps' losses came out finite, about ln 10.)
    _poison(monkeypatch, [27, 28, 29])
    config = helpers.make_config(
        data_dir, str(tmp_path), train_steps=40, steps_per_loop=5, checkpoint_every=10, on_nan="rollback"
    )
    summary = loop.train(config, one_device)
    rolled = [line for line in capsys.readouterr().out.splitlines() if "rolled back" in line]
    assert rolled == [
        f"non-finite loss or gradient between steps 26 and 30 (3 of 5 steps, float32): rolled back to step 20 "
        f"({tmp_path}/checkpoints/ckpt-20), discarding the 10 steps 21-30 since that checkpoint; the 10 batches "
        "they read are not trained on (--on_nan=rollback)"
    ]
    assert summary["step"] == 40 and np.isfinite(summary["train_loss"])
    assert logged_steps(tmp_path) == [5, 10, 15, 20, 25, 30, 35, 40]  # no step logged twice
    reader = tf.train.load_checkpoint(checkpoint.list_checkpoints(tmp_path / "checkpoints")[0])
    assert reader.get_tensor("batches/.ATTRIBUTES/VARIABLE_VALUE") == 50  # 10 batches skipped
    assert reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 40


def test_nan_rollback_of_a_round_a_signal_cut_short_resumes_as_the_run_never_stopped(
    data_dir, one_device, tmp_path, monkeypatch
):
    # The signal lands in the round that diverges (its first step, on the poisoned batch 25): the rollback read on
    # from batch 26, not 30, and the resumed run trained other batches than the run never stopped.
    from engine.run.program import TrainProgram
    from engine.settings.errors import Preempted

    _poison(monkeypatch, [25])
    settings = dict(train_steps=40, steps_per_loop=5, checkpoint_every=10, on_nan="rollback", deterministic=True)
    straight = loop.train(helpers.make_config(data_dir, str(tmp_path / "straight"), **settings), one_device)
    real = TrainProgram.run_round

    def run_round(self, iterator, steps, extras=frozenset()):
        if int(self.state.step.numpy()) == 25 and not self.stop.numpy():  # a signal during the round's first step
            self.stop.assign(True)
        return real(self, iterator, steps, extras)

    config = helpers.make_config(data_dir, str(tmp_path / "cut"), **settings)
    with monkeypatch.context() as signalled:
        signalled.setattr(TrainProgram, "run_round", run_round)
        with pytest.raises(Preempted, match="at step 21;"):  # the first step after the rollback, on batch 30
            loop.train(config, one_device)
    resumed = loop.train(config, one_device)
    assert (resumed["eval"], resumed["train_loss"]) == (straight["eval"], straight["train_loss"])
    assert checkpoint_tensors(tmp_path / "cut")[1].keys() == checkpoint_tensors(tmp_path / "straight")[1].keys()
    for name, value in checkpoint_tensors(tmp_path / "straight")[1].items():
        if name != "save_counter/.ATTRIBUTES/VARIABLE_VALUE":
            np.testing.assert_array_equal(checkpoint_tensors(tmp_path / "cut")[1][name], value, err_msg=name)


def test_nan_rollback_without_checkpoints_to_roll_back_to_is_refused(data_dir, tmp_path):
    # --checkpoint_every=0 saves only at the end: a rollback would go back to the run's first step.
    with pytest.raises(ConfigError) as refused:
        helpers.make_config(data_dir, str(tmp_path / "work"), on_nan="rollback", checkpoint_every=0)
    assert str(refused.value) == (
        "--on_nan=rollback: needs --checkpoint_every > 0 (0 saves only at the end, so a rollback would discard "
        "every step since the run started); set --checkpoint_every to the most steps a rollback may discard"
    )
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_nan_rollback_never_picks_a_damaged_checkpoint(data_dir, one_device, tmp_path, monkeypatch, capsys):
    # ckpt-20 is damaged, so the restart resumes from ckpt-10; a NaN after that must roll back to ckpt-10 (the
    # checkpoint this process restored), not to ckpt-20, the newest on disk.
    settings = dict(train_steps=20, steps_per_loop=5, checkpoint_every=10, on_nan="rollback")
    loop.train(helpers.make_config(data_dir, str(tmp_path), **settings), one_device)
    for path in glob.glob(str(tmp_path / "checkpoints" / "ckpt-20.data-*")):
        with open(path, "r+b") as f:
            f.truncate(16)
    _poison(monkeypatch, [13, 14])
    summary = loop.train(helpers.make_config(data_dir, str(tmp_path), **settings), one_device)
    out = capsys.readouterr().out
    assert "resumed from step 10" in out and "rolled back to step 10" in out
    assert summary["step"] == 20 and np.isfinite(summary["train_loss"])


@pytest.mark.slow
def test_a_dead_worker_stops_the_other_with_its_name(data_dir, tmp_path):
    ports = helpers.free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    args = [
        f"--data_dir={data_dir}",
        "--strategy=multi_worker",
        "--checkpoint_every=100",
        "--steps_per_loop=50",
        "--hidden_sizes=32",
    ]

    def worker(index, steps):
        env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        return helpers.start_launch(tmp_path, *args, f"--train_steps={steps}", env=env)

    chief, other = worker(0, 1_000_000), worker(1, 1_000_000)
    helpers.kill_after(other, tmp_path, 200)
    killed = time.monotonic()
    _, err = chief.communicate(timeout=180)
    print(f"worker death detected in {time.monotonic() - killed:.1f} s")
    assert chief.returncode == 5, err[-2000:]
    assert f"lost worker 1 (localhost:{ports[1]})" in err.strip().splitlines()[-1]
    # Restarting every worker resumes from the last checkpoint.
    saved = int(checkpoint.list_checkpoints(tmp_path / "checkpoints")[0].rsplit("-", 1)[1])
    procs = [worker(i, saved + 100) for i in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:]
    assert f"resumed from step {saved}" in outputs[0][0]
    assert sorted(os.listdir(tmp_path / "checkpoints"))[0] == "checkpoint"  # only the chief's copy is kept
    assert not any(name.startswith(".worker") for name in os.listdir(tmp_path / "checkpoints"))


@pytest.mark.slow
def test_full_disk_fails_at_the_first_save_naming_the_path(data_dir, tmp_path):
    settings = dict(data_dir=data_dir, hidden_sizes=(512, 512), checkpoint_every=10, steps_per_loop=10)
    helpers.in_process_run({**settings, "workdir": str(tmp_path), "train_steps": 10})  # ckpt-10, as launch.py saves it
    args = helpers.as_flags(settings)

    def small_disk():  # files may not grow past 256 KiB: the next checkpoint (about 3.6 MB) cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    code, _, err = launch(tmp_path, *args, "--train_steps=20", env=helpers.without_xla_cache(), preexec_fn=small_disk)
    lines = err.strip().splitlines()
    assert code == 4, err[-2000:]
    assert lines[-1].startswith("error: cannot write checkpoint for step 20 to ") and str(tmp_path) in lines[-1]
    # What failed, as a person reads it: not TensorFlow's graph function and the shard's temporary file.
    assert lines[-1] == f"error: cannot write checkpoint for step 20 to {tmp_path}/checkpoints: File too large"
    path, tensors = checkpoint_tensors(tmp_path)  # the earlier checkpoint is intact and readable
    assert path.endswith("ckpt-10") and len(tensors) > 10


def test_eval_mode_and_export_round_trip(data_dir, one_device, tmp_path):
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=50, hidden_sizes=(64,))
    trained = loop.train(config, one_device)
    again = loop.train(config, one_device)  # a finished run: nothing to do, same summary
    assert again == trained
    evaluated = evaluate.evaluate(dataclasses.replace(config, mode="eval"), one_device)
    assert evaluated["step"] == 50 and evaluated["eval"] == trained["eval"]

    export_dir = evaluate.export(dataclasses.replace(config, mode="export"))
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    trainer = build.run(config, one_device)
    checkpoint.restore(
        tf.train.Checkpoint(models=held.model_state(trainer.models)),
        checkpoint.list_checkpoints(tmp_path / "checkpoints")[0],
        partial=True,
    )
    images = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))["image"]
    out = served(images=images)
    np.testing.assert_allclose(out["logits"].numpy(), trainer.model(images).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["classes"].numpy(), np.argmax(out["logits"].numpy(), -1))
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        evaluate.export(dataclasses.replace(config, mode="export"))


def test_the_export_refuses_images_of_another_shape_than_its_signature(data_dir, one_device, tmp_path):
    # Before: the signature checked only the dtype: [n, 8, 8] and a [n, 4, 4, 4] batch ran through the MLP's flatten
    # and were answered (a channels-first RGB batch answered other classes than the same images channels-last).
    config = helpers.make_config(data_dir, str(tmp_path), train_steps=2, hidden_sizes=(8,))
    loop.train(config, one_device)
    served = tf.saved_model.load(evaluate.export(dataclasses.replace(config, mode="export")))
    serve = served.signatures["serving_default"]
    assert serve(images=tf.zeros([3, 8, 8, 1]))["classes"].shape == (3,)
    for shape in ([3, 8, 8], [3, 64], [3, 4, 4, 4], [3, 1, 8, 8]):
        says = f"Shape of tensor images [{','.join(map(str, shape))}] is not compatible with expected shape [?,8,8,1]"
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(says)):
            serve(images=tf.zeros(shape))


def test_the_export_keeps_the_names_of_a_forks_unnamed_serving_inputs(tmp_path):
    # The shape-checking wrapper's own parameters replaced them: a fork's serve(z, labels) with unnamed specs was
    # exported as serve(inputs_0=...), and a client's serve(z=...) failed.
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None], tf.int32, name="ids")])
    def serve(z, labels):
        return {"doubled": z * 2.0, "labels": labels}

    module = tf.Module()
    module.serve = serving.checking_shapes(serve)
    tf.saved_model.save(module, str(tmp_path), signatures=module.serve.get_concrete_function())
    served = tf.saved_model.load(str(tmp_path)).signatures["serving_default"]
    out = served(z=tf.ones([3, 2]), ids=tf.range(3))
    assert out["doubled"].numpy().tolist() == [[2.0, 2.0]] * 3 and out["labels"].numpy().tolist() == [0, 1, 2]


@pytest.mark.slow
def test_sidecar_evaluates_each_new_checkpoint(data_dir, one_device, tmp_path):
    args = [
        f"--data_dir={data_dir}",
        "--train_steps=600",
        "--checkpoint_every=200",
        "--steps_per_loop=50",
        "--hidden_sizes=512,512",
        "--keep_checkpoints=5",
    ]
    job = helpers.start_launch(tmp_path, *args)
    config = helpers.make_config(
        data_dir, str(tmp_path), train_steps=600, hidden_sizes=(512, 512), mode="continuous_eval", eval_timeout=120
    )
    results = evaluate.follow(config, one_device, poll_seconds=0.2)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-2000:]
    steps = [r["step"] for r in results]
    assert steps[-1] == 600 and steps == sorted(set(steps)) and len(steps) >= 2
    assert all(r["examples"] == 360 for r in results)
    summary = json.load(open(tmp_path / "summary.json"))
    assert results[-1]["accuracy"] == pytest.approx(summary["eval"]["accuracy"], abs=1e-6)
    assert logged_steps(tmp_path, "continuous_eval.jsonl") == steps
    assert any(name.startswith("events.out") for name in os.listdir(tmp_path / "continuous_eval" / "test"))
