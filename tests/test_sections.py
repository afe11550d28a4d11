"""The run's settings in sections (engine/settings/sections.py): each setting in one section, views that read their own
and name where another's lives, plugin settings under their owner, config.json still flat (an old workdir
resumes), and the functions handed a section computing what they computed from the whole Config."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from engine.cluster import distribute
from engine.data import datasets as data
from engine.data.pipeline import Pipelines
from engine.numerics import optim
from engine.run import loop, xla
from engine.run.actions.builtin import Checkpoint, Evaluate
from engine.settings import sections
from engine.settings.config import load_run_config
from engine.settings.declared import declared_settings
from engine.settings.errors import ConfigError
from engine.settings.fields import FIELD_BY_NAME, Config, _RunSettings
from tests import helpers

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = {f.name for f in dataclasses.fields(_RunSettings)}
OWNERS = sorted({f.metadata["owner"] for f in dataclasses.fields(Config) if "owner" in f.metadata})


def _everything(config):
    """A view of every setting at once: what a function read before sections, any setting at all."""
    return sections.Section(config, "everything", [*FIELD_BY_NAME, *sections.DERIVED])


def _homes(config, name):
    """The sections (engine's and owners') that hold `name` as their own, not lent to them (shared=, READS)."""
    lent = FIELD_BY_NAME[name].metadata.get("shared", set()) | Config.READ_BY.get(name, set())
    return [
        where
        for where in [*sections.SECTIONS, *OWNERS]
        if name in sections.section(config, where).names and where not in lent
    ]


def test_every_setting_is_in_exactly_one_section():
    config = Config()
    for f in dataclasses.fields(Config):
        assert _homes(config, f.name) == [sections.home(f)], f.name
        if f.name in ENGINE:
            assert f.metadata["section"] in sections.SECTIONS and "owner" not in f.metadata, f.name
            assert f.metadata["shared"] <= set(sections.SECTIONS) - {f.metadata["section"]}, f.name
        else:
            assert f.metadata["owner"] in OWNERS and "section" not in f.metadata, f.name
    # Every section holds something, and the sections together hold every setting once.
    held = [name for where in sections.SECTIONS for name in sections.section(config, where).names]
    assert all(sections.section(config, where).names for where in sections.SECTIONS)
    own = [f.name for f in dataclasses.fields(Config) if "owner" in f.metadata]
    lent = sum(len(f.metadata.get("shared", ())) for f in dataclasses.fields(Config))
    assert len(held) - len(sections.DERIVED) - lent == len(ENGINE)
    assert set(held) - set(sections.DERIVED) | set(own) == set(FIELD_BY_NAME)


def test_a_few_settings_sit_where_a_reader_looks_for_them():
    where = {f.name: sections.home(f) for f in dataclasses.fields(Config)}
    assert [where[n] for n in ("learning_rate", "clip_norm", "ema_decay")] == ["optimization"] * 3
    assert [where[n] for n in ("train_steps", "steps_per_loop", "on_nan")] == ["loop"] * 3
    assert [where[n] for n in ("precision", "jit_compile", "initial_loss_scale")] == ["numerics"] * 3
    assert [where[n] for n in ("strategy", "tf_data_service", "connect_timeout")] == ["cluster"] * 3
    assert [where[n] for n in ("dataset", "shuffle_buffer", "global_batch_size")] == ["data"] * 3
    assert [where[n] for n in ("tune_trials", "members", "validation_split")] == [
        ("mode", "tune"),
        ("mode", "ensemble"),
        ("mode", "tune"),
    ]
    assert where["resnet_depth"] == ("model", "resnet") and where["sequence_length"] == ("task", "language_model")


def test_a_view_reads_its_own_settings_and_names_the_section_of_another():
    config = Config(learning_rate=0.25, steps_per_loop=7, global_batch_size=32, eval_batch_size=0)
    optimization = config.optimization
    assert optimization.learning_rate == 0.25 and optimization.optimizer == "adamw"
    assert optimization.train_steps == 1000 and optimization.global_batch_size == 32  # shared: the schedule's
    assert config.loop.steps_per_loop == 7 and config.data.per_eval_batch_size == 32
    with pytest.raises(AttributeError, match=r"the setting steps_per_loop is in config\.loop, not config\.optim"):
        _ = optimization.steps_per_loop
    with pytest.raises(AttributeError, match=r"the setting precision is in config\.numerics, not config\.loop"):
        _ = config.loop.precision
    with pytest.raises(AttributeError, match=r"resnet_depth is in config\.own\('model', 'resnet'\), not config\.data"):
        _ = config.data.resnet_depth
    with pytest.raises(AttributeError, match=r"no setting learnig_rate \(in config\.optimization or any other"):
        _ = optimization.learnig_rate
    with pytest.raises(dataclasses.FrozenInstanceError):
        optimization.learning_rate = 1.0
    changed = optimization.replace(learning_rate=0.5)
    assert changed.learning_rate == 0.5 and optimization.learning_rate == 0.25 and changed != optimization
    assert optimization == Config(learning_rate=0.25, global_batch_size=32).optimization
    # A view is what a function that reads that section is handed; another section's view is refused.
    assert sections.section(optimization, "optimization") is optimization
    with pytest.raises(AttributeError, match=r"handed config\.loop where config\.optimization is read"):
        sections.section(config.loop, "optimization")


def test_plugin_settings_sit_under_their_owner():
    config = Config(model="resnet", resnet_depth=14)
    assert config.own("model", "resnet").resnet_depth == 14
    assert config.own("model", "resnet").names == ("resnet_depth", "resnet_width")
    with pytest.raises(AttributeError, match=r"resnet_width is in config\.own\('model', 'resnet'\), not config\.own"):
        _ = config.own("model", "gpt").resnet_width
    # A file's READS lends it another's setting: shakespeare reads language_model's --sequence_length.
    assert config.own("dataset", "shakespeare").sequence_length == config.sequence_length
    assert "sequence_length" in config.own("task", "language_model").names
    for owner in OWNERS:  # every declared setting under exactly the file that declares it
        for name in config.own(*owner).names:
            assert FIELD_BY_NAME[name].metadata.get("owner") == owner or owner in Config.READ_BY.get(name, ())


def test_a_plugin_is_handed_every_engine_setting_its_own_and_what_its_reads_names():
    config = Config(model="resnet", resnet_depth=14, sequence_length=32, sam_rho=0.2)
    resnet = sections.plugin(config, "model", "resnet")
    assert (resnet.resnet_depth, resnet.seed, resnet.dropout, resnet.per_eval_batch_size) == (14, 0, 0.0, 128)
    assert resnet.data.global_batch_size == 128 and resnet.own("model", "resnet").resnet_depth == 14
    assert type(resnet).__name__ == "ResnetModelConfig" and type(resnet).__annotations__["resnet_depth"] is int
    assert sections.plugin(config, "dataset", "shakespeare").sequence_length == 32  # its READS
    assert sections.plugin(resnet, "task", "sam").sam_rho == 0.2  # what another plugin was handed: the same run
    with pytest.raises(AttributeError) as raised:
        _ = sections.plugin(config, "task", "classification").sam_rho
    assert str(raised.value) == (
        "tasks/classification.py reads the setting sam_rho, which tasks/sam.py declares: name it in "
        "tasks/classification.py's READS (READS = ('sam_rho',)), so a run of tasks/classification.py depends on it "
        "and takes --sam_rho"
    )
    with pytest.raises(AttributeError, match=r"^no setting sam_rhoo: the engine declares none"):
        _ = resnet.sam_rhoo
    with pytest.raises(dataclasses.FrozenInstanceError):
        resnet.seed = 1


@pytest.mark.parametrize(
    "kind, folder, name, what",
    [
        ("model", "models", "loop", "a section of Config"),
        # config.dataset_name is the dataset a run reads: a task's setting so named replaced it for every run.
        ("task", "tasks", "dataset_name", "a value Config derives"),
        # config.json holds the run's class names beside its settings: they replaced a model's setting so named,
        # and the resume read them back as its value.
        ("model", "models", "class_names", "a key config.json holds"),
        ("dataset", "sources", "source", "a key config.json holds"),
    ],
    ids=["section", "derived", "class_names", "source"],
)
def test_a_file_may_not_declare_a_setting_named_as_config_names_its_own(tmp_path, kind, folder, name, what):
    os.makedirs(tmp_path / folder)
    (tmp_path / folder / "odd.py").write_text(f'SETTINGS = {{"{name}": (1, "a name Config has")}}')
    packages = [(kind, str(tmp_path / folder), ["odd"])]
    fields, _, errors = declared_settings(packages, str(tmp_path), {"dropout"}, sections.RESERVED)
    assert fields == [] and errors == [
        f"{folder}/odd.py: declares the setting {name}, which engine/settings/sections.py ({what}) declares "
        "already: rename one of them"
    ]


def test_an_optimizer_override_of_another_sections_setting_says_where_it_lives():
    with pytest.raises(ConfigError, match=r"^group: the setting steps_per_loop is in config\.loop, not config\.opt"):
        optim.checked_settings(Config().optimization, {"steps_per_loop": 3}, "group")
    assert optim.checked_settings(Config().optimization, {"learning_rate": 0.0}, "group").learning_rate == 0.0


def test_a_flat_config_json_from_before_sections_loads_and_resumes(tmp_path):
    """tests/data/before_updates: a 5-step run saved before sections, its config.json flat. It loads (each value in
    its section), resumes to step 6, and the config.json the resumed run writes is as flat as before."""
    old = tmp_path / "old"
    shutil.copytree(os.path.join(HERE, "data", "before_updates"), old)
    with open(old / "config.json") as f:
        flat = json.load(f)
    saved = load_run_config(str(old))
    for name, value in flat.items():
        if name in FIELD_BY_NAME:
            kept = getattr(sections.section(saved, sections.home(FIELD_BY_NAME[name])), name)
            assert kept == (tuple(value) if isinstance(value, list) else value), name
    assert saved.optimization.ema_decay == 0.9 and saved.own("model", "mlp").hidden_sizes == (8,)
    summary = loop.train(dataclasses.replace(saved, workdir=str(old), train_steps=6, jit_compile="false"))
    assert summary["step"] == 6 and os.path.exists(old / "checkpoints" / "ckpt-6.index")
    with open(old / "config.json") as f:
        written = json.load(f)
    # Beside the settings, what the labels mean, what the training split held and what the source gave the task: no
    # setting, no section.
    assert set(written) - {"class_names", "training_split", "source"} == set(FIELD_BY_NAME)
    assert not set(written) & set(sections.SECTIONS)


def _run_optimizer(settings, groups=()):
    rng = np.random.default_rng(1)
    shapes = [(5, 3), (3,)]
    params = [tf.Variable(rng.normal(size=s).astype(np.float32)) for s in shapes]
    optimizer = optim.Optimizer(settings, params, ["a/kernel", "b/bias"], groups)
    values, slots = [p.value() for p in params], [[s.value() for s in ss] for ss in optimizer.slots]
    for step in range(6):
        grads = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes]
        values, slots, rates = optimizer.updates(values, slots, tf.constant(step, tf.int64), grads)
    return [v.numpy() for v in values], {k: float(v) for k, v in rates.items()}


@pytest.mark.parametrize(
    "settings",
    [
        dict(optimizer="adamw", weight_decay=0.01, warmup_steps=3, lr_schedule="cosine", train_steps=8),
        dict(optimizer="sgd", momentum=0.9, nesterov=True, lr_scaling="linear", global_batch_size=512),
        dict(optimizer="lamb", learning_rate=0.01, beta_1=0.8),
    ],
    ids=["adamw", "sgd", "lamb"],
)
def test_an_optimizer_built_from_its_section_updates_as_one_built_from_every_setting(settings):
    config = Config(**settings)
    groups = ((r"^b/", {"learning_rate": 0.002}),)
    from_section, rates = _run_optimizer(config.optimization, groups)
    from_everything, everything_rates = _run_optimizer(_everything(config), groups)
    for a, b in zip(from_section, from_everything, strict=True):
        np.testing.assert_array_equal(a, b)
    assert rates == everything_rates and set(rates) == {"learning_rate", "learning_rate/^b/"}
    for step in (0, 2, 5, 7):
        assert float(optim.learning_rate(config.optimization, step)) == float(
            optim.learning_rate(_everything(config), step)
        )
    if settings.get("lr_scaling") == "linear":  # the shared global_batch_size reached the schedule
        assert rates["learning_rate"] == pytest.approx(1e-3 * 512 / 256)


def test_the_loop_and_numerics_sections_decide_as_the_whole_config_did():
    config = Config(train_steps=50, eval_every=20, checkpoint_every=15)
    loop = config.loop
    evaluate, save = Evaluate(loop.eval_every, loop.train_steps), Checkpoint(loop.checkpoint_every, loop.train_steps)
    due = [(evaluate.due(s, False), save.due(s, False)) for s in (15, 20, 30, 40, 45, 50)]
    assert due == [(False, True), (True, False), (False, True), (True, False), (False, True), (False, True)]
    strategy = distribute.placement(tf.distribute.OneDeviceStrategy("/cpu:0"), "one_device")
    for switch in ("true", "false"):
        numerics = Config(jit_compile=switch).numerics
        assert xla.resolve(numerics, strategy, {})[0] == (switch == "true")


def test_the_data_pipelines_read_their_section_as_they_read_every_setting(data_dir):
    config = helpers.make_config(data_dir, shuffle_buffer=50, global_batch_size=16)
    source = data.load_source(config, ())
    ctx = tf.distribute.InputContext()
    batches = []
    for settings in (config.data, _everything(config)):
        stream = Pipelines(settings, source).train(ctx, 3, 0, None)
        batches.append([next(iter(stream.take(1)))])
    for key in batches[0][0]:
        np.testing.assert_array_equal(batches[0][0][key], batches[1][0][key])
