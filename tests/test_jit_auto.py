"""--jit_compile=auto|true|false: the engine's choice on each kind of hardware, the flag as absl parses it, older
runs' config.json, and the run's first line saying what was chosen and why."""

import json

import keras
import pytest
from absl import flags

import launch
from engine.cluster import distribute
from engine.run import build, loop, xla
from engine.settings.config import from_json, validate
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from models import resnet
from tests import helpers

AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
BF16_ONLY = frozenset({"avx512f", "avx512_bf16"})
EPYC = frozenset({"avx2", "fma"})  # no bfloat16 units
DENSE_CPU = "auto: float32 dense layers on a CPU: XLA fuses the step"


@pytest.mark.parametrize(
    "setting,precision,device,cpu,convolutions,synchronizes,expected",
    [
        ("true", "mixed_bfloat16", "CPU", AMX, True, False, (True, "flag")),
        ("false", "mixed_float16", "GPU", (), False, False, (False, "flag")),
        ("auto", "float32", "CPU", AMX, False, False, (True, DENSE_CPU)),
        ("auto", "float32", "CPU", EPYC, False, False, (True, DENSE_CPU)),
        (
            "auto",
            "mixed_bfloat16",
            "CPU",
            AMX,
            False,
            False,
            (False, "auto: mixed_bfloat16 on a CPU with amx_bf16: oneDNN's bfloat16 matmuls beat XLA's"),
        ),
        (
            "auto",
            "mixed_bfloat16",
            "CPU",
            BF16_ONLY,
            False,
            False,
            (False, "auto: mixed_bfloat16 on a CPU with avx512_bf16: oneDNN's bfloat16 matmuls beat XLA's"),
        ),
        (
            "auto",
            "mixed_bfloat16",
            "CPU",
            EPYC,
            False,
            False,
            (True, "auto: mixed_bfloat16 dense layers on a CPU: XLA fuses the step"),
        ),
        (
            "auto",
            "float32",
            "CPU",
            EPYC,
            True,
            False,
            (False, "auto: convolutions on a CPU: oneDNN's beat XLA's"),
        ),
        (
            "auto",
            "mixed_bfloat16",
            "CPU",
            AMX,
            True,
            False,
            (False, "auto: convolutions on a CPU: oneDNN's beat XLA's"),
        ),
        (
            "auto",
            "mixed_float16",
            "GPU",
            (),
            True,
            False,
            (True, "auto: mixed_float16 on a GPU: XLA fuses the elementwise ops around cuBLAS and cuDNN"),
        ),
        (
            "auto",
            "mixed_float16",
            "GPU",
            (),
            True,
            True,
            (False, "auto: the model or task synchronizes replicas inside its forward pass, which XLA cannot"),
        ),
        (
            "auto",
            "mixed_bfloat16",
            "TPU",
            (),
            True,
            True,
            (False, "auto: on a TPU every step is compiled with XLA anyway"),
        ),
        # An explicit true nested XLA functions inside the TPU's own compilation of the step.
        ("true", "float32", "TPU", (), False, False, (False, "flag: on a TPU every step is compiled with XLA anyway")),
    ],
)
def test_choose_decides_each_case(setting, precision, device, cpu, convolutions, synchronizes, expected):
    assert xla.choose(setting, precision, device, cpu, convolutions, synchronizes) == expected


def test_bfloat16_units_are_left_to_large_matmuls():
    small = "auto: mixed_bfloat16 on a CPU with amx_bf16, but matmuls of at most 8,192 weights, too small for the units"
    assert xla.choose("auto", "mixed_bfloat16", "CPU", AMX, largest_matrix=64 * 128) == (
        True,
        f"{small}: XLA fuses the step",
    )
    assert xla.choose("auto", "mixed_bfloat16", "CPU", AMX, largest_matrix=256 * 256) == (
        False,
        "auto: mixed_bfloat16 on a CPU with amx_bf16: oneDNN's bfloat16 matmuls beat XLA's",
    )
    # float32 and CPUs without the units are not affected by the size.
    assert xla.choose("auto", "float32", "CPU", AMX, largest_matrix=64) == (True, DENSE_CPU)
    mlp = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256), keras.layers.Dense(10)])
    assert xla.largest_matrix([mlp]) == 784 * 256  # kernels, not biases
    assert xla.largest_matrix([keras.Sequential([keras.Input((3,))])]) == 0


