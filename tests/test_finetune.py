"""Fine-tuning: --init_checkpoint warm-starts by variable path with a fresh optimizer, --freeze keeps variables as
they are, and checkpoints are keyed by path, so a fork that reorders its layers is refused by name."""

import os
import shutil
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

from engine import api
from engine.numerics import updates
from engine.run import build, loop
from engine.run import modes as evaluate
from engine.run.controller import Controller
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from tests.helpers import by_path, checkpoint_tensors, launch, make_config

keras = tf.keras


@pytest.fixture(scope="module")
def source(data_dir, tmp_path_factory):
    """A trained digits MLP (32, 32) that kept moving averages: what a fine-tuning run starts from."""
    workdir = str(tmp_path_factory.mktemp("source"))
    loop.train(make_config(data_dir, workdir, ema_decay=0.5), tf.distribute.OneDeviceStrategy("/cpu:0"))
    return workdir


def saved_weights(workdir):
    """{variable path: value} that a warm start from `workdir` takes: the moving average where the run kept one."""
    _, tensors = checkpoint_tensors(workdir)
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
    weights, averages = by_path(tensors, "models"), by_path(tensors, "ema")
    assert all(k.endswith(suffix) for k in tensors if k.startswith(("models/", "ema/")))
    assert averages and averages.keys() <= weights.keys()
    return {**weights, **averages}


@pytest.fixture
def at_start(monkeypatch):
    """What the new run holds when its first step is about to run (after any warm start): its trainer, weights
    {path: value}, optimizer update count and slots, and moving averages."""
    seen = {}
    original = Controller.train

    def run(controller):
        trainer = controller.run
        seen["trainer"] = trainer
        seen["weights"] = {v.path: v.numpy() for v in trainer.model.variables}
        seen["iterations"] = int(trainer.plans[0].optimizer.iterations.numpy())
        seen["slots"] = [s.numpy() for slots in trainer.plans[0].optimizer.slots for s in slots]
        seen["ema"] = {v.path: a.numpy() for v, a in zip(trainer.weights.variables, trainer.weights.averages)}
        return original(controller)

    monkeypatch.setattr(Controller, "train", run)
    return seen


def test_init_checkpoint_starts_from_the_source_by_path_with_a_fresh_optimizer(
    data_dir, source, tmp_path, one_device, at_start, capsys
):
    config = make_config(data_dir, str(tmp_path), init_checkpoint=source, ema_decay=0.9, train_steps=10, seed=1)
    loop.train(config, one_device)
    saved = saved_weights(source)
    assert sorted(at_start["weights"]) == sorted(saved)
    for path, value in at_start["weights"].items():  # the source's moving averages, bit for bit
        np.testing.assert_array_equal(value, saved[path], err_msg=path)
    assert at_start["iterations"] == 0
    assert at_start["slots"] and all(not s.any() for s in at_start["slots"])
    for path, average in at_start["ema"].items():  # this run's averages start at the warm-started weights
        np.testing.assert_array_equal(average, saved[path], err_msg=path)
    assert f"init_checkpoint: 6 variables from {source}/checkpoints/ckpt-20\n" in capsys.readouterr().out


