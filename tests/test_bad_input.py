"""Bad input found before anything is written: one `error: --flag=value: why` line, exit 2, no workdir.

Most cases fail in config.validate, before TensorFlow is imported; a dataset that is neither in --data_dir
nor reachable fails as the data loads, still before the workdir exists.
"""

import concurrent.futures
import dataclasses
import importlib
import os

import pytest

from engine.run import build
from engine.settings import plugins
from engine.settings.config import validate
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from engine.settings.machine import human_bytes
from tests import helpers
from tests.helpers import launch

# (flags, the flag and value the error line starts with); {tmp} is the test's directory.
CASES = [
    (["--seed=4294967296"], "--seed=4294967296"),
    (["--model=../tests/helpers"], "--model=../tests/helpers"),
    (["--model=..tests.helpers"], "--model=..tests.helpers"),
    (["--model=."], "--model=."),
    (["--model=mlp.os"], "--model=mlp.os"),
    (["--hidden_sizes=100000000000"], "--hidden_sizes=100000000000"),
    (["--dataset=synthetic", "--synthetic_shape=100000,100000,100"], "--synthetic_shape=100000,100000,100"),
    (["--flagfile={tmp}/binary"], "--flagfile={tmp}/binary"),
    (["--flagfile={tmp}/missing"], "--flagfile={tmp}/missing"),
    (["--hiden_sizes=3"], "--hiden_sizes=3"),
    (["--seed=abc"], "--seed=abc"),
    (["--mode=tune", "--tune_pruner=none", "--tune_space={tmp}/binary"], "--tune_space={tmp}/binary"),
    (["--mode=tune", "--tune_pruner=none", "--tune_space={tmp}/inf.space"], "--tune_space={tmp}/inf.space"),
    (["--mode=tune", "--tune_pruner=none", "--tune_space={tmp}/model.space"], "--tune_space={tmp}/model.space"),
    (["--eval_batch_size=100000000"], "--eval_batch_size=100000000"),
    (["--train_steps=99999999999999999999999"], "--train_steps=99999999999999999999999"),
    (["--num_cpu_devices=100000"], "--num_cpu_devices=100000"),
    # One device, workers and servers take one CPU device each: the split was ignored, unsaid.
    (["--strategy=one_device", "--num_cpu_devices=2"], "--num_cpu_devices=2"),
    (["--compile_cache=/dev/null/cache"], "--compile_cache=/dev/null/cache"),
    (["--nodeterministic=true"], "--nodeterministic=true"),
    (["--flagfile={tmp}/negated.flags"], "--nosave_initial=1"),
    (["--tf_data_service=notaurl"], "--tf_data_service=notaurl"),
    (["--tf_data_service=grpc://localhost:1", "--connect_timeout=1"], "--tf_data_service=grpc://localhost:1"),
    # Each named another value than the one given, or nothing at all (an empty --flagfile= ran the defaults).
    (["--data_dir={tmp}/binary"], "--data_dir={tmp}/binary"),
    (["--task=distillation", "--teacher={tmp}/teacher"], "--teacher={tmp}/teacher"),
    (["--flagfile="], "--flagfile="),
]
# Downloads go through a proxy that refuses connections: the network is unreachable, on any machine.
OFFLINE = {name: "http://127.0.0.1:9" for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
OFFLINE.update(NO_PROXY="", no_proxy="")


def test_bad_input_fails_before_anything_is_written(tmp_path):
    (tmp_path / "binary").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "inf.space").write_text("learning_rate float 1e-4 inf\n")
    (tmp_path / "model.space").write_text("model choice ..x mlp\n")
    (tmp_path / "negated.flags").write_text("--nosave_initial=1\n")
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "config.json").write_text("{bad")

    def attempt(index):
        args = [a.format(tmp=tmp_path) for a in CASES[index][0]]
        return launch(f"--workdir={tmp_path}/work{index}", *args, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(attempt, range(len(CASES))))
    for index, ((args, expected), result) in enumerate(zip(CASES, results)):
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert len(lines) == 1, (args, result.stderr[-2000:])
        assert lines[0].startswith(f"error: {expected.format(tmp=tmp_path)}: "), (args, lines[0])
        assert not (tmp_path / f"work{index}").exists(), args


