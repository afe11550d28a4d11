"""Ensembles of trained runs on digits: weights fitted on validation only, never worse there than the best
member, reported on test; the geometric mean of probabilities; a file of another model's predictions as a
member; members that cannot be averaged, and tasks whose outputs cannot be, are refused."""

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from engine.run import inputs, loop
from engine.settings.errors import ConfigError
from engine.state import lock
from research import checks, ensemble, ensemble_weights, tune
from tasks import classification
from tests import helpers

# Three different models, trained briefly so that they disagree on some validation digits.
MEMBERS = {
    "mlp": dict(model="mlp", hidden_sizes=(32,), train_steps=40, learning_rate=3e-3),
    "resnet": dict(model="resnet", optimizer="sgd", learning_rate=0.05, train_steps=40),
    "transformer": dict(
        model="transformer",
        transformer_layers=1,
        transformer_dim=16,
        transformer_heads=2,
        transformer_mlp_dim=32,
        learning_rate=5e-3,
    ),
}


def train_member(data_dir, strategy, workdir, **overrides):
    # Evaluated on validation, so each member's own summary is a number the ensemble must reproduce.
    config = helpers.make_config(data_dir, str(workdir), eval_split="validation", **{"train_steps": 60, **overrides})
    return loop.train(config, strategy)


@pytest.fixture(scope="module")
def members(data_dir, one_device, tmp_path_factory):
    root = tmp_path_factory.mktemp("members")
    summaries = {name: train_member(data_dir, one_device, root / name, **cfg) for name, cfg in MEMBERS.items()}
    return {name: str(root / name) for name in MEMBERS}, summaries


def ensemble_config(data_dir, workdir, members, **overrides):
    config = helpers.make_config(data_dir, str(workdir), mode="ensemble", members=",".join(members), **overrides)
    checks.check(config)  # research's own checks, as launch.py and ensemble() run them
    return config


@pytest.mark.slow
@pytest.mark.parametrize("search", ["nelder_mead", "random"])
def test_weighted_ensemble_is_never_worse_on_validation_than_its_best_member(
    data_dir, members, tmp_path, capsys, search
):
    workdirs, own = members
    summary = ensemble.ensemble(ensemble_config(data_dir, tmp_path, workdirs.values(), ensemble_search=search))
    scored = {m["model"]: m for m in summary["members"]}
    for name, member in scored.items():
        # The ensemble's restore and forward pass give each member's own evaluation back.
        assert member["validation"]["accuracy"] == pytest.approx(own[name]["eval"]["accuracy"], abs=1e-6)
        assert member["validation"]["loss"] == pytest.approx(own[name]["eval"]["loss"], rel=1e-4)
        assert member["step"] == own[name]["step"]
    accuracies = [m["validation"]["accuracy"] for m in summary["members"]]
    assert len(set(accuracies)) > 1  # the members really differ
    weighted, fitted = summary["weighted"], summary["fitted"]
    assert weighted["validation"]["accuracy"] >= max(accuracies)
    assert weighted["validation"]["accuracy"] >= summary["average"]["validation"]["accuracy"]
    for weights in (weighted["weights"], fitted["weights"]):
        assert min(weights) >= 0 and sum(weights) == pytest.approx(1.0, abs=1e-9)
    # The search itself ends at a validation cross-entropy no higher than the average's or any member's.
    assert fitted["validation"]["loss"] <= min(m["validation"]["loss"] for m in summary["members"]) + 1e-9
    assert fitted["validation"]["loss"] <= summary["average"]["validation"]["loss"] + 1e-9
    assert [m["weight"] for m in summary["members"]] == weighted["weights"]
    assert summary["validation_examples"] == 180 and summary["test_examples"] == 360
    assert all(m["test"]["examples"] == 360 for m in summary["members"])

    printed = capsys.readouterr().out
    assert "average" in printed and f"weighted ({weighted['chosen']})" in printed
    assert f"{weighted['test']['accuracy']:.4f}" in printed
    assert json.loads((tmp_path / "summary.json").read_text())["weighted"] == weighted
    png = (tmp_path / "ensemble_report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow
def test_a_mixed_precision_member_scores_as_its_own_evaluation(data_dir, one_device, members, tmp_path):
    # Before: members predicted without XLA where their own evaluation compiled with it (--jit_compile=auto on a
    # CPU): a mixed_bfloat16 trial of a study scored 0.8611 validation accuracy beside the 0.8556 its run reported.
    workdirs, _ = members
    bf16 = dict(precision="mixed_bfloat16", hidden_sizes=(64, 64), global_batch_size=128, learning_rate=2e-3)
    own = train_member(data_dir, one_device, tmp_path / "bf16", train_steps=40, **helpers.XLA_CASE, **bf16)
    summary = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "ens", [workdirs["mlp"], str(tmp_path / "bf16")]))
    member = summary["members"][1]
    assert member["validation"]["accuracy"] == pytest.approx(own["eval"]["accuracy"], abs=1e-6)
    assert member["validation"]["loss"] == pytest.approx(own["eval"]["loss"], rel=1e-5)