def test_cpu_flags_come_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512_bf16 amx_bf16\n\nflags\t: other\n")
    assert xla.cpu_flags(str(cpuinfo)) == {"fpu", "avx512_bf16", "amx_bf16"}
    assert xla.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_convolutions_are_found_at_any_depth():
    net = resnet.ResNet(8, 4, 10)  # its convolutions sit inside blocks and a Sequential shortcut
    net(keras.ops.zeros((1, 8, 8, 3)))
    mlp = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    assert xla.has_convolutions([mlp, net]) and not xla.has_convolutions([mlp])


def _flag_values():
    values = flags.FlagValues()
    flags.DEFINE_flag(launch._SwitchFlag("jit_compile", "auto", "help"), flag_values=values)
    return values


@pytest.mark.parametrize(
    "args,expected",
    [
        ([], "auto"),
        (["--jit_compile"], "true"),
        (["--nojit_compile"], "false"),
        (["--jit_compile=auto"], "auto"),
        (["--jit_compile=true"], "true"),
        (["--jit_compile=False"], "false"),
        (["--jit_compile=1"], "true"),
    ],
)
def test_flag_takes_auto_true_false_and_the_bare_forms(args, expected):
    values = _flag_values()
    values(["launch.py", *args])
    assert values.jit_compile == expected
    assert validate(Config(jit_compile=values.jit_compile)).jit_compile == expected


def test_flag_refuses_anything_else_in_one_line(tmp_path):
    with pytest.raises(flags.IllegalFlagValueError, match="^flag --jit_compile=maybe: must be auto, true or false$"):
        _flag_values()(["launch.py", "--jit_compile=maybe"])
    result = helpers.launch(f"--workdir={tmp_path / 'work'}", "--jit_compile=maybe", timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == "error: --jit_compile=maybe: must be auto, true or false"
    assert not (tmp_path / "work").exists()


def test_config_takes_bools_as_older_runs_saved_them():
    assert validate(Config(jit_compile=True)).jit_compile == "true"
    assert validate(Config(jit_compile=False)).jit_compile == "false"
    assert from_json({"jit_compile": False}, "w").jit_compile == "false"
    assert from_json({"jit_compile": "auto"}, "w").jit_compile == "auto"
    with pytest.raises(ConfigError, match='^w: jit_compile="maybe": must be auto, true or false$'):
        from_json({"jit_compile": "maybe"}, "w")
    with pytest.raises(ConfigError, match="^--jit_compile=maybe: must be auto, true or false$"):
        validate(Config(jit_compile="maybe"))


def _header(output):
    return next(line for line in output.splitlines() if line.startswith("task="))


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,setting,cpu,expected",
    [
        (
            "mixed_bfloat16",
            "auto",
            AMX,
            "jit_compile=false (auto: mixed_bfloat16 on a CPU with amx_bf16: oneDNN's bfloat16 matmuls beat XLA's)",
        ),
        ("mixed_bfloat16", "true", AMX, "jit_compile=true (flag)"),
        ("float32", "auto", EPYC, f"jit_compile=true ({DENSE_CPU})"),
    ],
)
def test_header_says_what_was_chosen_and_why(
    data_dir, one_device, tmp_path, capsys, monkeypatch, precision, setting, cpu, expected
):
    monkeypatch.setattr(xla, "cpu_flags", lambda: cpu)
    config = helpers.make_config(
        data_dir, str(tmp_path), precision=precision, jit_compile=setting, train_steps=2, hidden_sizes=(256, 256)
    )
    loop.train(config, one_device)
    assert _header(capsys.readouterr().out).endswith(f" global_batch_size=64 input=in-step {expected}")
    trainer = build.run(config, one_device)  # and the step is built as the line says
    assert getattr(trainer.program.train_step, "_jit_compile", False) == ("=true" in expected)


def test_an_older_runs_config_json_with_a_bool_resumes(data_dir, one_device, tmp_path, capsys):
    loop.train(helpers.make_config(data_dir, str(tmp_path), train_steps=4, steps_per_loop=2), one_device)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "jit_compile": False}))  # as the engine wrote it
    summary = loop.train(helpers.make_config(data_dir, str(tmp_path), train_steps=6, steps_per_loop=2), one_device)
    assert summary["step"] == 6 and "resumed from step 4" in capsys.readouterr().out


@pytest.mark.slow
def test_auto_traces_again_without_xla_when_the_model_synchronizes_replicas(data_dir, mirrored, capsys, monkeypatch):
    # On a GPU auto compiles the ResNet; with two replicas its synchronized batch norm cannot be compiled.
    monkeypatch.setattr(distribute, "device_kind", lambda strategy: "GPU")
    config = helpers.make_config(data_dir, model="resnet", precision="mixed_float16", **helpers.XLA_CASE)
    trainer = build.run(config, mirrored)
    assert trainer.program.jit_compile
    out = trainer.program.run_steps(trainer.program.train_iterator(), 3)
    assert out["steps"] == 3 and not trainer.program.jit_compile and int(trainer.state.step.numpy()) == 3
    assert capsys.readouterr().out == (
        "jit_compile=false (auto: the model or task synchronizes replicas inside its forward pass, which XLA "
        "cannot): the step is traced again without XLA\n"
    )