def test_dataset_neither_prepared_nor_reachable_fails_at_once(tmp_path):
    """tfds alone retries each download for minutes; this fails in seconds, before the workdir or a lock exists."""
    result = launch(f"--workdir={tmp_path}/work", "--dataset=mnist", f"--data_dir={tmp_path}/tfds", env=OFFLINE)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == (
        f"error: --dataset=mnist: not prepared in --data_dir={tmp_path}/tfds ({tmp_path}/tfds/mnist/3.0.1) and the "
        "network is unreachable (proxy 127.0.0.1:9: Connection refused); prepare it on a machine with a network and "
        "copy it there"
    )
    assert not (tmp_path / "work").exists() and not (tmp_path / "tfds").exists()


def test_a_flagfile_with_a_byte_order_mark_or_an_indented_comment_is_named_in_one_line(tmp_path):
    # A recipe saved by a Windows editor as "UTF-8 with BOM" ended in "error: unexpected arguments '\ufeff# The
    # default job, ...' (flags look like --name=value)": a comment called a flag, and no flagfile named.
    recipe = open(helpers.ROOT + "/experiments/digits_mlp.flags", "rb").read()
    (tmp_path / "bom.flags").write_bytes(b"\xef\xbb\xbf" + recipe)
    (tmp_path / "outer.flags").write_text(f"# a recipe of mine\n--flagfile={tmp_path}/bom.flags\n")
    for args in ([f"--flagfile={tmp_path}/bom.flags"], ["--flagfile", f"{tmp_path}/outer.flags"]):
        result = launch(f"--workdir={tmp_path}/work", *args, "--train_steps=5", timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.splitlines() == [
            f"error: --flagfile={tmp_path}/bom.flags: starts with a byte order mark (U+FEFF, as some Windows editors "
            "save UTF-8), which hides its first line; save it as UTF-8 without one"
        ]

    # A comment indented in a flagfile is no comment to absl: "unexpected arguments '# my note'", naming no file.
    (tmp_path / "noted.flags").write_text("--train_steps=5\n   # my note\n")
    result = launch(f"--workdir={tmp_path}/work", f"--flagfile={tmp_path}/noted.flags", timeout=120)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: --flagfile={tmp_path}/noted.flags: the comment '# my note' is indented, so it is read as an argument: "
        "begin its line with #"
    ], result.stderr[-2000:]
    assert not (tmp_path / "work").exists()