@pytest.mark.slow
def test_test_data_never_touches_the_weights(data_dir, members, tmp_path):
    workdirs, _ = members
    on_test = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "a", workdirs.values()))
    on_train = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "b", workdirs.values(), eval_split="train"))
    assert on_test["test_examples"] == 360 and on_train["test_examples"] == 1257
    assert on_test["weighted"]["weights"] == on_train["weighted"]["weights"]
    assert on_test["fitted"] == on_train["fitted"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "other,message",
    [
        (
            dict(synthetic_shape=(8, 8, 1), synthetic_classes=5),
            r"synthetic 8,8,1 with 5 classes\) predicts 5 classes but .*/mlp \(digits\) predicts 10 classes: "
            "an ensemble's members must share one label space",
        ),
        (
            dict(synthetic_shape=(4, 4, 1), synthetic_classes=10),
            r"takes image float32 \(4, 4, 1\) but .*/mlp \(digits\) takes image float32 \(8, 8, 1\): "
            "an ensemble's members must share one input space",
        ),
        (
            dict(synthetic_shape=(8, 8, 1), synthetic_classes=10),
            r"sees other validation examples than .*/mlp \(digits\)",
        ),
    ],
    ids=["label_space", "input_shape", "other_examples"],
)
def test_members_that_cannot_be_averaged_are_refused(data_dir, one_device, members, tmp_path, other, message):
    workdirs, _ = members
    stranger = tmp_path / "stranger"
    train_member(data_dir, one_device, stranger, dataset="synthetic", train_steps=10, **other)
    workdir = tmp_path / "ensemble"
    with pytest.raises(ConfigError, match=message):
        ensemble.ensemble(ensemble_config(data_dir, workdir, [workdirs["mlp"], str(stranger)]))
    assert not workdir.exists()  # refused before anything was written


def test_launch_refuses_mismatched_members_in_one_line(data_dir, one_device, members, tmp_path):
    workdirs, _ = members
    stranger = tmp_path / "stranger"
    train_member(data_dir, one_device, stranger, dataset="synthetic", synthetic_shape=(8, 8, 1), synthetic_classes=3)
    proc = helpers.launch(
        "--mode=ensemble",
        f"--members={workdirs['mlp']},{stranger}",
        f"--workdir={tmp_path / 'ensemble'}",
        f"--data_dir={data_dir}",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --members: {stranger} (synthetic 8,8,1 with 3")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flag", ["--hidden_sizes=64", "--dataset=digits", "--learning_rate=0.1", "--strategy=mirrored", "--tune_trials=3"]
)
def test_launch_refuses_a_flag_of_a_members_model_or_data_which_would_change_nothing(tmp_path, flag):
    # Each member is rebuilt from its own config.json: --hidden_sizes=64 ran the ensemble of the members as they
    # trained, exit 0, as if it had been read. Refused before anything is read or written.
    members = f"--members={tmp_path / 'a'},{tmp_path / 'b'}"
    proc = helpers.launch("--mode=ensemble", members, f"--workdir={tmp_path / 'ensemble'}", flag)
    assert proc.returncode == 2, proc.stderr
    identity = flag.split("=")[0] in ("--hidden_sizes", "--dataset", "--learning_rate")
    why = (
        "rebuilds each member as it trained, from the config.json in its workdir"
        if identity
        else "predicts each member in this process, on one device, with the member's own settings"
    )
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: {flag}: --mode=ensemble {why}, which no flag changes; drop the flag"
    )
    assert not (tmp_path / "ensemble").exists()
    # What the ensemble reads of the command line goes on: the members are read (here: there are none).
    proc = helpers.launch("--mode=ensemble", members, f"--workdir={tmp_path / 'ensemble'}", "--seed=3")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: --members: {tmp_path / 'a'} has no config.json (not a train run's workdir?)"
    )