def test_the_evaluation_traced_before_the_first_step_follows_it_off_xla(data_dir, one_device, capsys, monkeypatch):
    """trace() (--compile_cache) builds the evaluation with XLA before the first step runs; when that step then
    finds an op XLA has no kernel for and runs without XLA, the evaluation follows it, with no fallback of its own."""
    import tensorflow as tf

    from engine.run.program import Recompiled
    from tasks import classification

    forward = classification.Task.forward

    def drawn(self, models, batch, training):
        weight = tf.random.stateless_gamma([tf.shape(batch["label"])[0], 1], seed=[1, 2], alpha=50.0) / 50.0
        return weight * forward(self, models, batch, training)

    monkeypatch.setattr(classification.Task, "forward", drawn)
    trainer = build.run(helpers.make_config(data_dir, jit_compile="auto"), one_device)
    loop.trace(trainer)
    assert trainer.program.jit_compile and trainer.evaluator.jit
    with pytest.raises(Recompiled):
        trainer.program.run_steps(trainer.program.train_iterator(), 2)
    results = trainer.evaluator.evaluate()
    assert not trainer.program.jit_compile and trainer.evaluator.jit is False
    assert "evaluation without XLA" not in capsys.readouterr().out
    assert results["examples"] == 360 and 0.0 <= results["accuracy"] <= 1.0


def test_auto_runs_without_xla_when_the_step_holds_an_op_xla_cannot_compile(
    data_dir, one_device, tmp_path, capsys, monkeypatch
):
    """A task drawing from a gamma distribution (mixup's Beta): XLA has no kernel for it. Auto finds out at the first
    step, after its batch was taken; the run reads that batch again and ends where a run without XLA ends."""
    import tensorflow as tf

    from tasks import classification

    cross_entropy = classification.Task.loss

    def loss(self, outputs, batch):
        weight = tf.random.stateless_gamma([tf.shape(outputs)[0]], seed=[1, 2], alpha=50.0) / 50.0
        return weight * cross_entropy(self, outputs, batch)

    monkeypatch.setattr(classification.Task, "loss", loss, raising=False)
    runs = {}
    for setting in ("auto", "false"):
        config = helpers.make_config(data_dir, str(tmp_path / setting), jit_compile=setting, train_steps=6)
        runs[setting] = loop.train(config, one_device)
    out = capsys.readouterr().out
    assert (
        out.count(
            "jit_compile=false (auto: the step holds ops XLA cannot compile (StatelessRandomGammaV3)): the "
            "first round runs again"
        )
        == 1
    ), out
    assert runs["auto"]["step"] == runs["false"]["step"] == 6
    assert runs["auto"]["train_loss"] == runs["false"]["train_loss"]  # the same batches, in the same order
    assert runs["auto"]["eval"] == runs["false"]["eval"]


def test_choose_leaves_xla_off_for_parameter_servers_and_ops_it_cannot_compile():
    assert xla.choose("auto", "float32", "CPU", AMX, remote=True) == (
        False,
        "auto: the variables live on parameter servers, which an XLA program cannot read",
    )
    assert xla.choose("auto", "mixed_float16", "GPU", unsupported="StatelessRandomGammaV3") == (
        False,
        "auto: the step holds ops XLA cannot compile (StatelessRandomGammaV3)",
    )
    assert xla.choose("true", "float32", "CPU", remote=True) == (True, "flag")  # the user's word


@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_evaluation_compiles_with_xla_where_the_step_does_and_gives_the_same_numbers(data_dir, request, strategy):
    """The evaluation's forward pass and metrics compile where the train step does (one XLA program per replica,
    the all-reduce outside it), traced once: the trace that named the metrics is the one evaluated."""
    results = {}
    for setting in ("auto", "false"):
        trainer = build.run(helpers.make_config(data_dir, jit_compile=setting), request.getfixturevalue(strategy))
        results[setting] = trainer.evaluator.evaluate()
        assert trainer.evaluator.jit == (setting == "auto") == trainer.program.jit_compile
        if strategy == "one_device" and setting == "auto":
            assert trainer.evaluator.sums.experimental_get_tracing_count() == 1
    assert results["auto"]["examples"] == results["false"]["examples"] == 360
    assert results["auto"] == pytest.approx(results["false"], rel=1e-5)