def test_fine_tuning_another_head_names_what_did_not_match_and_freeze_keeps_the_rest(
    data_dir, source, tmp_path, one_device, at_start, capsys
):
    """Digits features, a 4-class synthetic head: the hidden layers start from the source and, frozen, stay
    bit-identical through training with weight decay; the head (other shapes) starts as initialized and trains."""
    config = make_config(
        data_dir,
        str(tmp_path),
        dataset="synthetic",
        synthetic_shape=(8, 8, 1),
        synthetic_classes=4,
        init_checkpoint=source,
        freeze=r"^model/mlp/dense(_1)?/",
        weight_decay=0.01,
        train_steps=10,
    )
    loop.train(config, one_device)
    out = capsys.readouterr().out
    assert (
        f"init_checkpoint: 4 variables from {source}/checkpoints/ckpt-20; other shapes (kept as initialized): "
        "mlp/dense_2/kernel [32, 10] -> [32, 4], mlp/dense_2/bias [10] -> [4]\n"
    ) in out
    trainer, saved = at_start["trainer"], saved_weights(source)
    assert [v.path for v in trainer.weights.variables] == ["mlp/dense_2/kernel", "mlp/dense_2/bias"]
    after = {v.path: v.numpy() for v in trainer.model.variables}
    for path in ("mlp/dense/kernel", "mlp/dense/bias", "mlp/dense_1/kernel", "mlp/dense_1/bias"):
        np.testing.assert_array_equal(at_start["weights"][path], saved[path], err_msg=path)
        np.testing.assert_array_equal(after[path], saved[path], err_msg=path)
    for path in ("mlp/dense_2/kernel", "mlp/dense_2/bias"):
        assert at_start["weights"][path].shape == after[path].shape != saved[path].shape
        assert np.abs(after[path] - at_start["weights"][path]).max() > 1e-4, path


def test_init_checkpoint_that_leaves_most_variables_as_initialized_says_so_in_a_warning(
    data_dir, source, tmp_path, one_device, capsys
):
    """Hidden layers of 16 where the source's are 32: only the head's bias fits, and the run trains from scratch,
    nearly. It was told in the line a fine-tuning run prints, "init_checkpoint: 1 variables from ..."."""
    config = make_config(data_dir, str(tmp_path), init_checkpoint=source, hidden_sizes=(16, 16), train_steps=2)
    loop.train(config, one_device)
    assert (
        f"warning: init_checkpoint: only 1 of this run's 6 variables from {source}/checkpoints/ckpt-20; other shapes "
        "(kept as initialized): mlp/dense/kernel [64, 32] -> [64, 16], "
    ) in capsys.readouterr().out


def test_init_checkpoint_without_a_matching_path_is_refused_leaving_the_workdir_free(
    data_dir, source, tmp_path, one_device
):
    """A ResNet shares no variable path with the MLP. The refusal comes before anything is written, so the
    corrected command runs in the same --workdir."""
    workdir = str(tmp_path / "run")
    flags = [f"--workdir={workdir}", f"--data_dir={data_dir}", "--global_batch_size=64", "--train_steps=2"]
    result = launch("--model=resnet", "--resnet_depth=8", "--resnet_width=4", f"--init_checkpoint={source}", *flags)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"error: --init_checkpoint={source}: no variable of this run is in {source}/checkpoints/ckpt-20 by path "
        "(it has mlp/dense/bias, mlp/dense/kernel, mlp/dense_1/bias, mlp/dense_1/kernel, ...; this run has resnet/"
    )
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not os.path.exists(workdir)  # not even the directory: refused means nothing written
    config = make_config(data_dir, workdir, init_checkpoint=source, train_steps=2)
    assert loop.train(config, one_device)["step"] == 2


class ReorderedMLP(keras.Model):
    """models/mlp.py forked to create its head first: Keras names layers in creation order, so the head is
    mlp/dense now and the hidden layers mlp/dense_1, mlp/dense_2."""

    def __init__(self, hidden_sizes, num_classes, **kwargs):
        super().__init__(**kwargs)
        self.head = keras.layers.Dense(num_classes, dtype="float32")
        self.flatten = keras.layers.Flatten()
        self.hidden = [keras.layers.Dense(width, activation="relu") for width in hidden_sizes]

    def call(self, inputs, training=False):
        x = self.flatten(inputs)
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)


@pytest.fixture
def reordered_mlp(monkeypatch):
    """models/mlp.py replaced by the fork for this test, as a fork that edits the file would have it."""
    fork = types.ModuleType("models.mlp")
    fork.create = lambda config, input_shape, num_classes: ReorderedMLP(config.hidden_sizes, num_classes, name="mlp")
    monkeypatch.setitem(sys.modules, "models.mlp", fork)