def top_files(workdir):
    """{name: bytes} of the files directly in `workdir`."""
    found = {}
    for entry in os.scandir(workdir):
        if entry.is_file():
            with open(entry.path, "rb") as f:
                found[entry.name] = f.read()
    return found


def test_a_train_run_and_a_tuner_refuse_an_ensembles_workdir(data_dir, members, tmp_path, one_device):
    # An ensemble's workdir holds its summary.json and predictions, and no config.json or study.json: a train run
    # or a study there would replace its summary.json.
    workdirs, _ = members
    workdir = str(tmp_path / "ensemble")
    ensemble.ensemble(ensemble_config(data_dir, workdir, [workdirs["mlp"], workdirs["resnet"]]))
    before = top_files(workdir)
    summary = f"{workdir}/summary.json"
    with pytest.raises(ConfigError) as refused:
        loop.train(helpers.make_config(data_dir, workdir, train_steps=2), one_device)
    assert str(refused.value) == (
        f"--workdir={workdir} holds another job's results ({summary}, and no config.json of a train run): a train "
        "run needs a --workdir of its own"
    )
    space = tmp_path / "rate.space"
    space.write_text("learning_rate  log  1e-4  0.3\n")
    config = helpers.make_config(
        data_dir, workdir, mode="tune", tune_trials=1, tune_pruner="none", tune_space=str(space)
    )
    with pytest.raises(ConfigError) as refused:
        tune.tune(config, one_device)
    assert str(refused.value) == (
        f"--workdir={workdir} holds another job's results ({summary}, and no study.json of a study): a study needs "
        "a --workdir of its own"
    )
    assert top_files(workdir) == before  # its summary.json and predictions as they were, nothing added


def test_an_ensemble_refuses_a_workdir_that_holds_a_run_a_study_or_a_lock(data_dir, members, tmp_path):
    workdirs, _ = members
    names = [workdirs["mlp"], workdirs["resnet"]]
    study = tmp_path / "study"
    study.mkdir()
    (study / "study.json").write_text('{"study": "tune"}\n')
    old = tmp_path / "old"  # a train run's from before config.json: its checkpoints alone
    shutil.copytree(os.path.join(workdirs["mlp"], "checkpoints"), old / "checkpoints")
    for workdir, holds, marker in [
        (workdirs["mlp"], "a train run", "config.json"),  # a member's own workdir
        (str(study), "a tuning study", "study.json"),
        (str(old), "a train run", "checkpoints"),
    ]:
        before = top_files(workdir)
        with pytest.raises(ConfigError) as refused:
            ensemble.ensemble(ensemble_config(data_dir, workdir, names))
        assert str(refused.value) == (
            f"--workdir={workdir} holds {holds} ({workdir}/{marker}): an ensemble needs a --workdir of its own"
        )
        assert top_files(workdir) == before  # its summary.json and the rest as they were, nothing added
    # A run that holds the lock and has written nothing yet: the ensemble writes nothing beside it.
    busy = str(tmp_path / "busy")
    training = f"--workdir={busy}: another run is training here: pid {os.getpid()} on host "
    with lock.Lock(busy), pytest.raises(ConfigError, match="^" + re.escape(training)):
        ensemble.ensemble(ensemble_config(data_dir, busy, names))
    assert os.listdir(busy) == []


def test_member_config_round_trips_through_config_json(members, data_dir):
    workdirs, _ = members
    config = ensemble.read_config(workdirs["transformer"])
    expected = helpers.make_config(
        data_dir, workdirs["transformer"], eval_split="validation", train_steps=60, **MEMBERS["transformer"]
    )
    assert config == expected
    assert dataclasses.asdict(config)["hidden_sizes"] == (32, 32)


