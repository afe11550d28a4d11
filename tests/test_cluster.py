"""Cluster scale: the local launcher, parameter servers, Slurm, unreachable peers, TPU start-up and XLA."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from engine import checkpoint, data, distribute, loop
from engine.config import Config, ConfigError
from tests import helpers
from tests.helpers import ROOT, launch


def final_tensors(workdir):
    return {k: v for k, v in helpers.checkpoint_tensors(workdir)[1].items() if k.startswith("models/")}


@pytest.mark.slow
def test_launcher_runs_two_workers_that_match_one_device(data_dir, tmp_path):
    args = [
        f"--data_dir={data_dir}",
        "--deterministic",
        "--train_steps=20",  # within float rounding of one device; later a ReLU crossing zero amplifies it
        "--steps_per_loop=10",
        "--hidden_sizes=64,64",
        "--clip_norm=0.5",
        "--connect_timeout=120",
    ]
    cluster = launch(f"--workdir={tmp_path / 'two'}", "--strategy=multi_worker", "--local_workers=2", *args)
    assert cluster.returncode == 0, cluster.stdout[-3000:]
    lines = cluster.stdout.splitlines()
    assert any(line.startswith("[worker 0] train step=20") for line in lines)
    assert any(line.startswith("[worker 1] train step=20") for line in lines)
    assert lines[-1] == "[launcher] job finished with exit code 0"
    single = launch(f"--workdir={tmp_path / 'one'}", "--strategy=one_device", *args)
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = final_tensors(tmp_path / "two"), final_tensors(tmp_path / "one")
    assert a.keys() == b.keys() and len(a) == 6
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) < 1e-5
    summaries = [json.load(open(tmp_path / d / "summary.json")) for d in ("two", "one")]
    assert summaries[0]["num_replicas"] == 2 and summaries[0]["eval"]["examples"] == 360
    assert summaries[0]["eval"]["accuracy"] == pytest.approx(summaries[1]["eval"]["accuracy"], abs=1e-9)


def test_launcher_stops_the_job_when_a_worker_fails(data_dir, tmp_path):
    # Worker 1's TF_CONFIG is fine, but its workdir cannot be written: it fails, the launcher stops worker 0.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = launch(
        f"--workdir={blocker}/run",
        f"--data_dir={data_dir}",
        "--strategy=multi_worker",
        "--local_workers=2",
        "--connect_timeout=60",
        timeout=300,
    )
    assert result.returncode != 0
    assert re.search(r"\[launcher\] worker \d exited with \d+; stopping the others", result.stdout)
    assert "cannot write there" in result.stdout


@pytest.mark.slow
def test_parameter_servers_train_to_one_device_accuracy_and_survive_a_dead_worker(data_dir, one_device, tmp_path):
    args = ["--train_steps=400", "--steps_per_loop=100", "--hidden_sizes=256,256", f"--data_dir={data_dir}"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "launch.py",
            f"--workdir={tmp_path / 'ps'}",
            "--strategy=parameter_server",
            "--local_workers=2",
            "--num_ps=1",
            "--connect_timeout=120",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, victim = [], None
    for line in proc.stdout:
        output.append(line)
        pid = re.match(r"\[launcher\] worker 1 pid (\d+)", line)
        if pid:
            victim = int(pid.group(1))
        if victim and line.startswith("[chief 0] train step=200"):
            os.kill(victim, signal.SIGKILL)  # mid-run: the coordinator moves its work to worker 0
    proc.wait(timeout=60)
    text = "".join(output)
    assert proc.returncode == 0, text[-3000:]
    assert "[launcher] worker 1 exited with -9; the job goes on without it" in text
    summary = json.load(open(tmp_path / "ps" / "summary.json"))
    assert summary["step"] == 400 and summary["strategy"] == "parameter_server"
    reader = tf.train.load_checkpoint(checkpoint.list_checkpoints(tmp_path / "ps" / "checkpoints")[0])
    # assign_add on the servers: no update lost between the asynchronous workers.
    assert reader.get_tensor("optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE") == 400
    config = helpers.make_config(
        data_dir,
        str(tmp_path / "one"),
        train_steps=400,
        steps_per_loop=100,
        hidden_sizes=(256, 256),
        global_batch_size=128,
    )
    reference = loop.train(config, one_device)
    print(f"parameter servers {summary['eval']['accuracy']:.4f}, one device {reference['eval']['accuracy']:.4f}")
    assert abs(summary["eval"]["accuracy"] - reference["eval"]["accuracy"]) <= 0.02


SLURM = {"SLURM_STEP_NODELIST": "gpu-node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"}


def test_slurm_allocation_resolves_to_the_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {**SLURM, "SLURM_PROCID": "3"}.items():
        monkeypatch.setenv(name, value)
    resolver = distribute.cluster_resolver(
        Config(strategy="multi_worker", cluster_resolver="slurm", slurm_port_base=9000)
    )
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["gpu-node07:9000", "gpu-node07:9001", "gpu-node08:9000", "gpu-node08:9001"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    resolver = distribute.cluster_resolver(Config(strategy="parameter_server", cluster_resolver="slurm", num_ps=1))
    assert {job: len(tasks) for job, tasks in resolver.cluster_spec().as_dict().items()} == {
        "chief": 1,
        "ps": 1,
        "worker": 2,
    }


def test_slurm_outside_srun_is_a_clear_error(monkeypatch):
    for name in distribute.SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="--cluster_resolver=slurm: SLURM_PROCID is not set; run the job under srun"):
        distribute.cluster_resolver(Config(strategy="multi_worker", cluster_resolver="slurm"))


@pytest.mark.parametrize("present", [0, 1])
def test_unreachable_peer_is_named_within_the_connect_timeout(tmp_path, present):
    ports = helpers.free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": present}})
    started = time.monotonic()
    result = launch(
        f"--workdir={tmp_path}",
        "--strategy=multi_worker",
        "--connect_timeout=8",
        "--dataset=synthetic",
        timeout=120,
        env={"TF_CONFIG": tf_config},
    )
    print(f"unreachable peer reported after {time.monotonic() - started:.1f} s")
    assert result.returncode != 0
    missing = 1 - present
    assert (
        f"error: could not form the cluster within --connect_timeout=8s: no answer from worker {missing} "
        f"(localhost:{ports[missing]})"
    ) in result.stderr


def test_tpu_start_up_sequence(monkeypatch):
    calls = []

    class FakeResolver:
        def __init__(self, tpu):
            calls.append(("resolve", tpu))

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", FakeResolver)
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: calls.append(("connect", type(r))))
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system", lambda r: calls.append(("initialize", type(r))))
    monkeypatch.setattr(tf.distribute, "TPUStrategy", lambda r: calls.append(("strategy", type(r))) or "strategy")
    assert distribute.create_strategy(Config(strategy="tpu", tpu="my-tpu")) == "strategy"
    assert calls == [
        ("resolve", "my-tpu"),
        ("connect", FakeResolver),
        ("initialize", FakeResolver),
        ("strategy", FakeResolver),
    ]


@pytest.mark.parametrize("model", ["mlp", "resnet", "transformer"])
def test_every_step_function_compiles_with_xla(data_dir, one_device, model):
    """What a TPU runs: the whole replica step (all-reduce and update included) and the eval step, each one XLA
    computation with static shapes and no Python side effects."""
    trainer = loop.Trainer(helpers.make_config(data_dir, model=model, clip_norm=1.0), one_device)
    batch = next(iter(trainer.data.train_fn(tf.distribute.InputContext())))
    train = tf.function(trainer.train_step, jit_compile=True)
    assert "HloModule" in train.experimental_get_compiler_ir(batch)(stage="hlo")
    evaluate = tf.function(trainer.eval_step, jit_compile=True)
    weighted = {**batch, "weight": tf.ones([batch["image"].shape[0]])}
    assert "HloModule" in evaluate.experimental_get_compiler_ir(weighted)(stage="hlo")
    out = one_device.run(tf.function(train), args=(batch,))
    assert bool(out["finite"]) and int(trainer.optimizer.iterations.numpy()) == 1


def test_tf_data_service_serves_the_same_batches(data_dir):
    dispatcher = tf.data.experimental.service.DispatchServer()
    worker = tf.data.experimental.service.WorkerServer(  # noqa: F841  (serves until the test ends)
        tf.data.experimental.service.WorkerConfig(dispatcher_address=dispatcher.target.split("://")[1])
    )
    config = helpers.make_config(data_dir)
    direct = [b["image"].numpy() for b in data.load(config).train_fn(tf.distribute.InputContext()).take(5)]
    served_config = dataclasses.replace(config, tf_data_service=dispatcher.target)
    served = [b["image"].numpy() for b in data.load(served_config).train_fn(tf.distribute.InputContext()).take(5)]
    assert sorted(b.tobytes() for b in served) == sorted(b.tobytes() for b in direct)
