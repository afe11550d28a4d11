"""The memory check (engine/run/memory.py): a GPU run is judged against a GPU's memory with one replica's share of
the batch, a CPU run against this machine's; each part comes from the file that knows it."""

import dataclasses
import os
import stat

import pytest

from engine.cluster.distribute import Placement
from engine.run import memory
from engine.settings import machine
from engine.settings.config import validate
from engine.settings.errors import ConfigError, TaskError
from engine.settings.fields import Config


def _fake_nvidia_smi(tmp_path, monkeypatch, mib):
    """An nvidia-smi on PATH that lists GPUs of `mib` MiB each, as the driver's --query-gpu prints them."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {m}\n" for m in mib))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_the_smallest_gpu_is_the_one_judged(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, [143771, 81559])
    assert machine.gpu_memory_bytes() == 81559 * 2**20
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert machine.gpu_memory_bytes() is None  # no driver: no GPU to judge against


def _on(device, replicas):
    """The Placement of a run of `replicas` on `device` in one process."""
    name = "mirrored" if replicas > 1 else "one_device"
    return Placement(
        strategy=None,
        name=name,
        device=device,
        replicas=replicas,
        workers=1,
        multi_worker=False,
        parameter_server=False,
        chief=True,
        task=0,
    )


def _decoder(**overrides):
    """The 12-layer decoder of the GPU issue at batch 16, context 1024."""
    settings = dict(task="language_model", gpt_layers=12, gpt_dim=768, gpt_heads=12, sequence_length=1024)
    return validate(Config(**{**settings, "global_batch_size": 16, **overrides}))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_gpu_run_is_judged_against_a_gpus_memory_with_its_share_of_the_batch(tmp_path, monkeypatch, replicas):
    _fake_nvidia_smi(tmp_path, monkeypatch, [4 * 1024])  # a 4 GiB GPU
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 10**15)  # the host is not what is judged
    config = _decoder()
    parts = memory.estimate(config, (1024,), 65, copies=1, shares=replicas, data=False)
    with pytest.raises(ConfigError) as refused:
        memory.check(config, _on("GPU", replicas), (1024,), 65)
    message = str(refused.value)
    assert message.startswith("--gpt_layers=12: needs about ") and message.endswith("more than a GPU's 4.29 GB")
    # Each GPU holds a whole model and its replica's share of the batch, so two GPUs halve the batch's part only.
    single = memory.estimate(config, (1024,), 65, copies=1, shares=1, data=False)
    assert parts["model, gradients and optimizer slots"] == single["model, gradients and optimizer slots"]
    assert parts["training batch"] == single["training batch"] // replicas
    # On a GPU of 141 GB (an H200) the same run fits.
    _fake_nvidia_smi(tmp_path, monkeypatch, [143771])
    memory.check(config, _on("GPU", replicas), (1024,), 65)


def test_a_cpu_run_is_judged_against_this_machines_memory(monkeypatch):
    monkeypatch.setattr(memory, "gpu_memory_bytes", lambda: pytest.fail("a CPU run asked for a GPU's memory"))
    config = _decoder(gpt_layers=2, gpt_dim=128, gpt_heads=2, sequence_length=256, global_batch_size=8)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 10**12)
    memory.check(config, _on("CPU", 1), (256,), 65)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 10**6)
    with pytest.raises(ConfigError, match="more than this machine's 1 MB$"):
        memory.check(config, _on("CPU", 1), (256,), 65)
    # Two logical CPU devices (mirrored): this machine holds both replicas' models, and the whole batch.
    two = memory.estimate(config, (256,), 65, copies=2, shares=1)
    one = memory.estimate(config, (256,), 65)
    assert two["model, gradients and optimizer slots"] == 2 * one["model, gradients and optimizer slots"]
    assert two["training batch"] == one["training batch"]


def test_a_model_without_a_size_is_said_to_be_unestimated(monkeypatch, capsys):
    monkeypatch.setattr(memory, "model_size", lambda config, shape, outputs: None)
    memory.check(validate(Config()), _on("CPU", 1), (8, 8, 1), 10)
    assert capsys.readouterr().out == "memory: models/mlp.py has no size(config, input_shape, outputs): not estimated\n"


def test_a_sources_own_data_is_refused_before_it_is_made(monkeypatch):
    config = validate(Config(dataset="synthetic", synthetic_examples=10**9))
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 10**9)
    with pytest.raises(ConfigError) as refused:
        memory.check_data(config)
    assert str(refused.value) == (
        "--synthetic_examples=1000000000: its data needs about 4.01 TB of memory, more than this machine's 1 GB"
    )
    memory.check_data(dataclasses.replace(config, synthetic_examples=4096))
    # Its labels are drawn from logits of examples x classes: left out, 10 million classes of one feature passed
    # as 40 MB and ended in an OOM traceback.
    config = validate(Config(dataset="synthetic", synthetic_classes=10**7, synthetic_shape=(1,)))
    with pytest.raises(ConfigError) as refused:
        memory.check_data(config)
    assert str(refused.value) == (
        "--synthetic_classes=10000000: its data needs about 328 GB of memory, more than this machine's 1 GB"
    )


def test_a_task_that_builds_its_own_models_is_said_to_be_estimated_as_one_of_the_model(capsys):
    # A GAN's generator and discriminator, a contrastive encoder and head: the estimate knows one --model alone.
    memory.check(validate(Config(task="gan")), _on("CPU", 1), (8, 8, 1), None)
    assert capsys.readouterr().out == (
        "memory: tasks/gan.py builds its own models: estimated as one models/mlp.py of 2 outputs, which its models "
        "may exceed\n"
    )


def test_accumulation_holds_one_microbatchs_activations():
    # --grad_accum_steps=K runs K microbatches in turn: the estimate judged the whole batch's activations kept, and
    # refused runs that fit (36.4 GB where they take 2.2).
    whole = memory.estimate(_decoder(), (1024,), 65)
    for steps in (2, 16):
        parts = memory.estimate(_decoder(grad_accum_steps=steps), (1024,), 65)
        kept = whole["training batch"] - 4 * 16 * 1024  # the batch's own tokens are held whole
        assert parts["training batch"] - 4 * 16 * 1024 == pytest.approx(kept / steps, rel=1e-6)
        # ... and the microbatches' summed gradients beside each one's own: one more float per parameter.
        weights = whole["model, gradients and optimizer slots"]
        assert parts["model, gradients and optimizer slots"] == pytest.approx(weights * 5 / 4, rel=1e-6)  # adamw


@pytest.mark.parametrize(
    "kind, answer, why",
    [
        ("model", 1000, "models/mlp.py: size(config, input_shape, outputs) returned 1000, not (parameters, "),
        ("model", (-(10**13), 0), "models/mlp.py: size(config, input_shape, outputs) returned (-10000000000000, 0)"),
        ("model", ("1e6", 10), "models/mlp.py: size(config, input_shape, outputs) returned ('1e6', 10)"),
        ("dataset", "1 GB", "sources/synthetic.py: memory(config) returned '1 GB', not the bytes its data takes"),
        ("dataset", -(10**14), "sources/synthetic.py: memory(config) returned -100000000000000, not the bytes"),
        # Infinity passed as a number of at least 0, and ended the check in an OverflowError's traceback (exit 1), as
        # did an integer too large for a float when the refusal wrote its bytes.
        ("model", (float("inf"), 10), "models/mlp.py: size(config, input_shape, outputs) returned (inf, 10), not "),
        ("model", (10**400, 10), "models/mlp.py: size(config, input_shape, outputs) returned (1000000000000000"),
        ("dataset", float("inf"), "sources/synthetic.py: memory(config) returned inf, not the bytes its data takes"),
    ],
)
def test_a_plugins_estimate_that_is_no_count_of_bytes_is_one_line(monkeypatch, kind, answer, why):
    # A negative one was subtracted from the total: a 16 TB run passed the check.
    import models.mlp
    import sources.synthetic

    if kind == "model":
        monkeypatch.setattr(models.mlp, "size", lambda config, shape, outputs: answer)
    else:
        monkeypatch.setattr(sources.synthetic, "memory", lambda config: answer)
    with pytest.raises(TaskError) as refused:
        memory.check(validate(Config(dataset="synthetic")), _on("CPU", 1), (28, 28, 1), 10)
    assert str(refused.value).startswith(why)


def test_a_run_that_does_not_train_is_judged_without_gradients_slots_or_a_training_batch(monkeypatch):
    # --mode=export, sample and eval judged the trained run's settings as if they trained: the 12-layer decoder of a
    # global batch of 64 (8 on each of 8 GPUs, 31.1 GB each) was refused an export on a 64 GB machine as needing
    # 239 GB, its training batch's activations, though it holds 344 MB of weights and one evaluation batch (1.63 GB).
    config = _decoder(global_batch_size=64, eval_batch_size=8)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 * 10**9)
    with pytest.raises(ConfigError, match="more than this machine's 64 GB$"):
        memory.check(config, _on("CPU", 1), (1024,), 65)
    memory.check(config, _on("CPU", 1), (1024,), 65, training=False)
    parts = memory.estimate(config, (1024,), 65, training=False)
    trained = memory.estimate(config, (1024,), 65)
    assert parts["model"] == trained["model, gradients and optimizer slots"] // 4  # adamw: weights, gradients, 2 slots
    assert parts["training batch"] == 0 and parts["evaluation batch"] == trained["evaluation batch"]
    # ... and one that cannot hold even that is still refused, naming what to change.
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 10**9)
    refusal = r"^--gpt_dim=768: needs about 1.63 GB of memory \(model 344 MB, evaluation batch 1.29 GB\), more than"
    with pytest.raises(ConfigError, match=refusal):
        memory.check(config, _on("CPU", 1), (1024,), 65, training=False)
    # An export or a sample holds no batch: refused as the evaluation batch of a global batch it never reads.
    exporting = dataclasses.replace(config, mode="export", eval_batch_size=0, global_batch_size=10**6)
    memory.check(exporting, _on("CPU", 1), (1024,), 65, training=False)
    assert memory.estimate(exporting, (1024,), 65, training=False)["evaluation batch"] == 0


def test_an_npz_files_arrays_are_in_the_estimate_and_one_too_large_is_refused_before_it_is_read(tmp_path, monkeypatch):
    # An npz's arrays counted for nothing: a file larger than the machine passed the check, and numpy then read all
    # of it, with TensorFlow's copies of the two splits the run reads beside it (measured: 1.1 GB of peak resident
    # memory for 492 MB of arrays), to be killed for memory without a word.
    import numpy as np

    arrays = {
        f"{split}/{feature}": np.zeros((examples, *shape), dtype)
        for split, examples in (("train", 400), ("test", 100), ("validation", 100))
        for feature, shape, dtype in (("image", (8, 8, 1), np.float32), ("label", (), np.int64))
    }
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    config = validate(Config(dataset=f"npz:{path}"))
    copied = sum(a.nbytes for name, a in arrays.items() if name.split("/")[0] in ("train", "test"))  # eval_split test
    held = sum(a.nbytes for a in arrays.values()) + copied
    assert held <= memory.source_memory(config) <= held + 128 * 10  # each .npy header (128 bytes), the copied twice
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: held // 2)
    with pytest.raises(ConfigError) as refused:
        memory.check_data(config)
    assert str(refused.value) == (
        f"--dataset=npz:{path}: its data needs about 292 kB of memory, more than this machine's 145 kB"
    )
    # A file it cannot read adds nothing: loading it says what is wrong.
    assert memory.source_memory(validate(Config(dataset=f"npz:{tmp_path}/missing.npz"))) == 0


@pytest.mark.parametrize(
    "own, limits",
    [
        # cgroup v2, no namespace: a Slurm job's --mem=8G is on its job's cgroup, the root has no memory.max.
        (
            "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n",
            {"system.slice/slurmstepd.scope/job_7/memory.max": "8589934592", "system.slice/memory.max": "max"},
        ),
        # cgroup v1: the process's memory cgroup, below the mount's unlimited root.
        (
            "9:pids:/\n4:memory:/batch/job_7\n0::/\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/batch/job_7/memory.limit_in_bytes": "8589934592",
            },
        ),
    ],
)
def test_a_memory_limit_on_this_processs_own_cgroup_bounds_this_machine(tmp_path, monkeypatch, own, limits):
    # Only the mount's root files were read: a job limited to 8 GiB on a node of 512 GB was judged against 512 GB,
    # and a run needing 100 GB passed the check to be killed for memory.
    import psutil

    for name, value in limits.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(value + "\n")
    (tmp_path / "self_cgroup").write_text(own)
    monkeypatch.setattr(machine, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(machine, "OWN_CGROUPS", str(tmp_path / "self_cgroup"))
    assert machine.host_memory_bytes() == min(8 * 2**30, psutil.virtual_memory().total)


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(dataset="npz:/data/big.npz", model="resnet"), "--dataset=npz:/data/big.npz"),
        (dict(dataset="folder:photos", image_size=1024, model="resnet"), "--image_size=1024"),
    ],
)
def test_an_input_too_large_names_what_gives_it_its_shape(monkeypatch, settings, named):
    # A ResNet of 4 MB on images of 1024x1024x3: its batches take 61 GB, and the refusal named --model=resnet, whose
    # every default it already had, as the setting to change.
    config = validate(Config(global_batch_size=16, **settings))
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 25 * 10**9)
    monkeypatch.setattr(memory, "source_memory", lambda config: 0)
    with pytest.raises(ConfigError) as refused:
        memory.check(config, _on("CPU", 1), (1024, 1024, 3), 2)
    assert str(refused.value).startswith(f"{named}: needs about 60.9 GB of memory for examples of shape 1024x1024x3 (")
    # An MLP on the same images: its first layer's weights are the largest part, and it is named.
    with pytest.raises(ConfigError, match=r"^--model=mlp: needs about [\d.]+ GB of memory \(model, gradients"):
        memory.check(dataclasses.replace(config, model="mlp"), _on("CPU", 1), (1024, 1024, 3), 2)


def test_a_size_that_understates_the_built_model_is_warned_of(data_dir, one_device, monkeypatch, capsys):
    # A model file's size() of a tenth of its parameters passed the memory check by that tenth, unsaid.
    import models.mlp
    from engine.run import build
    from tests import helpers

    config = helpers.make_config(data_dir, hidden_sizes=(32,))  # 64*32+32 + 32*10+10 = 2,410 parameters
    build.run(config, one_device)
    assert "warning" not in capsys.readouterr().out  # the bundled size() is exact
    true_size = models.mlp.size
    monkeypatch.setattr(models.mlp, "size", lambda *a: (true_size(*a)[0] // 10, *true_size(*a)[1:]))
    build.run(config, one_device)
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")] == [
        "warning: models/mlp.py: size(config, input_shape, outputs) says 241 parameters, and the model it built holds "
        "2,410: the memory check went by the estimate"
    ]
    build.run(config, one_device, "evaluate")  # a run that does not train: nothing of it to check
    assert "warning" not in capsys.readouterr().out