def test_ensemble_needs_two_members_and_a_split_other_than_test(data_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="--members=runs/a: --mode=ensemble needs at least two"):
        ensemble_config(data_dir, tmp_path, ["runs/a"])
    # Before: a "two-member" ensemble of one model with itself.
    with pytest.raises(ConfigError, match="^--members=runs/a,runs/b,runs/a: names runs/a twice: an ensemble of one"):
        ensemble_config(data_dir, tmp_path, ["runs/a", "runs/b", "runs/a"])
    # And one spelled two ways (before: an ensemble of one model with itself, at weights 0.5 and 0.5).
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    for other in ("runs/a/", "./runs/a", f"{tmp_path}/link/a"):
        with pytest.raises(ConfigError) as refused:
            ensemble_config(data_dir, tmp_path, [f"{tmp_path}/runs/a", other])
        assert str(refused.value) == (
            f"--members={tmp_path}/runs/a,{other}: names {tmp_path}/runs/a (as {other} too) twice: an ensemble of "
            "one model with itself"
        )
    assert checks.members(ensemble_config(data_dir, tmp_path, ["gs://b/a", "gs://b/ab"])) == ["gs://b/a", "gs://b/ab"]
    with pytest.raises(ConfigError, match="--validation_split=test: .* never look at the test split"):
        ensemble_config(data_dir, tmp_path, ["a", "b"], validation_split="test")
    with pytest.raises(ConfigError, match="--members: .*nowhere has no config.json"):
        ensemble.ensemble(ensemble_config(data_dir, tmp_path, [str(tmp_path / "nowhere"), str(tmp_path)]))


def test_fit_weights_prefers_the_better_member_on_a_made_up_case():
    """Member 0 is right on every example, member 1 on half: the weights must lean on member 0."""
    labels = np.array([0, 1] * 50)
    right = np.eye(2)[labels] * 0.8 + 0.1
    half = np.where(np.arange(100)[:, None] % 4 < 2, right, right[:, ::-1])
    config = helpers.make_config("", mode="ensemble", members="a,b")
    task = classification.Task(config, {}, {"num_classes": 2})
    weights, chosen, fitted = ensemble_weights.fit_weights([right, half], {"label": labels}, task, config)
    combined = ensemble_weights.combine([right, half], weights)
    assert np.mean(task.score(combined, {"label": labels})["accuracy"]) == 1.0
    assert fitted[0] > 0.9 and chosen in ("nelder_mead", "member 0 alone")


def geometric_mean(probabilities, weights):
    """The weighted geometric mean of probabilities, renormalized: numpy, in the plainest form."""
    product = np.prod([p**w for p, w in zip(probabilities, weights)], axis=0)
    return product / product.sum(axis=1, keepdims=True)


def test_geometric_mean_of_probabilities_matches_numpy():
    rng = np.random.default_rng(0)
    members = [rng.dirichlet(np.ones(5), size=7) for _ in range(3)]
    for weights in ([1 / 3] * 3, [0.2, 0.5, 0.3], [1.0, 0.0, 0.0]):
        np.testing.assert_allclose(
            ensemble_weights.combine(members, weights, "geometric"), geometric_mean(members, weights), rtol=1e-12
        )
    np.testing.assert_allclose(
        ensemble_weights.combine(members, [0.2, 0.5, 0.3]), 0.2 * members[0] + 0.5 * members[1] + 0.3 * members[2]
    )
    # A member sure that a class is impossible vetoes it (weight > 0), and is ignored at weight 0.
    certain = np.array([[0.0, 1.0], [0.5, 0.5]])
    other = np.array([[0.9, 0.1], [0.2, 0.8]])
    vetoed = ensemble_weights.combine([certain, other], [0.5, 0.5], "geometric")[0]
    np.testing.assert_allclose(vetoed, [0.0, 1.0], atol=1e-150)  # 0 is clipped at float64's tiny, ** 0.5
    np.testing.assert_allclose(ensemble_weights.combine([certain, other], [0.0, 1.0], "geometric"), other)


def write_centroid_member(data_dir, path, splits=("validation", "test"), shuffle_seed=0):
    """Another kind of model, written as an ensemble member: nearest class centroids of the digits' pixels (numpy
    only), its probabilities a softmax of the negative squared distances. The rows are written shuffled, with
    each example's position in the split (the evaluation batches' `index`), as a model outside the engine might."""

    def examples(split):
        batches = inputs.run_data(helpers.make_config(data_dir), split).eval_fn(tf.distribute.InputContext())
        real = [{k: v.numpy()[b["weight"].numpy() > 0] for k, v in b.items()} for b in batches]
        return {k: np.concatenate([b[k] for b in real]) for k in ("image", "label", "index")}

    train = examples("train")
    pixels = train["image"].reshape(len(train["image"]), -1)
    centroids = np.stack([pixels[train["label"] == c].mean(axis=0) for c in range(10)])
    arrays = {}
    for split in splits:
        held = examples(split)
        distances = ((held["image"].reshape(len(held["image"]), 1, -1) - centroids) ** 2).sum(axis=-1)
        logits = -distances / 0.5
        probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        order = np.random.default_rng(shuffle_seed).permutation(len(probabilities))
        arrays[split], arrays[f"{split}_index"] = probabilities[order], held["index"][order]
    np.savez(path, **arrays)
    return arrays