def test_a_fork_that_reorders_its_layers_is_refused_by_variable_path(
    data_dir, source, tmp_path, one_device, reordered_mlp
):
    workdir = str(tmp_path / "run")
    shutil.copytree(source, workdir)
    before = checkpoint_tensors(workdir)[1]
    mismatch = r"mlp/dense/(kernel|bias) has shape \[(64, 32|32)\] in the checkpoint and \[(32, 10|10)\] in this run"
    with pytest.raises(ConfigError, match=rf"^--workdir={workdir}: checkpoint \S+ckpt-20 does not fit .*{mismatch}"):
        loop.train(make_config(data_dir, workdir, ema_decay=0.5), one_device)  # resuming the run
    with pytest.raises(ConfigError, match=rf"^checkpoint \S+ckpt-20 does not fit this run: .*{mismatch}"):
        evaluate.evaluate(make_config(data_dir, workdir, mode="eval"), one_device)
    after = checkpoint_tensors(workdir)[1]
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_a_freeze_that_matches_everything_is_refused_before_anything_is_written(data_dir, tmp_path, one_device):
    workdir = str(tmp_path / "run")
    with pytest.raises(
        ConfigError, match=r"^--freeze=\^model/mlp/: matches every trainable variable; nothing to train$"
    ):
        loop.train(make_config(data_dir, workdir, freeze="^model/mlp/"), one_device)
    assert not os.path.exists(workdir)


def test_a_freeze_that_leaves_an_update_nothing_to_train_names_the_flag_not_the_task(data_dir, tmp_path, one_device):
    """A GAN's discriminator frozen whole: the error blamed tasks/gan.py's update ("no trained model
    'discriminator'"), as if the task were wrong; then it named the flag without the value that was given."""
    workdir = str(tmp_path / "run")
    with pytest.raises(ConfigError) as caught:
        loop.train(make_config(data_dir, workdir, task="gan", freeze="^discriminator/"), one_device)
    assert str(caught.value) == (
        "--freeze=^discriminator/: keeps fixed every variable that update 'discriminator' of tasks/gan.py trains "
        "(discriminator/discriminator/dense0/kernel and 5 more): it would train nothing; freeze fewer variables"
    )
    assert not os.path.exists(workdir)


def test_a_freeze_of_one_of_the_models_an_update_trains_leaves_it_the_others():
    # An update of trains=("encoder", "head") with the head frozen whole was refused ("--freeze keeps fixed every
    # variable that update 'both' trains ... it would train nothing"), though it trains the encoder.
    class Task:
        optimizer_groups = ()

        def updates(self):
            return (api.Update("both", trains=("encoder", "head")),)

    config = Config()
    kernel = keras.Variable(np.zeros([2, 2], np.float32), name="kernel")
    weights = build.Weights([kernel], ["encoder/dense/kernel"], [], ("head/dense/kernel",), "^head/")
    plans = updates.build_plans(Task(), weights, config.optimization, config.numerics, "tasks/two.py")
    assert [plan.names for plan in plans] == [["encoder/dense/kernel"]]
    # One it would train nothing of is refused, naming the flag; a misspelt model, the task.
    frozen = build.Weights([kernel], ["encoder/dense/kernel"], [], ("head/dense/kernel",), "^head/")
    Task.updates = lambda self: (api.Update("both", trains=("head",)),)
    with pytest.raises(ConfigError, match=r"^--freeze=\^head/: keeps fixed every variable that update 'both' of "):
        updates.build_plans(Task(), frozen, config.optimization, config.numerics, "tasks/two.py")
    Task.updates = lambda self: (api.Update("both", trains=("encoder", "haed")),)
    with pytest.raises(ConfigError, match=r"^tasks/two.py: update 'both' trains=\('encoder', 'haed'\): no trained "):
        updates.build_plans(Task(), weights, config.optimization, config.numerics, "tasks/two.py")