@pytest.mark.parametrize("setting", ["auto", "true"])
def test_evaluation_runs_without_xla_when_its_metrics_hold_an_op_xla_cannot_compile(
    data_dir, one_device, capsys, monkeypatch, setting
):
    """A metric training never runs, drawn from a gamma distribution (no XLA kernel): found when the evaluation
    first runs, which runs again without XLA, saying so once, and reports what an evaluation without XLA does."""
    import tensorflow as tf

    from tasks import classification

    metrics = classification.Task.metrics

    def with_gamma(self, outputs, batch):
        gamma = tf.random.stateless_gamma([tf.shape(batch["label"])[0]], seed=[1, 2], alpha=50.0) / 50.0
        return {**metrics(self, outputs, batch), "gamma": gamma}

    monkeypatch.setattr(classification.Task, "metrics", with_gamma)
    compiled = build.run(helpers.make_config(data_dir, jit_compile=setting), one_device)
    plain = build.run(helpers.make_config(data_dir, jit_compile="false"), one_device)
    assert compiled.program.jit_compile and not plain.program.jit_compile
    results = [compiled.evaluator.evaluate(), compiled.evaluator.evaluate(), plain.evaluator.evaluate()]
    assert capsys.readouterr().out == (
        "evaluation without XLA (the task's forward pass or metrics use StatelessRandomGammaV3, which XLA cannot "
        "compile): traced again\n"
    )
    assert compiled.evaluator.jit is False and compiled.program.jit_compile  # training keeps XLA
    assert results[0] == results[1] == results[2] and 0.9 < results[0]["gamma"] < 1.1


@pytest.mark.parametrize(
    "strategy,metric,reason",
    [
        ("mirrored", "synchronized", "the task's metrics synchronize replicas"),
        ("one_device", "shuffled", "XLA could not compile the task's forward pass or metrics: "),
    ],
)
def test_evaluation_runs_without_xla_when_xla_refuses_its_metrics(
    data_dir, request, capsys, monkeypatch, strategy, metric, reason
):
    """Other refusals than a missing kernel, also found at the first evaluation: a metric summed over the replicas
    (XLA cannot synchronize replicas inside one's program), a shuffle (XLA's compile fails on it)."""
    import tensorflow as tf

    from tasks import classification

    metrics = classification.Task.metrics

    def with_metric(self, outputs, batch):
        ones = tf.ones_like(batch["weight"])
        if metric == "synchronized":
            value = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, ones)
        else:
            value = tf.random.shuffle(ones)  # XLA's own compile fails on it (FailedPreconditionError, TF 2.21)
        return {**metrics(self, outputs, batch), metric: value}

    monkeypatch.setattr(classification.Task, "metrics", with_metric)
    compiled = build.run(helpers.make_config(data_dir, jit_compile="auto"), request.getfixturevalue(strategy))
    plain = build.run(helpers.make_config(data_dir, jit_compile="false"), request.getfixturevalue(strategy))
    results = [compiled.evaluator.evaluate(), plain.evaluator.evaluate()]
    out = capsys.readouterr().out
    assert out.startswith(f"evaluation without XLA ({reason}") and out.endswith("): traced again\n")
    assert out.count("\n") == 1 and compiled.evaluator.jit is False and compiled.program.jit_compile
    assert results[0] == results[1] and results[0][metric] == (2.0 if metric == "synchronized" else 1.0)


def test_a_decoder_compiles_with_xla_on_a_cpu_and_in_float32_on_a_gpu_only():
    """A language model's decoder: XLA on a CPU (its step the faster), in float32 on a GPU (its step PyTorch's), not
    in mixed precision on a GPU (its compile took minutes on an H200): bench/RESULTS.md's "XLA on a GPU"."""
    assert xla.choose("auto", "float32", "CPU", EPYC, decoder=True) == (
        True,
        "auto: a float32 decoder on a CPU: XLA fuses the step",
    )
    for precision in ("mixed_bfloat16", "mixed_float16"):
        assert xla.choose("auto", precision, "GPU", decoder=True) == (
            False,
            f"auto: a decoder in {precision} on a GPU: XLA's compile of it takes minutes",
        )
        assert xla.choose("auto", precision, "GPU")[0]  # a dense model: XLA
    assert xla.choose("auto", "float32", "GPU", decoder=True)[0]
    assert xla.choose("true", "mixed_bfloat16", "GPU", decoder=True) == (True, "flag")  # the user's word
    gpt = keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(65, 16), keras.layers.Dense(65)])
    mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16)])
    assert xla.is_decoder([gpt]) and not xla.is_decoder([mlp])
