"""Hyperparameter search on digits: it finds the good learning rates, a killed study resumes without running a
trial twice, pruning stops a hopeless trial early, and the best trial's flagfile reruns to the same numbers. The
objective is the task's own unless another is named, with its direction."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import optuna
import pytest

from engine import checkpoint
from engine.config import ConfigError
from research import tune
from tests import helpers
from tests.helpers import ROOT, launch

TUNE_DEFAULTS = dict(mode="tune", train_steps=60, eval_every=20, deterministic=True)
VALIDATION_EXAMPLES = 180


def write_space(tmp_path, text):
    path = tmp_path / "search.space"
    path.write_text(text)
    return str(path)


def tune_config(data_dir, workdir, space, **overrides):
    return helpers.make_config(data_dir, str(workdir), tune_space=space, **{**TUNE_DEFAULTS, **overrides})


def enqueue(workdir, *learning_rates, direction="maximize"):
    """Puts known trials first in the study the tuner will open (its default storage in the workdir)."""
    os.makedirs(workdir, exist_ok=True)
    study = optuna.create_study(
        storage=f"sqlite:///{os.path.abspath(os.path.join(workdir, 'study.db'))}",
        study_name="tune",
        direction=direction,
        load_if_exists=True,
    )
    for rate in learning_rates:
        study.enqueue_trial({"learning_rate": rate})


def load_study(workdir):
    return optuna.load_study(storage=f"sqlite:///{os.path.join(workdir, 'study.db')}", study_name="tune")


def read(path, name):
    with open(os.path.join(path, name)) as f:
        return f.read()


def logged_step(workdir):
    """The last step in metrics.jsonl while a run writes it (0 before the first line)."""
    try:
        return helpers.logged_steps(workdir)[-1]
    except (IndexError, ValueError):  # not there yet, empty, or a line half written
        return 0


@pytest.fixture(scope="module")
def study(data_dir, one_device, tmp_path_factory):
    """Six trials of TPE with Hyperband over the learning rate; trial 0 is a known-bad rate, 1e-5."""
    workdir = tmp_path_factory.mktemp("tune")
    space = write_space(workdir, "# the learning rate, log-uniform\nlearning_rate  log  1e-5  1e-1\n")
    config = tune_config(data_dir, workdir, space, tune_trials=6, tune_startup_trials=3)
    enqueue(workdir, 1e-5)
    return config, tune.tune(config, one_device)


@pytest.mark.slow
def test_search_finds_learning_rates_better_than_a_known_bad_one(study):
    config, summary = study
    records = {t["number"]: t for t in summary["all"]}
    bad, best = records[0], summary["best"]
    # The task's own objective: classification maximizes accuracy.
    assert (summary["task"], summary["objective"], summary["direction"]) == ("classification", "accuracy", "max")
    assert bad["params"] == {"learning_rate": 1e-5}
    assert summary["trials"] == 6 and summary["complete"] + summary["pruned"] == 6 and summary["failed"] == 0
    assert best["params"]["learning_rate"] > 1e-3
    assert best["value"] >= 0.8 and best["value"] > bad["value"] + 0.4, (best, bad)
    assert best["value"] == max(t["value"] for t in summary["all"] if t["state"] == "complete")
    # Tuning never looks at the test split: every evaluation of every trial counted the 180 validation examples.
    for record in summary["all"]:
        trial_dir = record["workdir"]
        assert json.loads(read(trial_dir, "config.json"))["eval_split"] == "validation"
        evals = [json.loads(line) for line in read(trial_dir, "eval.jsonl").splitlines()]
        assert evals and all(e["examples"] == VALIDATION_EXAMPLES for e in evals)
    on_disk = json.loads(read(config.workdir, "summary.json"))
    assert on_disk["best"] == summary["best"] and on_disk["trials"] == 6
    with open(os.path.join(config.workdir, "tune_report.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(os.path.join(config.workdir, "tune_report.png")) > 20_000  # four panels, not a blank


def test_best_flagfile_reruns_to_the_same_result(study, tmp_path):
    config, summary = study
    flagfile = summary["best"]["flagfile"]
    flags = read(config.workdir, "best.flags")
    assert f"--learning_rate={summary['best']['params']['learning_rate']!r}" in flags
    assert "--eval_split=validation" in flags and "--deterministic=true" in flags and "--seed=0" in flags
    proc = launch(f"--flagfile={flagfile}", f"--workdir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rerun = json.loads(read(tmp_path, "summary.json"))
    original = json.loads(read(summary["best"]["workdir"], "summary.json"))
    assert rerun["step"] == original["step"] == 60
    assert rerun["eval"] == original["eval"]  # bit-identical accuracy and loss
    assert rerun["eval"]["accuracy"] == summary["best"]["value"]


@pytest.mark.parametrize("pruner", ["median", "successive_halving"])
def test_pruning_stops_a_hopeless_trial_early(data_dir, one_device, tmp_path, pruner):
    space = write_space(tmp_path, "learning_rate log 1e-6 1e-1\n")
    config = tune_config(data_dir, tmp_path, space, tune_trials=2, tune_pruner=pruner, tune_startup_trials=1)
    enqueue(tmp_path, 3e-3, 1e-6)  # a good trial to compare with, then a hopeless one
    summary = tune.tune(config, one_device)
    good, hopeless = summary["all"]
    assert (good["state"], hopeless["state"]) == ("complete", "pruned")
    assert good["steps"] == 60 and helpers.logged_steps(good["workdir"]) == [10, 20, 30, 40, 50, 60]
    # Stopped at its first evaluation, step 20 of 60, and its workdir shows it.
    assert hopeless["steps"] == 20 and helpers.logged_steps(hopeless["workdir"]) == [10, 20]
    assert json.loads(read(hopeless["workdir"], "summary.json"))["step"] == 20
    assert checkpoint.list_checkpoints(os.path.join(hopeless["workdir"], "checkpoints"))[0].endswith("ckpt-20")
    assert hopeless["value"] < good["value"] - 0.2


@pytest.mark.slow
def test_killed_study_resumes_with_completed_trials_kept_and_none_run_twice(data_dir, tmp_path):
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\nhidden_sizes choice 16 32,32\n")
    workdir = tmp_path / "study"
    args = [
        sys.executable,
        "launch.py",
        "--mode=tune",
        f"--tune_space={space}",
        f"--workdir={workdir}",
        f"--data_dir={data_dir}",
        "--tune_trials=4",
        "--tune_sampler=random",
        "--tune_pruner=none",
        "--train_steps=200",
        "--steps_per_loop=10",
        "--checkpoint_every=20",
        "--global_batch_size=64",
        "--deterministic",
    ]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_trial = workdir / "trials" / "2"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if logged_step(killed_trial) >= 50:
            proc.kill()  # SIGKILL: no chance to tidy up; trial 2 is left RUNNING in the study
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -9, "the tuner ended before it could be killed inside trial 2"
    before = load_study(workdir).trials
    assert [t.state.name for t in before] == ["COMPLETE", "COMPLETE", "RUNNING"]
    kept = {n: read(workdir / "trials" / str(n), "metrics.jsonl") for n in (0, 1)}
    resume_from = int(os.path.basename(checkpoint.list_checkpoints(killed_trial / "checkpoints")[0]).split("-")[1])

    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"resumed from step {resume_from}" in out.stdout and resume_from >= 40
    after = load_study(workdir).trials
    assert [t.state.name for t in after] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    for old, new in zip(before[:2], after[:2]):  # completed trials kept as they were
        assert (new.value, new.params, new.datetime_complete) == (old.value, old.params, old.datetime_complete)
    assert after[3].user_attrs[tune.RESUMES] == 2 and after[3].params == before[2].params
    # No trial ran twice: the completed ones were not touched, the interrupted one continued in its own workdir.
    assert {n: read(workdir / "trials" / str(n), "metrics.jsonl") for n in (0, 1)} == kept
    assert sorted(os.listdir(workdir / "trials")) == ["0", "1", "2", "4"]
    assert helpers.logged_steps(killed_trial) == list(range(10, 201, 10))
    summary = json.loads(read(workdir, "summary.json"))
    assert (summary["trials"], summary["complete"], summary["failed"]) == (4, 4, 1)
    assert "tune: trial 2 was interrupted; requeued to resume in trials/2" in out.stdout


def test_time_budget_stops_starting_trials(data_dir, one_device, tmp_path):
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    config = tune_config(
        data_dir, tmp_path, space, tune_trials=5, tune_timeout=0.01, tune_objective="loss", tune_direction="min"
    )
    summary = tune.tune(config, one_device)
    assert summary["trials"] == 1  # the budget was gone after the first
    # Classification's loss instead of its accuracy, minimized as asked.
    assert (summary["objective"], summary["direction"]) == ("loss", "min")
    assert load_study(tmp_path).direction == optuna.study.StudyDirection.MINIMIZE
    assert summary["best"]["value"] == json.loads(read(summary["best"]["workdir"], "summary.json"))["eval"]["loss"]
    assert "add --eval_split=test (after the flagfile) for its held-out loss." in read(tmp_path, "best.flags")
    again = dataclasses.replace(config, tune_objective="accuracy")
    with pytest.raises(ConfigError, match="--tune_objective=accuracy: study 'tune' in .* was started with --tune_obj"):
        tune.tune(again, one_device)


def test_an_objective_is_refused_before_any_trial_without_its_direction_or_when_not_reported(
    data_dir, one_device, tmp_path
):
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    workdir = tmp_path / "study"
    config = tune_config(data_dir, workdir, space, tune_objective="loss")
    with pytest.raises(ConfigError) as refused:
        tune.tune(config, one_device)
    assert str(refused.value) == (
        "--tune_objective=loss: --task=classification's own objective is accuracy (max); for loss say which way "
        "is better with --tune_direction=max or min"
    )
    # The task's own objective named: its direction is the task's. Each task has its own.
    assert tune.objective_of(dataclasses.replace(config, tune_objective="accuracy")) == ("accuracy", "max")
    for task, objective in [("regression", ("rmse", "min")), ("language_model", ("loss", "min"))]:
        assert tune.objective_of(dataclasses.replace(config, task=task, tune_objective="")) == objective
    unreported = dataclasses.replace(config, tune_objective="rmse", tune_direction="min")
    with pytest.raises(ConfigError) as refused:
        tune.tune(unreported, one_device)
    assert str(refused.value) == (
        "--tune_objective=rmse: --task=classification reports no such metric (it reports accuracy, loss)"
    )
    assert not workdir.exists()  # no study, no trial


@pytest.mark.parametrize(
    "text,message",
    [
        ("learning_rte log 1e-4 1e-1\n", r"line 1 .*no flag --learning_rte"),
        ("eval_split choice test validation\n", r"--eval_split belongs to the tuner"),
        ("learning_rate log 0 1e-1\n", r"LOW > 0"),
        ("warmup_steps float 0 10\n", r"--warmup_steps takes a int: use int"),
        ("hidden_sizes choice 64 6x4\n", r"every value must be a tuple"),
        ("# only a comment\n", r"no searched flag"),
    ],
)
def test_bad_search_space_is_refused_naming_the_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        tune.parse_space(write_space(tmp_path, text))


def test_space_file_shipped_for_the_resnet_parses():
    space = tune.parse_space(os.path.join(ROOT, "experiments", "digits_resnet.space"))
    assert {p.name for p in space} == {"resnet_depth", "resnet_width", "learning_rate", "weight_decay", "warmup_steps"}


def test_tuning_refuses_the_test_split_and_pruning_without_evaluations(data_dir, tmp_path):
    space = write_space(tmp_path, "learning_rate log 1e-4 1e-1\n")
    with pytest.raises(ConfigError, match="--validation_split=test: tuning and ensemble fitting never look"):
        tune_config(data_dir, tmp_path, space, validation_split="test")
    with pytest.raises(ConfigError, match=r"--eval_every=0: --tune_pruner=hyperband judges trials"):
        tune_config(data_dir, tmp_path, space, eval_every=0)