@pytest.mark.slow
def test_freeze_keeps_the_batch_norm_statistics_it_matches(data_dir, tmp_path, one_device):
    """--freeze names variables; a frozen block's batch-norm statistics are variables too and must not drift."""
    config = make_config(
        data_dir, str(tmp_path), model="resnet", train_steps=3, steps_per_loop=3, freeze=r"^model/resnet/(?!dense)"
    )
    trainer = build.run(config, one_device)
    statistics = {v.path: v.numpy() for v in trainer.model.non_trainable_variables if "moving" in v.path}
    assert statistics
    trainer.program.run_steps(trainer.program.train_iterator(), 3)
    for v in trainer.model.non_trainable_variables:
        if v.path in statistics:
            np.testing.assert_array_equal(v.numpy(), statistics[v.path], err_msg=v.path)
    unfrozen = build.run(config.__class__(**{**config.__dict__, "freeze": r"^model/resnet/dense"}), one_device)
    unfrozen.program.run_steps(unfrozen.program.train_iterator(), 3)
    moved = [v for v in unfrozen.model.non_trainable_variables if "moving" in v.path]
    assert any(not np.array_equal(v.numpy(), statistics[v.path]) for v in moved)  # the test can tell


def test_a_workdir_saved_before_variables_were_keyed_by_path_is_named_so(data_dir, tmp_path, one_device):
    config = make_config(data_dir, str(tmp_path), train_steps=2)
    trainer = build.run(config, one_device)
    # The layout this engine wrote before: the model's variables by position.
    old = tf.train.Checkpoint(model=[v.value for v in trainer.model.variables], step=trainer.state.step)
    old.write(str(tmp_path / "checkpoints" / "ckpt-1"))
    with pytest.raises(ConfigError, match="saved before this engine keyed variables by path"):
        loop.train(config, one_device)


def test_a_truncated_checkpoint_to_start_from_is_refused_in_one_line(data_dir, source, tmp_path, one_device):
    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    data = next((damaged / "checkpoints").glob("ckpt-20.data-*"))
    with open(data, "r+b") as f:  # the index reads, the weights do not: a copy cut short
        f.truncate(100)
    workdir = tmp_path / "run"
    with pytest.raises(
        ConfigError, match=rf"^--init_checkpoint={damaged}: unreadable checkpoint {damaged}/checkpoints"
    ):
        loop.train(make_config(data_dir, str(workdir), init_checkpoint=str(damaged), train_steps=2), one_device)
    assert not workdir.exists()
    with pytest.raises(ConfigError, match=rf"^--checkpoint={damaged}: unreadable checkpoint {damaged}/checkpoints"):
        api.weights(str(damaged))


def test_the_header_counts_every_parameter_and_names_the_trained_ones_beside(data_dir, one_device):
    # It summed the trained variables alone: a ResNet without its batch-norm statistics, a frozen run's head alone.
    from engine.run.controller import parameters

    config = make_config(data_dir, model="resnet", freeze=r"^model/resnet/(?!dense)")
    run = build.run(config, one_device)
    total = run.model.count_params()
    trained = sum(int(np.prod(v.shape)) for v in run.model.trainable_variables if "resnet/dense" in v.path)
    assert parameters(run) == f"{total} (trained {trained})" and trained < total
    whole = build.run(make_config(data_dir, hidden_sizes=(16,)), one_device)
    assert parameters(whole) == str(whole.model.count_params()) == "1210"


def test_a_freeze_that_matches_nothing_is_refused_naming_the_variables_it_could_match(data_dir, tmp_path, one_device):
    """A --freeze with a typo (mpl for mlp) kept nothing fixed and trained every weight, exit 0."""
    workdir = str(tmp_path / "run")
    with pytest.raises(
        ConfigError,
        match=r"^--freeze=\^model/mpl/: matches no variable of the run's trained models; their names are <model name>/"
        r"<path>, such as model/mlp/dense/kernel, model/mlp/dense/bias, ",
    ):
        loop.train(make_config(data_dir, workdir, freeze="^model/mpl/"), one_device)
    assert not os.path.exists(workdir)


