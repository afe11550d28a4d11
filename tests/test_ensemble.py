"""Ensembles of trained runs on digits: weights fitted on validation only, never worse there than the best
member, reported on test; members that cannot be averaged are refused."""

import dataclasses
import json

import numpy as np
import pytest

from engine import ensemble, loop
from engine.config import ConfigError
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
    return helpers.make_config(data_dir, str(workdir), mode="ensemble", members=",".join(members), **overrides)


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


def test_test_data_never_touches_the_weights(data_dir, members, tmp_path):
    workdirs, _ = members
    on_test = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "a", workdirs.values()))
    on_train = ensemble.ensemble(ensemble_config(data_dir, tmp_path / "b", workdirs.values(), eval_split="train"))
    assert on_test["test_examples"] == 360 and on_train["test_examples"] == 1257
    assert on_test["weighted"]["weights"] == on_train["weighted"]["weights"]
    assert on_test["fitted"] == on_train["fitted"]


@pytest.mark.parametrize(
    "other,message",
    [
        (
            dict(synthetic_shape=(8, 8, 1), synthetic_classes=5),
            r"synthetic 8,8,1 with 5 classes\) predicts 5 classes but .*/mlp \(digits\) predicts 10: "
            "an ensemble's members must share one label space",
        ),
        (
            dict(synthetic_shape=(4, 4, 1), synthetic_classes=10),
            r"takes inputs of shape \(4, 4, 1\) but .*/mlp \(digits\) takes \(8, 8, 1\)",
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


def test_member_config_round_trips_through_config_json(members, data_dir):
    workdirs, _ = members
    config = ensemble.read_config(workdirs["transformer"])
    expected = helpers.make_config(
        data_dir, workdirs["transformer"], eval_split="validation", train_steps=60, **MEMBERS["transformer"]
    )
    assert config == expected
    assert dataclasses.asdict(config)["hidden_sizes"] == (32, 32)


def test_ensemble_needs_two_members_and_a_split_other_than_test(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="--members=runs/a: --mode=ensemble needs at least two"):
        ensemble_config(data_dir, tmp_path, ["runs/a"])
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
    weights, chosen, fitted = ensemble.fit_weights([right, half], labels, config)
    assert ensemble.score(ensemble.combine([right, half], weights), labels)["accuracy"] == 1.0
    assert fitted[0] > 0.9 and chosen in ("nelder_mead", "member 0 alone")