def test_help_exits_zero():
    result = launch("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--hidden_sizes" in result.stdout and result.stderr == ""


def test_help_to_a_reader_that_stopped_reading_ends_quietly():
    """`python launch.py --help | head -2`: the pipe closes before the help is written (a BrokenPipeError traceback,
    exit 1, before)."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        result = subprocess.run(
            [sys.executable, "launch.py", "--help"], cwd=helpers.ROOT, stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (0, "")


def test_bytes_past_the_largest_unit_are_said_in_it():
    assert human_bytes(615 * 10**6) == "615 MB"
    assert human_bytes(1.5 * 10**24) == "1.5e+06 EB"  # "over 1000 EB": "needs about over 1000 EB of memory"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(seed=2**32), "--seed=4294967296: must be in [0, 2**32)"),
        (dict(seed=2**32 - 1), None),
        (dict(workdir=" "), "--workdir= : must name a directory"),
        (dict(model="transformer"), None),
        (
            dict(model="_private"),
            f"--model=_private: must name a file in models/ ({', '.join(plugins.names('model'))})",
        ),
        (dict(model="os"), f"--model=os: must name a file in models/ ({', '.join(plugins.names('model'))})"),
        (dict(num_cpu_devices=64), None),
        (dict(num_cpu_devices=65), "--num_cpu_devices=65: must be at most 64"),
        (dict(train_steps=2**63 // 128 - 1), None),
        (dict(train_steps=2**63 // 128), "--train_steps=72057594037927936: times --global_batch_size=128"),
        (dict(warmup_steps=2**63), "--warmup_steps=9223372036854775808: must be less than 2**63"),
        # Accepted before, then nonsense: a non-finite loss, a launcher starting every process, accuracy 1.0.
        (dict(epsilon=0.0), "--epsilon=0.0: must be a positive number"),
        (dict(momentum=1.0), "--momentum=1.0: must be in [0, 1)"),
        # In range as Python floats, not as the float32 the step computes in: a non-finite loss blamed on the
        # learning rate (epsilon 0, beta_1 1), a run that never moved a weight (beta_2 1), or one whose every step
        # was skipped at a loss scale of inf and that ended as if it had trained (exit 0).
        (dict(epsilon=1e-50), "--epsilon=1e-50: is 0 in float32, which the step computes in: must be in"),
        (dict(epsilon=1e-40), "--epsilon=1e-40: is 9.99995e-41 in float32, which the step computes in: must be in"),
        (dict(epsilon=1e-37), None),
        (
            dict(beta_1=0.99999999),
            "--beta_1=0.99999999: rounds to 1 in float32, which the step computes in: at most 0.99999994",
        ),
        (dict(beta_2=0.99999999), "--beta_2=0.99999999: rounds to 1 in float32"),
        (dict(beta_2=0.9999999), None),
        (
            dict(precision="mixed_float16", initial_loss_scale=1e39),
            "--initial_loss_scale=1e+39: is inf in float32, which the step computes in: must be in [1.1754944e-38, "
            "3.4028235e+38]",
        ),
        (dict(learning_rate=1e39), "--learning_rate=1e+39: is inf in float32"),
        (dict(learning_rate=1e-50), "--learning_rate=1e-50: is 0 in float32"),
        # Its scaled peak overflowed: every step non-finite, blamed on the loss and the rate at the first step.
        (
            dict(learning_rate=1e37, lr_scaling="linear", base_batch_size=1),
            "--learning_rate=1e+37: scaled by --lr_scaling=linear (x128, --global_batch_size=128 / "
            "--base_batch_size=1) is 1.28e+39: inf in float32, which the step computes in",
        ),
        (dict(learning_rate=1e36, lr_scaling="linear", base_batch_size=1), None),
        (dict(weight_decay=999.0), None),
        (
            dict(weight_decay=2.0, learning_rate=0.25, lr_scaling="linear", global_batch_size=512),
            "--weight_decay=2.0: times the peak learning rate (0.5) must be less than 1",
        ),
        # Nesterov's look-ahead is the momentum's: without one it trained as plain SGD, silently.
        (
            dict(optimizer="sgd", nesterov=True, momentum=0.0),
            "--nesterov=true: needs --momentum above 0: with --momentum=0 it would train as plain SGD",
        ),
        (dict(optimizer="sgd", nesterov=True, momentum=0.5), None),
        (dict(strategy="multi_worker", local_workers=4), None),
        (
            dict(strategy="multi_worker", local_workers=100000),
            "--local_workers=100000: starts 100000 TensorFlow processes here; at most ",
        ),
        (
            dict(strategy="parameter_server", local_workers=4, num_ps=100),
            "--num_ps=100: with --local_workers=4 starts 105 TensorFlow processes here (a chief, 4 workers, 100 "
            "parameter servers); at most ",
        ),
        (  # each task ran it and said so: two errors, after both processes had started
            dict(strategy="multi_worker", local_workers=2, mode="eval"),
            "--local_workers=2: starts the workers of a train run, not --mode=eval",
        ),
        (
            dict(strategy="multi_worker", local_workers=2, cluster_resolver="slurm"),
            "--local_workers=2: writes the cluster's TF_CONFIG, which --cluster_resolver=slurm would not read",
        ),
        (  # each Slurm task trained alone on one device, the workdir's lock refusing all but one
            dict(strategy="one_device", cluster_resolver="slurm"),
            "--cluster_resolver=slurm: is not read by --strategy=one_device, which runs in one process (each task of "
            "a job would train alone): use --strategy=multi_worker, parameter_server or tpu, or leave --strategy out",
        ),
        (
            dict(strategy="mirrored", cluster_resolver="tpu"),
            "--cluster_resolver=tpu: is not read by --strategy=mirrored",
        ),
        (dict(cluster_resolver="slurm"), None),
        (  # "a chief, 1 workers"
            dict(strategy="parameter_server", local_workers=1, num_ps=64),
            "--num_ps=64: with --local_workers=1 starts 66 TensorFlow processes here (a chief, 1 worker, 64 "
            "parameter servers); at most ",
        ),
        (dict(dataset="synthetic", synthetic_classes=1), "--synthetic_classes=1: must be in [2, 2147483647]"),
        (
            dict(image_size=32),
            "--image_size=32: --dataset=digits does not read it (read by --dataset=folder, --dataset=tfrecord "
            "and tensorflow-datasets names)",
        ),
        (dict(dataset="folder:photos", image_size=32), None),
        (  # its shape overflowed TensorFlow's: a traceback
            dict(dataset="folder:photos", image_size=3000000000),
            "--image_size=3000000000: must be at most 16384 pixels a side (an image of that size is 3.2 GB as float32 "
            "RGB)",
        ),
        (  # it trained on digits, the path unread
            dict(dataset="digits:/data/mine.npz"),
            "--dataset=digits:/data/mine.npz: sources/digits.py takes no argument after its name (those that do: "
            "folder:PATH, npz:PATH, tfrecord:GLOB)",
        ),
        (dict(slurm_port_base=65536), "--slurm_port_base=65536: must be a port, in [1, 65535]"),
        (
            dict(initial_loss_scale=0.5),
            "--initial_loss_scale=0.5: must be at least 1, the dynamic loss scale's floor (below it float16's small "
            "gradients only underflow)",
        ),
    ],
)
def test_bounds(overrides, message):
    config = Config(**overrides)
    if message is None:
        assert validate(config) == dataclasses.replace(
            config, dataset=config.dataset or "digits", model=config.model or "mlp"
        )
    else:
        with pytest.raises(ConfigError) as error:
            validate(config)
        assert str(error.value).startswith(message), str(error.value)


def test_memory_estimate_names_its_size():
    from engine.run import memory

    config = validate(dataclasses.replace(Config(), dataset="synthetic", synthetic_shape=(8, 8, 4)))
    memory.judge(config, (8, 8, 4), 10, 16 * 2**30, "this machine's")
    with pytest.raises(ConfigError) as error:
        memory.judge(
            dataclasses.replace(config, hidden_sizes=(300_000, 300_000)), (8, 8, 4), 10, 16 * 2**30, "this machine's"
        )
    # 90,080,400,010 parameters (256 x 300k + 300k x 300k + 300k x 10 and biases) in float32, each with its gradient
    # and AdamW's two slots; batches of 128 with 256 input and 600,266 activation floats each, kept for the backward
    # pass in training; 5,120 synthetic examples of 256 floats and a label, and the 256 x 10 labelling projection.
    assert str(error.value) == (
        "--hidden_sizes=300000,300000: needs about 1.44 TB of memory (model, gradients and optimizer slots 1.44 TB, "
        "training batch 615 MB, evaluation batch 307 MB, synthetic data 5.62 MB), more than this machine's 17.2 GB"
    )


@pytest.mark.parametrize(
    "overrides,input_shape",
    [
        (dict(model="mlp", hidden_sizes=(32, 16)), (8, 8, 1)),
        (dict(model="resnet", resnet_depth=14, resnet_width=4), (8, 8, 3)),
        (dict(model="transformer", transformer_layers=2, transformer_dim=16, transformer_heads=2), (8, 8, 1)),
        (dict(model="gpt", gpt_layers=2, gpt_dim=16, gpt_heads=2), (8,)),
        (dict(model="gpt", gpt_layers=1, gpt_dim=12, gpt_heads=3, dropout=0.1), (5,)),
    ],
)
def test_parameter_count_is_what_keras_builds(overrides, input_shape):
    import tensorflow as tf

    from engine.run.create import create_model

    config = Config(**overrides)
    with tf.device("/cpu:0"):
        dtype = tf.int32 if config.model == "gpt" else tf.float32  # gpt reads token ids
        model = create_model(config, config.model, tf.TensorSpec(input_shape, dtype), 10)
    assert importlib.import_module(f"models.{config.model}").size(config, input_shape, 10)[0] == model.count_params()


def test_largest_seed_reseeds_a_resumed_study_within_32_bits():
    import optuna

    from research import tune_study

    def first_draw(sampler):
        study = optuna.create_study(sampler=sampler)
        study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
        return study.trials[0].params["x"]

    # A resumed study offsets the seed by the trials already drawn: (2**32 - 1 + 5) wraps to 4, as NumPy under
    # Optuna's samplers takes 32 bits.
    resumed = tune_study.make_sampler(Config(seed=2**32 - 1, tune_sampler="random"), offset=5)
    assert first_draw(resumed) == first_draw(optuna.samplers.RandomSampler(seed=4))


def test_memory_is_checked_again_with_the_datasets_own_shape(data_dir, monkeypatch):

    import tensorflow as tf

    from engine.run import memory

    config = helpers.make_config(data_dir)  # validated without the digits' shape: one value, two classes
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 100_000)
    with pytest.raises(ConfigError) as error:
        build.run(config, tf.distribute.OneDeviceStrategy("/cpu:0"))
    # 8 x 8 inputs, 10 classes: 3,466 parameters (64 x 32 + 32 x 32 + 32 x 10 and biases) with their gradients and
    # AdamW's slots; batches of 64 with 64 input and 138 activation floats each, kept for the backward pass in
    # training (the evaluation's batch, which never lives beside it, counts only where it is the larger). Every size
    # setting is at or below its default, so the model itself is named.
    assert str(error.value) == (
        "--model=mlp: needs about 142 kB of memory (model, gradients and optimizer slots 55.5 kB, training batch "
        "87 kB, evaluation batch 51.7 kB), more than this machine's 100 kB"
    )


def test_input_the_last_hunt_found_ending_in_a_traceback_is_one_line(tmp_path, monkeypatch):
    """Each of these ended in a traceback and exit 1, or (a run inside another's workdir) mixed two runs' files."""
    import json

    from engine.settings.errors import CheckpointError
    from engine.state import report
    from engine.state import workdir as workdir_lib

    # A 'ps' job under --strategy=multi_worker, which has none.
    cluster = {"cluster": {"ps": ["localhost:1"], "worker": ["localhost:2"]}, "task": {"type": "ps", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    with pytest.raises(ConfigError, match="--strategy=multi_worker: runs no 'ps' job, which TF_CONFIG has: use "):
        helpers.make_config("", strategy="multi_worker")
    monkeypatch.delenv("TF_CONFIG")
    # A workdir inside another run's, or the checkout itself.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for inside in (run / "checkpoints", run / "eval" / "deeper"):
        with pytest.raises(ConfigError, match=f"is inside the workdir of another run \\({run}\\): give this run"):
            workdir_lib.check_same_run(helpers.make_config("", str(inside)))
    with pytest.raises(ConfigError, match="is this checkout itself: give the run a folder of its own"):
        workdir_lib.check_same_run(helpers.make_config("", plugins.ROOT))
    with pytest.raises(ConfigError, match="^--workdir=/ is the root of the file system: give the run a folder"):
        workdir_lib.check_same_run(helpers.make_config("", "/"))
    # A log that is a folder: exit 4, naming it, as a file that cannot be written.
    (tmp_path / "logs" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"cannot write {tmp_path}/logs/metrics.jsonl"):
        report.Report(str(tmp_path / "logs"), True, 10, resume_step=5)


def test_a_file_given_as_an_npz_that_is_no_npz_of_good_arrays_is_one_line(tmp_path):
    import zipfile

    import numpy as np

    from engine.data import datasets

    # A .npy file given as an npz, and features holding NaN (every step would diverge, "lower --learning_rate").
    np.save(tmp_path / "one.npy", np.zeros((10, 4)))
    features = np.ones((8, 3), np.float32)
    features[5, 1] = np.nan
    np.savez(tmp_path / "nan.npz", **{"train/image": features, "train/label": np.arange(8) % 2})
    # The same NaN in a split the run does not read is no one's business: it reads train, evaluates test.
    unread = {"train/image": np.ones((8, 3), np.float32), "train/label": np.arange(8) % 2}
    unread.update({"test/image": np.ones((4, 3), np.float32), "test/label": np.arange(4) % 2})
    np.savez(tmp_path / "unread.npz", **unread, **{"validation/image": features, "validation/label": np.arange(8) % 2})
    unread_config = helpers.make_config("", dataset=f"npz:{tmp_path / 'unread.npz'}", eval_split="test")
    assert datasets.load_source(unread_config, ("image", "label")).info["num_classes"] == 2
    (tmp_path / "text.npz").write_text("hello world")  # numpy called it "pickled data"
    (tmp_path / "empty.npz").write_bytes(b"")
    # A column named as a feature the engine sets: a test/weight weighted the evaluation's means in silence (the
    # accuracy printed "on 11 examples" of 7); a member numpy did not write read as bytes (AttributeError).
    arrays = {"train/image": np.ones((8, 3), np.float32), "train/label": np.arange(8) % 2}
    np.savez(tmp_path / "weight.npz", **arrays, **{"train/weight": np.full(8, 2.0, np.float32)})
    with zipfile.ZipFile(tmp_path / "notes.npz", "w") as archive:
        for name, values in arrays.items():
            with archive.open(f"{name}.npy", "w") as f:
                np.save(f, values)
        archive.writestr("train/notes.txt", b"collected 2024")
    for name, said in (
        ("one.npy", "a single array (a .npy file), not a .npz archive of named arrays"),
        ("text.npz", "not a .npz archive (it begins with b'hello ', not a zip archive's b'PK\\x03\\x04')"),
        ("empty.npz", "not a .npz archive (it is empty)"),
        ("nan.npz", "train/image holds NaN or infinity (example 5 first)"),
        (
            "weight.npz",
            "array 'train/weight': weight is a feature the engine sets itself (how much an evaluation example counts "
            "in the means, which a source's own code sets); name the array otherwise",
        ),
        ("notes.npz", "'train/notes.txt' is not an array (.npy) but a file of another kind in the archive"),
    ):
        config = helpers.make_config("", dataset=f"npz:{tmp_path / name}", eval_split="train")
        with pytest.raises(ConfigError) as refused:
            datasets.load_source(config, ("image", "label"))
        assert str(refused.value) == f"--dataset=npz:{tmp_path / name}: {said}"


def test_a_flag_that_is_not_a_number_is_said_in_our_words(tmp_path):
    # Python's words before: "--train_steps=5x: invalid literal for int() with base 10: '5x'".
    for flag, said in (("--train_steps=5x", "must be an integer"), ("--learning_rate=abc", "must be a number")):
        result = launch(f"--workdir={tmp_path}/work", flag, timeout=120)
        assert (result.returncode, result.stderr.strip().splitlines()) == (2, [f"error: {flag}: {said}"])


def test_a_setting_read_where_a_selector_is_empty_says_so_in_words():
    from engine.settings.unread import read_by

    assert read_by("num_cpu_devices") == "read by --strategy=mirrored and an empty --strategy"
    assert read_by("momentum") == "read by --optimizer=sgd"