def test_a_warm_start_draws_dropout_from_its_own_seed_not_the_sources(data_dir, tmp_path, one_device, at_start, capsys):
    """A seed generator's state is the random stream --seed starts, not a weight: copied, every fine-tuning run of one
    source drew the source's dropout masks whatever its --seed (a seed sweep varied nothing of them), and the line
    counted it among the variables."""
    source = str(tmp_path / "source")
    loop.train(make_config(data_dir, source, dropout=0.2, train_steps=2, seed=7), one_device)
    state = "seed_generator/seed_generator_state"
    saved = by_path(checkpoint_tensors(source)[1], "models")[state]
    own = {v.path: v.numpy() for v in build.run(make_config(data_dir, dropout=0.2, seed=1), one_device).model.variables}
    assert not np.array_equal(own[state], saved)  # the test can tell
    config = make_config(data_dir, str(tmp_path / "run"), dropout=0.2, init_checkpoint=source, train_steps=2, seed=1)
    loop.train(config, one_device)
    np.testing.assert_array_equal(at_start["weights"][state], own[state])
    assert f"init_checkpoint: 6 variables from {source}/checkpoints/ckpt-2\n" in capsys.readouterr().out


def test_a_source_whose_every_shared_path_has_another_shape_is_refused_naming_the_shapes(
    data_dir, source, tmp_path, one_device
):
    """It said "no variable of this run is in ... by path (...; this run has , ...)": every path was there, and the
    list of this run's was empty."""
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        loop.train(make_config(data_dir, str(workdir), hidden_sizes=(16,), init_checkpoint=source), one_device)
    assert str(refused.value) == (
        f"--init_checkpoint={source}: no variable of this run has its shape in {source}/checkpoints/ckpt-20 (other "
        "shapes: mlp/dense/kernel [64, 32] -> [64, 16], mlp/dense/bias [32] -> [16], mlp/dense_1/kernel [32, 32] -> "
        "[16, 10], mlp/dense_1/bias [32] -> [10])"
    )
    assert not workdir.exists()


def test_a_workdir_whose_newest_checkpoint_is_unreadable_starts_from_the_previous_one(
    data_dir, source, tmp_path, one_device, at_start, capsys
):
    """A run training in the source workdir writes a checkpoint's index last: a warm start from it as it saves read a
    ckpt-N without one and was refused, where --mode=eval reads the previous checkpoint."""
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    for data in (copy / "checkpoints").glob("ckpt-20.data-*"):  # ckpt-30 as a save leaves it before its index
        shutil.copy(data, str(data).replace("ckpt-20", "ckpt-30"))
    loop.train(make_config(data_dir, str(tmp_path / "run"), init_checkpoint=str(copy), train_steps=2), one_device)
    out = capsys.readouterr().out
    assert f"warning: --init_checkpoint={copy}: unreadable checkpoint {copy}/checkpoints/ckpt-30 (" in out
    assert f"init_checkpoint: 6 variables from {copy}/checkpoints/ckpt-20\n" in out
    saved = saved_weights(source)
    for path, value in at_start["weights"].items():
        np.testing.assert_array_equal(value, saved[path], err_msg=path)


def test_weights_of_a_workdir_whose_newest_checkpoint_is_unreadable_reads_the_previous_one(source, tmp_path, capsys):
    """engine.api.weights of a run still training, read as it saves (its index comes last), read that ckpt-N without
    one and was refused, where a warm start and --mode=eval read the previous checkpoint."""
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    for data in (copy / "checkpoints").glob("ckpt-20.data-*"):  # ckpt-30 as a save leaves it before its index
        shutil.copy(data, str(data).replace("ckpt-20", "ckpt-30"))
    read = api.weights(str(copy))
    assert (
        f"warning: --checkpoint={copy}: unreadable checkpoint {copy}/checkpoints/ckpt-30 (" in capsys.readouterr().out
    )
    expected = api.weights(str(copy / "checkpoints" / "ckpt-20"))
    assert read.keys() == expected.keys() == {"model", "ema/model"}
    for name, values in expected.items():
        assert read[name].keys() == values.keys()
        for path, value in values.items():
            np.testing.assert_array_equal(read[name][path], value, err_msg=f"{name}/{path}")
