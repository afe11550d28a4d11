"""--task=language_model on the bundled Shakespeare: the source's windows and splits, a short training run's
validation loss, sampling, and mirrored parity."""

import dataclasses
import math
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from engine.run import inputs
from engine.settings.errors import ConfigError
from sources import shakespeare
from tests import helpers
from tests.test_parity import TOLERANCE, _max_difference

# A tiny GPT and short windows: the run, the evaluation and the sampling take seconds.
TINY = dict(
    task="language_model",
    model="gpt",
    gpt_layers=1,
    gpt_heads=2,
    gpt_dim=32,
    sequence_length=32,
    eval_split="validation",
    global_batch_size=32,
    eval_batch_size=512,
    learning_rate=3e-3,
    warmup_steps=10,
    lr_schedule="cosine",
    train_steps=150,
    steps_per_loop=50,
)


def _config(**overrides):
    return helpers.make_config("", **{**TINY, **overrides})


def _decode(tokens, chars):
    return "".join(chars[t] for t in np.asarray(tokens))


# ---- The source ------------------------------------------------------------------------------------------------


def test_vocabulary_is_the_texts_65_sorted_characters():
    source = shakespeare.load(_config(), "validation")
    text = shakespeare.text()
    assert len(text) == 1_115_394
    assert source.info["vocabulary"] == "".join(sorted(set(text)))
    assert len(source.info["vocabulary"]) == 65


def test_training_windows_are_the_text_at_every_offset_and_end_before_validation():
    config = _config()
    source = shakespeare.load(config, "validation")
    chars, text, split_at = source.info["vocabulary"], shakespeare.text(), shakespeare.boundary()
    assert split_at == 1_003_854  # int(0.9 x 1,115,394), nanoGPT's
    assert source.train.examples == split_at - config.sequence_length  # every start whose window fits
    last = source.train.examples - 1
    windows = source.train.fetch(tf.constant([0, 1, 12345, last], tf.int64))["tokens"].numpy()
    assert windows.shape == (4, 33)
    for start, window in zip([0, 1, 12345, last], windows):
        assert _decode(window, chars) == text[start : start + 33]
        # The model reads window[:-1]; its targets window[1:] are the next characters.
        assert _decode(window[1:], chars) == text[start + 1 : start + 33]
    assert last + 33 == split_at  # the last training target is the last training character


def test_evaluation_predicts_every_validation_character_exactly_once():
    source = shakespeare.load(_config(), "validation")
    chars, text, split_at = source.info["vocabulary"], shakespeare.text(), shakespeare.boundary()
    predicted, context = [], []
    for example in source.evals.make().as_numpy_iterator():
        count = int(example["weight"])
        context.append(chars[example["tokens"][0]])
        predicted.append(_decode(example["tokens"][1 : 1 + count], chars))
    assert "".join(predicted) == text[split_at:]  # in order, none twice, none left out
    assert sum(len(p) for p in predicted) == len(text) - split_at == 111_540
    assert source.evals.examples == math.ceil(111_540 / 32) == 3486
    # Each window's first token is context only: the last training character before the first window.
    assert "".join(context) == text[split_at - 1 : len(text) - 1 : 32]