def in_split_order(arrays, split):
    order = np.argsort(arrays[f"{split}_index"])
    return arrays[split][order]


@pytest.fixture(scope="module")
def centroids(data_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("centroids") / "centroids.npz"
    return str(path), write_centroid_member(data_dir, path)


def test_a_file_of_another_models_predictions_joins_two_nets_in_a_geometric_mean(
    data_dir, members, centroids, tmp_path
):
    workdirs, own = members
    path, centroids = centroids
    names = [workdirs["mlp"], workdirs["resnet"], path]
    config = ensemble_config(data_dir, tmp_path / "ensemble", names, ensemble_mean="geometric")
    summary = ensemble.ensemble(config)
    assert summary["mean"] == "geometric" and summary["combines"] == "probabilities"
    file_member = summary["members"][2]
    assert (file_member["name"], file_member["model"], file_member["step"]) == (names[2], "predictions", None)
    # The file's rows were shuffled: scored in the split's order, they give the centroids' own numbers.
    splits = {"validation": "validation", "test": "test"}
    labels = {}
    for key, split in splits.items():
        reference = inputs.run_data(helpers.make_config(data_dir), split).eval_fn(tf.distribute.InputContext())
        labels[key] = np.concatenate([b["label"].numpy()[b["weight"].numpy() > 0] for b in reference])
        probabilities = in_split_order(centroids, split)
        accuracy = np.mean(np.argmax(probabilities, axis=1) == labels[key])
        assert file_member[key]["accuracy"] == pytest.approx(accuracy, abs=1e-12)
        assert file_member[key]["examples"] == len(labels[key])
    assert 0.8 < file_member["validation"]["accuracy"] < 1.0
    assert summary["members"][0]["validation"]["accuracy"] == pytest.approx(own["mlp"]["eval"]["accuracy"], abs=1e-6)
    # The plain and the weighted geometric means, against numpy on each member's probabilities as written to
    # predictions.npz (in the split's order; the file member's rows put back in it).
    written = np.load(tmp_path / "ensemble" / "predictions.npz")
    np.testing.assert_array_equal(written["member2_validation"], in_split_order(centroids, "validation"))
    np.testing.assert_array_equal(written["validation_index"], np.arange(180))
    for split in ("validation", "test"):
        probabilities = [written[f"member{i}_{split}"] for i in range(3)]
        for row in ("average", "weighted"):
            combined = geometric_mean(probabilities, summary[row]["weights"])
            picked = combined[np.arange(len(labels[split])), labels[split]]
            assert summary[row][split]["loss"] == pytest.approx(-np.mean(np.log(picked)), rel=1e-12)
            accuracy = np.mean(np.argmax(combined, axis=1) == labels[split])
            assert summary[row][split]["accuracy"] == pytest.approx(accuracy, abs=1e-12)
        # The weighted ensemble's own predictions, a member file for another ensemble.
        np.testing.assert_allclose(written[split], geometric_mean(probabilities, summary["weighted"]["weights"]))
    best = max(m["validation"]["accuracy"] for m in summary["members"])
    assert summary["weighted"]["validation"]["accuracy"] >= best


def test_a_predictions_file_of_other_examples_is_refused_naming_it(members, centroids, tmp_path):
    workdirs, _ = members
    _, good = centroids
    cases = {
        "short.npz": (
            {**good, "test": good["test"][:-1], "test_index": good["test_index"][:-1]},
            r"short.npz holds 359 test predictions but .*/mlp sees 360 examples: an ensemble's members must "
            "predict the same examples",
        ),
        "shifted.npz": (
            {**good, "validation_index": good["validation_index"] + 1},
            r"shifted.npz: 'validation_index' names other validation examples than .*/mlp sees \(positions 1 where "
            r"0 was expected\)",
        ),
        "untested.npz": (
            {k: v for k, v in good.items() if not k.startswith("test")},
            r"untested.npz has no array 'test' \(it must hold 'test' and 'test_index' for --eval_split=test; it has "
            r"validation, validation_index\)",
        ),
        "scores.npz": ({**good, "test": good["test"] * 2}, r"scores.npz: 'test' must hold probabilities"),
    }
    for name, (arrays, message) in cases.items():
        np.savez(tmp_path / name, **arrays)
        workdir = tmp_path / f"ensemble_{name}"
        with pytest.raises(ConfigError, match=message):
            ensemble.ensemble(ensemble_config("", workdir, [workdirs["mlp"], str(tmp_path / name)]))
        assert not workdir.exists()  # refused before anything was written


def test_a_task_whose_outputs_cannot_be_averaged_is_refused(data_dir, members, tmp_path, monkeypatch):
    workdirs, _ = members
    config = ensemble_config(data_dir, tmp_path / "ensemble", workdirs.values())
    monkeypatch.setattr(classification.Task, "ensemble", None)
    with pytest.raises(ConfigError) as refused:
        ensemble.ensemble(config)
    assert str(refused.value) == (
        f"--members: {workdirs['mlp']} trains --task=classification, whose outputs an ensemble cannot average "
        "(its Task.ensemble is None)"
    )
    # A real one: next-token distributions of separately trained language models are not averaged.
    language_models = {f"runs/lm{i}": dataclasses.replace(config, task="language_model") for i in (0, 1)}
    with pytest.raises(ConfigError, match=r"^--members: runs/lm0 trains --task=language_model, whose outputs an "):
        ensemble._check_task(config, language_models)
    mixed = {workdirs["mlp"]: ensemble.read_config(workdirs["mlp"]), "runs/lm1": language_models["runs/lm1"]}
    with pytest.raises(ConfigError, match=r"runs/lm1 trains --task=language_model but .*/mlp trains --task=classif"):
        ensemble._check_task(config, mixed)
    monkeypatch.setattr(classification.Task, "ensemble", "values")
    with pytest.raises(ConfigError, match="--ensemble_mean=geometric: --task=classification averages values, not"):
        ensemble.ensemble(dataclasses.replace(config, ensemble_mean="geometric"))
    assert not (tmp_path / "ensemble").exists()


def test_members_are_scored_with_each_example_counted_by_its_weight():
    """A source's fractional weights: a member scored each example as 1 (test accuracy 0.9222 on 360 examples where
    its own run reported 0.9168 on 181.8), and the weights were fitted on the unweighted loss. An example of weight k
    counts as k copies; one of weight 0 (padding) is no example at all."""
    from research.ensemble_members import _predict

    config = helpers.make_config("", mode="ensemble", members="a,b")
    task = classification.Task(config, {}, {"num_classes": 2})
    rng = np.random.default_rng(0)
    probabilities = rng.dirichlet(np.ones(2), size=40)
    batch = {"label": tf.constant(rng.integers(0, 2, 40)), "weight": tf.constant(rng.integers(0, 4, 40), tf.float32)}
    predictions, examples = _predict(lambda batch: tf.constant(probabilities), [batch])
    copies = batch["weight"].numpy().astype(int)
    repeated = {"label": np.repeat(batch["label"].numpy(), copies)}
    weighted = ensemble_weights.scores(task, predictions, examples)
    assert weighted == pytest.approx(ensemble_weights.scores(task, np.repeat(probabilities, copies, 0), repeated))
    assert weighted["examples"] == copies.sum() == 60 and len(predictions) == 29  # 11 of weight 0 left out
    fractions = ensemble_weights.scores(task, predictions, {**examples, "weight": examples["weight"] * 0.3})
    assert fractions == pytest.approx({**weighted, "examples": 18})  # each counts 0.3 as much: the same means


def test_values_average_and_score_as_the_regression_task_reports():
    """--task=regression averages predicted values (arithmetic only) and reports RMSE in the target's units."""
    from tasks import regression

    config = helpers.make_config("", mode="ensemble", members="a,b", task="regression")
    info = {"feature_mean": [0.0], "feature_std": [1.0], "target_mean": 10.0, "target_std": 2.0}
    task = regression.Task(config, {}, info)
    target = np.array([8.0, 10.0, 13.0, 9.0])
    examples = {"target": (target - 10.0) / 2.0}  # as prepared: standardized
    high, low = target + 1.0, target - 3.0  # one member 1 too high, one 3 too low: 3:1 weights cancel them
    weights, chosen, fitted = ensemble_weights.fit_weights([high, low], examples, task, config)
    assert fitted == pytest.approx([0.75, 0.25], abs=1e-3) and chosen == "nelder_mead"
    assert ensemble_weights.scores(task, ensemble_weights.combine([high, low], [0.5, 0.5]), examples) == {
        "loss": 0.25,  # (1 / 2)^2: the standardized squared error
        "mse": 1.0,
        "mae": 1.0,
        "rmse": 1.0,
        "examples": 4,
    }


def test_an_ensemble_needs_scipy_only_for_its_nelder_mead_search():
    from engine.settings.fields import Config
    from research import tools

    assert tools(Config(mode="ensemble", ensemble_search="random")) == ("matplotlib.figure",)
    assert tools(Config(mode="ensemble")) == ("matplotlib.figure", "scipy.optimize")
    assert tools(Config(mode="tune")) == ("optuna", "matplotlib.figure")


class _NumpyReport:
    def score(self, predictions, batch):
        return {"accuracy": np.array([1.0, 0.0, 1.0, 1.0])}

    def report(self, means):
        return {**means, "error": np.float32(1.0) - np.float32(means["accuracy"])}


def test_an_ensembles_scores_report_numpy_scalars_as_numbers():
    # As an evaluation reports them: summary.json could not hold a numpy float32, after every member had predicted.
    from research.ensemble_weights import scores

    found = scores(_NumpyReport(), np.zeros((4, 2)), None)
    assert found == {"accuracy": 0.75, "error": 0.25, "examples": 4} and type(found["error"]) is float


def test_a_member_still_training_is_read_and_an_ensembles_workdir_keeps_to_its_own_members(
    data_dir, members, tmp_path, monkeypatch
):
    # Before: "--members: .../ckpt-2310 is unreadable (... Failed to find any matching files)", exit 2: the member's
    # run had rotated that checkpoint away (--keep_checkpoints) since it was listed.
    from engine.state import checkpoint as checkpoint_lib
    from research import ensemble_members

    workdirs, _ = members
    real, listed = checkpoint_lib.latest, []

    def rotated_once(directory):
        listed.append(directory)
        return os.path.join(directory, "ckpt-1") if len(listed) == 1 else real(directory)  # ckpt-1 is gone

    expected = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "a", workdirs.values()))
    # Its workdir, given other members: their summary.json would replace the first's (it did, exit 0).
    before = {name: (tmp_path / "a" / name).read_bytes() for name in os.listdir(tmp_path / "a")}
    others = [workdirs["mlp"], workdirs["transformer"]]
    with pytest.raises(ConfigError) as refused:
        ensemble.ensemble(ensemble_config(data_dir, tmp_path / "a", others))
    assert str(refused.value) == (
        f"--members={','.join(others)}: --workdir={tmp_path / 'a'} holds an ensemble of other members "
        f"({','.join(workdirs.values())}; {tmp_path / 'a' / 'summary.json'}), whose results this one's would replace; "
        "give it a --workdir of its own"
    )
    assert {name: (tmp_path / "a" / name).read_bytes() for name in os.listdir(tmp_path / "a")} == before
    # The same members are combined there again (their runs may have trained on), one listed checkpoint rotated away.
    monkeypatch.setattr(ensemble_members.checkpoint_lib, "latest", rotated_once)
    summary = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "a", workdirs.values()))
    assert listed[0] == listed[1] and summary["weighted"] == expected["weighted"]
    # A damaged one (its files are there) is still refused, naming it.
    newest = real(os.path.join(workdirs["mlp"], "checkpoints"))
    with open(newest + ".index", "rb") as f:
        index = f.read()
    listed.clear()
    monkeypatch.setattr(ensemble_members.checkpoint_lib, "latest", lambda directory: newest)
    try:
        with open(newest + ".index", "wb") as f:
            f.write(b"damaged")
        with pytest.raises(ConfigError, match=f"^--members: {re.escape(newest)} is unreadable"):
            ensemble.ensemble(ensemble_config(data_dir, tmp_path / "c", [workdirs["mlp"], workdirs["transformer"]]))
    finally:
        with open(newest + ".index", "wb") as f:
            f.write(index)