def test_evaluation_weighs_each_real_target_position_once_and_padding_not_at_all():
    """The per-position weights the metrics use, window by window of the evaluation batches: 1 on a real target, 0
    on the padded end of the last window and on the weight-0 windows that fill the last batch."""

    loaded = inputs.run_data(_config(eval_batch_size=512))
    targets = len(shakespeare.text()) - shakespeare.boundary()
    weights = np.concatenate(
        [loaded.task.target_weights(batch).numpy() for batch in loaded.eval_fn(tf.distribute.InputContext())]
    )
    assert weights.shape == (7 * 512, 32) and set(np.unique(weights)) == {0.0, 1.0}
    assert weights.sum() == targets == 111_540  # every validation character once
    windows = loaded.eval_examples
    assert windows == 3486 and (weights[: windows - 1] == 1).all()
    last = targets - (windows - 1) * 32  # the last window's real targets: its first 20
    assert last == 20 and weights[windows - 1].tolist() == [1.0] * 20 + [0.0] * 12
    assert (weights[windows:] == 0).all()  # the padding windows
    # The metrics count those positions only: logits sure of each real target and of a wrong token on the padding.
    batch = next(iter(loaded.eval_fn(tf.distribute.InputContext()).skip(windows // 512)))
    row = (windows - 1) % 512
    targets = batch["tokens"][:, 1:]
    wrong = tf.where(loaded.task.target_weights(batch) > 0, targets, (targets + 1) % 65)
    metrics = loaded.task.metrics(10.0 * tf.one_hot(wrong, 65), batch)
    assert float(metrics["accuracy"][row]) == 1.0 and float(metrics["loss"][row]) < 1e-2


def test_test_split_is_the_validation_text_and_other_splits_are_refused():
    config = _config()
    validation = shakespeare.load(config, "validation").evals.fetch(tf.range(3486, dtype=tf.int64))
    test = shakespeare.load(config, "test").evals.fetch(tf.range(3486, dtype=tf.int64))
    np.testing.assert_array_equal(validation["tokens"], test["tokens"])
    with pytest.raises(ConfigError, match=r"^--eval_split=train: not a split of shakespeare"):
        shakespeare.load(config, "train")


def test_heads_that_do_not_divide_the_width_are_refused_by_name():
    from engine.run.create import create_model

    with pytest.raises(ConfigError, match=r"^--gpt_heads=3: must divide --gpt_dim=32$"):
        create_model(_config(gpt_heads=3), "gpt", tf.TensorSpec([32], tf.int32), 65)


def test_real_numbers_for_token_ids_are_refused_by_name():
    # --task=regression --model=gpt read the penguins' measurements as token ids, truncated, and the run stopped
    # blaming tasks/regression.py ("its loss has shape [128, 128], not one value per example").
    from engine.run.create import create_model

    with pytest.raises(ConfigError) as refused:
        create_model(_config(), "gpt", tf.TensorSpec([4], tf.float32), 1)
    assert str(refused.value) == "--model=gpt: gpt reads integer token ids, got float32 values of shape (4,)"


def test_a_model_of_one_prediction_per_window_is_refused_naming_it():
    # --model=mlp trained nothing: the loss's shapes did not meet, a Keras ValueError from the task's own line.
    from engine.run.create import Create
    from tasks import language_model

    def models(config):
        info = {"vocabulary": tuple(chr(c) for c in range(65))}
        task = language_model.Task(config, {"tokens": tf.TensorSpec([33], tf.int64)}, info)
        task.spec = {"tokens": tf.TensorSpec([33], tf.int32)}  # the prepared example's, as the engine sets it
        return task.models(Create(config, info))

    with pytest.raises(ConfigError) as refused:
        models(_config(model="mlp", hidden_sizes=(8,)))
    assert str(refused.value) == (
        "--model=mlp: its output for a window of 32 tokens is of shape (1, 65); --task=language_model predicts at "
        "every position, [1, 32, 65] (a model of one prediction per token: --model=gpt)"
    )
    assert models(_config())["model"](tf.zeros([2, 32], tf.int32)).shape == (2, 32, 65)  # gpt: one per token


# ---- Training, sampling --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from engine.run import loop

    workdir = str(tmp_path_factory.mktemp("language_model"))
    return workdir, loop.train(_config(workdir=workdir, strategy="one_device"))


@pytest.mark.slow
def test_short_run_learns_below_the_bound_in_nats_and_bits(trained):
    _, result = trained
    results = result["eval"]
    assert results["examples"] == 111_540  # characters, each predicted once
    # Uniform guessing is ln 65 = 4.17 nats; this run measured loss 2.539 and accuracy 0.283 (seed 0).
    assert results["loss"] < 2.75
    assert results["accuracy"] > 0.25
    assert results["bits_per_character"] == pytest.approx(results["loss"] / math.log(2), rel=1e-12)


def test_sample_rebuilds_the_run_from_a_bare_command_line_with_its_own_seed():
    from engine.settings.config import for_evaluation, validate
    from engine.settings.fields import Config

    trained = validate(Config(task="language_model", model="gpt", seed=0))
    # `--mode=sample --workdir=W --seed=5`: the task, model and dataset come from the run; the seed draws.
    config = for_evaluation(validate(Config(mode="sample", seed=5)), trained, "W")
    assert (config.task, config.model, config.dataset, config.seed) == ("language_model", "gpt", "shakespeare", 5)


def test_sample_prints_the_prompt_and_sample_length_characters_of_the_vocabulary(trained):
    from engine.run import modes as evaluate

    workdir, _ = trained
    chars = shakespeare.vocabulary()
    process = helpers.launch(
        "--mode=sample", f"--workdir={workdir}", "--sample_length=200", "--sample_prompt=ROMEO:", "--seed=3"
    )
    assert process.returncode == 0, process.stderr[-2000:]
    text, note = process.stdout.rsplit("\n(sampled ", 1)  # print() ends the text with a newline
    assert note.startswith("200 tokens from step 150")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 200
    assert set(text) <= set(chars)
    # The same seed draws the same text in another process; another seed, another text.
    config = _config(workdir=workdir, mode="sample", sample_length=200, sample_prompt="ROMEO:", seed=3)
    assert evaluate.sample(config) == text
    assert evaluate.sample(dataclasses.replace(config, seed=4)) != text
    # From the likeliest token only, the draw is the argmax whatever the seed.
    greedy = dataclasses.replace(config, sample_top_k=1, sample_length=50)
    assert evaluate.sample(greedy) == evaluate.sample(dataclasses.replace(greedy, seed=4))


def test_sample_and_export_build_the_models_and_their_state_alone(trained, tmp_path, monkeypatch):
    # What these modes never use is never built: no optimizer, train program, evaluator or XLA choice.
    from engine.run import build
    from engine.run import modes as evaluate

    def built(what):
        def refuse(*args, **kwargs):
            raise AssertionError(f"{what} was built")

        return refuse

    monkeypatch.setattr(build, "Evaluator", built("an evaluator"))
    monkeypatch.setattr(build, "TrainProgram", built("a train program"))
    monkeypatch.setattr(build.updates, "build_plans", built("an optimizer"))
    monkeypatch.setattr(build.xla, "resolve", built("an XLA choice"))
    workdir, _ = trained
    config = _config(workdir=workdir, mode="sample", sample_length=20, sample_prompt="ROMEO:", seed=3)
    assert len(evaluate.sample(config)) == len("ROMEO:") + 20
    export_dir = str(tmp_path / "export")
    assert evaluate.export(dataclasses.replace(config, mode="export", seed=0, export_dir=export_dir)) == export_dir
    assert tf.io.gfile.exists(os.path.join(export_dir, "saved_model.pb"))


def test_the_export_continues_a_prompt_of_any_length_and_holds_the_vocabulary(trained, tmp_path):
    # Before: its signature took exactly a window of tokens, and held no vocabulary to map characters to them.
    from engine.run import modes as evaluate

    workdir, _ = trained
    config = _config(workdir=workdir, mode="export", seed=0, export_dir=str(tmp_path / "export"))
    loaded = tf.saved_model.load(evaluate.export(config))
    chars = shakespeare.vocabulary()
    assert "".join(v.decode() for v in loaded.class_names.numpy()) == chars
    serve = loaded.signatures["serving_default"]
    window = TINY["sequence_length"]
    text = shakespeare.text()[: window + 7]
    tokens = tf.constant([[chars.index(c) for c in text]], tf.int32)
    # A prompt longer than the window: its last window of tokens, as before.
    np.testing.assert_array_equal(serve(tokens=tokens)["logits"], serve(tokens=tokens[:, -window:])["logits"])
    # A short prompt: the character the likeliest-only sample draws after it.
    greedy = dataclasses.replace(config, mode="sample", sample_prompt="ROMEO:", sample_length=1, sample_top_k=1)
    prompt = tf.constant([[chars.index(c) for c in "ROMEO:"]], tf.int32)
    assert evaluate.sample(greedy) == "ROMEO:" + chars[int(tf.argmax(serve(tokens=prompt)["logits"][0]))]


def test_the_export_refuses_token_ids_outside_the_vocabulary_an_empty_prompt_and_a_flat_one(trained, tmp_path):
    # Before: -1 was read as the last character ('z') and answered; 65 ended in a graph error naming a gather node
    # (on a GPU, zeros and an answer); no token at all answered the logits after a window of padding.
    from engine.run import modes as evaluate

    workdir, _ = trained
    config = _config(workdir=workdir, mode="export", seed=0, export_dir=str(tmp_path / "export"))
    serve = tf.saved_model.load(evaluate.export(config)).signatures["serving_default"]
    assert serve(tokens=tf.constant([[0, 64]], tf.int32))["logits"].shape == (1, 65)  # the vocabulary's ends
    for tokens, says in [
        ([[1, 2, -1]], "tokens: ids must be in [0, 65) (the vocabulary); got min and max] [-1] [2]"),
        ([[1, 2, 65]], "tokens: ids must be in [0, 65) (the vocabulary); got min and max] [1] [65]"),
        ([[1000]], "tokens: ids must be in [0, 65) (the vocabulary); got min and max] [1000] [1000]"),
        (np.zeros((2, 0), np.int32), "tokens: every prompt needs at least one token; got shape] [2 0]"),
        # Before: "slice index 1 of dimension 0 out of bounds", from a node of the graph.
        ([1, 2, 3], "Shape of tensor tokens [3] is not compatible with expected shape [?,?]"),
    ]:
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(says)):
            serve(tokens=tf.constant(tokens, tf.int32))


def test_sample_refuses_a_prompt_with_characters_outside_the_vocabulary(trained):
    workdir, _ = trained
    process = helpers.launch("--mode=sample", f"--workdir={workdir}", "--sample_prompt=Ro\u00e9meo\u2014")
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        "error: --sample_prompt='Ro\u00e9meo\u2014': characters not in the vocabulary: '\u00e9' '\u2014'"
    ]


# ---- Replicas ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mirrored_matches_one_device(one_device, mirrored):
    config = _config(global_batch_size=8, train_steps=5, steps_per_loop=5, warmup_steps=0)
    reference, reference_out = helpers.train_and_snapshot(config, one_device)
    snap, out = helpers.train_and_snapshot(config, mirrored)
    for copies in snap.values():
        np.testing.assert_array_equal(copies[0], copies[1])
    assert _max_difference({k: v[0] for k, v in snap.items()}, {k: v[0] for k, v in reference.items()}) < TOLERANCE
    assert out["loss"] == pytest.approx(reference_out["loss"], rel=TOLERANCE)


def test_the_task_alone_picks_its_model_and_dataset():
    """`--task=language_model` alone trains the causal decoder on Shakespeare: an MLP's one prediction per window
    would not fit the task's per-position targets."""
    from engine.settings.config import validate
    from engine.settings.fields import Config

    config = validate(Config(task="language_model"))
    assert (config.model, config.dataset) == ("gpt", "shakespeare")
    assert validate(Config()).model == "mlp"


def test_a_sample_longer_than_memory_holds_is_refused_naming_the_flag():
    # A hundred billion tokens asked for 373 GiB and ended in a MemoryError.
    from engine.settings.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--sample_length=100000000000: must be in \[1, 1000000\]"):
        helpers.make_config("", task="language_model", sample_length=100_000_000_000)


@pytest.mark.parametrize("temperature", [1e-45, 1e300])
def test_a_temperature_float32_cannot_divide_by_is_refused_naming_the_flag(temperature):
    # Divided by 1e-45, float32 logits overflowed and became NaN, and the draw a traceback ("indices[0,1] = 65 is not
    # in [0, 65)"); 1e300 overflowed to infinity with numpy's RuntimeWarning.
    from engine.settings.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        helpers.make_config("", task="language_model", sample_temperature=temperature)
    assert str(refused.value) == f"--sample_temperature={temperature:g}: must be in [1e-06, 1000000.0]"
