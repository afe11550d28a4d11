"""Hyperparameter search on digits: it finds the good learning rates, a killed study resumes without running a
trial twice, pruning stops a hopeless trial early, and the best trial's flagfile reruns to the same numbers. The
objective is the task's own unless another is named, with its direction, which the study keeps. A tuner and a train
run never share a workdir, and the storage's password is written and printed nowhere."""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import time
import warnings

import optuna
import pytest

from engine.run import loop
from engine.settings.errors import ConfigError, Preempted
from engine.state import checkpoint, lock
from research import checks, ensemble, tune, tune_study
from research.space import parse_space
from tests import forkserver, helpers
from tests.helpers import ROOT, launch

TUNE_DEFAULTS = dict(mode="tune", train_steps=60, eval_every=20, deterministic=True)
VALIDATION_EXAMPLES = 180
SECRET = "s3cret:p@ss"
SHARED_URL = f"postgresql://tuner:{SECRET}@db.example:5432/studies"  # a study several machines share
MASKED_URL = "postgresql://tuner:***@db.example:5432/studies"


def write_space(tmp_path, text):
    path = tmp_path / "search.space"
    path.write_text(text)
    return str(path)


def tune_config(data_dir, workdir, space, **overrides):
    config = helpers.make_config(data_dir, str(workdir), tune_space=space, **{**TUNE_DEFAULTS, **overrides})
    checks.check(config)  # research's own checks, as launch.py and tune() run them
    return config


def test_a_tuner_refuses_the_multi_worker_strategy_the_run_would_use(monkeypatch, data_dir, tmp_path):
    cluster = {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    with pytest.raises(ConfigError) as error:
        tune_config(data_dir, tmp_path, write_space(tmp_path, "learning_rate log 1e-3 1e-1\n"))
    assert str(error.value) == (
        "--strategy=: --mode=tune runs its trials in one process (one_device, mirrored or tpu), not with the "
        "multi_worker strategy (TF_CONFIG has a cluster): on several machines start one tuner on each, sharing "
        "a study through --tune_storage"
    )


def enqueue(config, *learning_rates):
    """Puts known trials first in the study the tuner will open, opened as the tuner opens it (so with the
    direction the tuner gives it, which the tests then check)."""
    os.makedirs(config.workdir, exist_ok=True)
    space = parse_space(config.tune_space, config)
    study = tune_study.open_study(config, *tune.objective_of(config), space)
    for rate in learning_rates:
        study.enqueue_trial({"learning_rate": rate})


@contextlib.contextmanager
def shared_storage_in(path):
    """The tuner's --tune_storage=SHARED_URL, kept in an SQLite file at `path` (no database server here)."""

    class Storage(optuna.storages.RDBStorage):  # a subclass: Optuna checks storages by type
        def __init__(self, url, **kwargs):
            assert url == SHARED_URL
            super().__init__(f"sqlite:///{path}", **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optuna.storages, "RDBStorage", Storage)
        yield


def load_study(workdir, database="study.db"):
    return optuna.load_study(storage=f"sqlite:///{os.path.join(workdir, database)}", study_name="tune")


def listing(path):
    """{relative path: bytes} of every file under `path`."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return found


def read(path, name):
    with open(os.path.join(path, name)) as f:
        return f.read()


def logged_step(workdir):
    """The last step in metrics.jsonl while a run writes it (0 before the first line)."""
    try:
        return helpers.logged_steps(workdir)[-1]
    except (IndexError, ValueError):  # not there yet, empty, or a line half written
        return 0


PLANTED = ("best.flags", "tune_report.png")


def outside_of(workdir):
    return pathlib.Path(f"{workdir}-outside")


@pytest.fixture(scope="module")
def study(data_dir, one_device, tmp_path_factory):
    """Six trials of TPE with Hyperband over the learning rate; trial 0 is a known-bad rate, 1e-5. The study is
    shared through a database URL with a password (kept in SQLite beside the workdir); returns the config, the
    summary, what the tuner printed and the database's file."""
    workdir = tmp_path_factory.mktemp("tune")
    database = tmp_path_factory.mktemp("database") / "shared.db"
    space = write_space(workdir, "# the learning rate, log-uniform\nlearning_rate  log  1e-5  1e-1\n")
    config = tune_config(data_dir, workdir, space, tune_trials=6, tune_startup_trials=3, tune_storage=SHARED_URL)
    # Links planted at the study's outputs, to files outside the workdir: each must be replaced, never written through.
    outside = outside_of(workdir)
    outside.mkdir()
    for name in PLANTED:
        (outside / name).write_text("keep me\n")
        os.symlink(outside / name, workdir / name)
    console = io.StringIO()
    with shared_storage_in(database), contextlib.redirect_stdout(console):
        enqueue(config, 1e-5)
        summary = tune.tune(config, one_device)
    return config, summary, console.getvalue(), database


@pytest.mark.slow
def test_the_study_writes_its_outputs_in_place_of_planted_links(study):
    workdir = pathlib.Path(study[0].workdir)
    for name, head in zip(PLANTED, (b"# Best trial", b"\x89PNG")):
        assert not (workdir / name).is_symlink() and (workdir / name).read_bytes().startswith(head)
        assert (outside_of(workdir) / name).read_text() == "keep me\n"


@pytest.mark.slow
def test_search_finds_learning_rates_better_than_a_known_bad_one(study):
    config, summary, console, database = study
    records = {t["number"]: t for t in summary["all"]}
    bad, best = records[0], summary["best"]
    # The task's own objective: classification maximizes accuracy. The study Optuna ran maximizes (its sampler and
    # pruner read the direction from it), and its best trial is the complete trial of the highest accuracy.
    assert (summary["task"], summary["objective"], summary["direction"]) == ("classification", "accuracy", "max")
    assert load_study(*os.path.split(database)).direction == optuna.study.StudyDirection.MAXIMIZE
    complete = [t for t in summary["all"] if t["state"] == "complete"]
    assert best["trial"] == max(complete, key=lambda t: t["value"])["number"]
    assert bad["params"] == {"learning_rate": 1e-5}
    assert summary["trials"] == 6 and summary["complete"] + summary["pruned"] == 6 and summary["failed"] == 0
    assert best["params"]["learning_rate"] > 1e-3
    assert best["value"] >= 0.8 and best["value"] > bad["value"] + 0.4, (best, bad)
    assert best["value"] == max(t["value"] for t in summary["all"] if t["state"] == "complete")
    # Tuning never looks at the test split: every evaluation of every trial counted the 180 validation examples.
    for record in summary["all"]:
        trial_dir = record["workdir"]
        saved = json.loads(read(trial_dir, "config.json"))
        assert saved["eval_split"] == "validation" and saved["tune_storage"] == ""  # a trial never opens the study
        evals = [json.loads(line) for line in read(trial_dir, "eval.jsonl").splitlines()]
        assert evals and all(e["examples"] == VALIDATION_EXAMPLES for e in evals)
    on_disk = json.loads(read(config.workdir, "summary.json"))
    assert on_disk["best"] == summary["best"] and on_disk["trials"] == 6
    with open(os.path.join(config.workdir, "tune_report.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(os.path.join(config.workdir, "tune_report.png")) > 20_000  # four panels, not a blank
    # The storage's password is in no file of the study and on no line it printed; they name the URL masked.
    files = listing(config.workdir)
    assert {name for name, content in files.items() if SECRET.encode() in content} == set()
    assert json.loads(files["study.json"]) == {"storage": MASKED_URL, "study": "tune"}
    assert (on_disk["storage"], SECRET in console) == (MASKED_URL, False)
    assert f"tune: study 'tune' in {MASKED_URL}: 0 of 6 trials finished; objective validation accuracy" in console


@pytest.mark.slow
def test_best_flagfile_reruns_to_the_same_result(study, tmp_path):
    config, summary, _, _ = study
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


def test_a_train_run_and_a_tuner_refuse_each_others_workdir(study, data_dir, one_device, tmp_path):
    config, summary, _, _ = study
    study_dir, trial_dir = config.workdir, summary["best"]["workdir"]
    before = {path: listing(path) for path in (study_dir, trial_dir)}
    with pytest.raises(ConfigError) as refused:
        loop.train(helpers.make_config(data_dir, study_dir, train_steps=60), one_device)
    assert str(refused.value) == (
        f"--workdir={study_dir} holds a tuning study ({study_dir}/study.json): a train run needs a --workdir of its "
        "own; the study's trials train in its trials/ folder"
    )
    # A trial's workdir is a train run's: a study of its own there would replace its summary.json.
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, workdir=trial_dir, tune_storage="", tune_trials=1), one_device)
    assert str(refused.value) == (
        f"--workdir={trial_dir} holds a train run ({trial_dir}/config.json): a study needs a --workdir of its own"
    )
    assert {path: listing(path) for path in (study_dir, trial_dir)} == before  # nothing written, nothing lost
    # A train run's from before config.json holds its checkpoints alone: a study moved in beside them.
    old = tmp_path / "old"
    shutil.copytree(os.path.join(trial_dir, "checkpoints"), old / "checkpoints")
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, workdir=str(old), tune_storage="", tune_trials=1), one_device)
    assert str(refused.value) == (
        f"--workdir={old} holds a train run ({old}/checkpoints): a study needs a --workdir of its own"
    )
    assert os.listdir(old) == ["checkpoints"]


@pytest.mark.slow
@pytest.mark.parametrize("pruner", ["median", "successive_halving"])
def test_pruning_stops_a_hopeless_trial_early(data_dir, one_device, tmp_path, pruner):
    space = write_space(tmp_path, "learning_rate log 1e-6 1e-1\n")
    config = tune_config(data_dir, tmp_path, space, tune_trials=2, tune_pruner=pruner, tune_startup_trials=1)
    enqueue(config, 3e-3, 1e-6)  # a good trial to compare with, then a hopeless one
    summary = tune.tune(config, one_device)
    good, hopeless = summary["all"]
    # The pruner judged by the study's direction: it stopped the trial of lower accuracy.
    assert load_study(tmp_path).direction == optuna.study.StudyDirection.MAXIMIZE
    assert (good["state"], hopeless["state"]) == ("complete", "pruned")
    assert good["steps"] == 60 and helpers.logged_steps(good["workdir"]) == [10, 20, 30, 40, 50, 60]
    # Stopped at its first evaluation, step 20 of 60, and its workdir shows it.
    assert hopeless["steps"] == 20 and helpers.logged_steps(hopeless["workdir"]) == [10, 20]
    assert json.loads(read(hopeless["workdir"], "summary.json"))["step"] == 20
    # Evaluated once at the step it was pruned at: the evaluation the pruner judged is the run's last.
    assert [json.loads(line)["step"] for line in read(hopeless["workdir"], "eval.jsonl").splitlines()] == [20]
    assert checkpoint.list_checkpoints(os.path.join(hopeless["workdir"], "checkpoints"))[0].endswith("ckpt-20")
    assert hopeless["value"] < good["value"] - 0.2


@pytest.mark.slow
def test_killed_study_resumes_with_completed_trials_kept_and_none_run_twice(data_dir, tmp_path):
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\nhidden_sizes choice 16 32,32\n")
    workdir = tmp_path / "study"
    args = [
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
    proc = forkserver.popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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

    out = forkserver.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"resumed from step {resume_from}" in out.stdout and resume_from >= 40
    after = load_study(workdir).trials
    assert [t.state.name for t in after] == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    for old, new in zip(before[:2], after[:2]):  # completed trials kept as they were
        assert (new.value, new.params, new.datetime_complete) == (old.value, old.params, old.datetime_complete)
    assert after[3].user_attrs[tune_study.RESUMES] == 2 and after[3].params == before[2].params
    # No trial ran twice: the completed ones were not touched, the interrupted one continued in its own workdir.
    assert {n: read(workdir / "trials" / str(n), "metrics.jsonl") for n in (0, 1)} == kept
    assert sorted(os.listdir(workdir / "trials")) == ["0", "1", "2", "4"]
    assert helpers.logged_steps(killed_trial) == list(range(10, 201, 10))
    summary = json.loads(read(workdir, "summary.json"))
    # Trial 2 failed no draw: trial 3 resumed it from its checkpoint (it counted as failed).
    assert (summary["trials"], summary["complete"], summary["failed"], summary["interrupted"]) == (4, 4, 0, 1)
    assert [t["state"] for t in summary["all"]] == ["complete", "complete", "interrupted", "complete", "complete"]
    assert "tune: trial 2 was interrupted; requeued to resume in trials/2" in out.stdout


def test_a_requeued_trial_reports_the_curve_of_the_trial_it_continues(data_dir, one_device, tmp_path, monkeypatch):
    """A trial preempted after two evaluations resumes as a new trial, which reported only what came after the
    resume: tune_report.png drew its curve from there and the pruners judged it on half a curve."""
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    config = tune_config(data_dir, tmp_path / "study", space, tune_trials=1, tune_sampler="random")
    runs = []

    def train(run_config, strategy, on_eval):  # the trial's run: evaluations at 20 and 40, then the second run's
        first = not runs
        runs.append(run_config.workdir)
        for step in (20, 40) if first else (40, 60):  # a run resumed at 40 evaluates 40 again
            assert not on_eval(step, {"accuracy": step / 100, "examples": 180})
        if first:
            raise Preempted("preempted", 75)
        return {"step": 60, "eval": {"accuracy": 0.6, "examples": 180}}

    monkeypatch.setattr(loop, "train", train)
    with pytest.raises(Preempted), warnings.catch_warnings():
        warnings.simplefilter("error")  # a step reported twice is Optuna's warning
        tune.tune(config, one_device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tune.tune(config, one_device)
    trials = load_study(tmp_path / "study").trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"] and runs[0] == runs[1]
    assert trials[1].intermediate_values == {20: 0.2, 40: 0.4, 60: 0.6}


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
        # Before: accepted, and a study of identical trials ran, or drew one value twice as often as the others.
        ("hidden_sizes choice 64\n", r"choice needs two values or more \(one searches nothing: give --hidden_sizes=64"),
        ("hidden_sizes choice 64 32 64\n", r"--hidden_sizes=64 is given twice$"),
        ("learning_rate choice 0.1 1e-1\n", r"--learning_rate=1e-1 is given twice \(as 0.1 too\)$"),
    ],
)
def test_bad_search_space_is_refused_naming_the_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        parse_space(write_space(tmp_path, text))


def test_a_space_searching_what_no_trial_reads_and_an_unnamed_study_are_refused(data_dir, tmp_path):
    # Before: a whole study ran over --momentum under adamw (or --resnet_depth of an MLP), which changes nothing, and
    # --tune_study= kept a study named "".
    config = helpers.make_config(data_dir, str(tmp_path), **TUNE_DEFAULTS)
    for text, read_by in (
        ("momentum float 0 0.9\n", "read by --optimizer=sgd"),
        ("learning_rate log 1e-3 1e-1\nresnet_depth choice 8 14\n", "read by --model=resnet"),
    ):
        with pytest.raises(ConfigError) as refused:
            parse_space(write_space(tmp_path, text), config)
        line = text.strip().splitlines()[-1]
        name = line.split()[0]
        number = len(text.strip().splitlines())
        assert str(refused.value) == (
            f"--tune_space={tmp_path / 'search.space'}: line {number} ({line!r}): no part of these trials reads "
            f"--{name} ({read_by})"
        )
    # Searching what selects its readers, some trials read it.
    both = parse_space(write_space(tmp_path, "model choice mlp resnet\nresnet_depth choice 8 14\n"), config)
    assert [p.name for p in both] == ["model", "resnet_depth"]
    with pytest.raises(ConfigError, match="^--tune_study=: names the study: give it a name"):
        tune_config(data_dir, tmp_path, write_space(tmp_path, "learning_rate log 1e-3 1e-1\n"), tune_study="")


def test_space_file_shipped_for_the_resnet_parses():
    space = parse_space(os.path.join(ROOT, "experiments", "digits_resnet.space"))
    assert {p.name for p in space} == {"resnet_depth", "resnet_width", "learning_rate", "weight_decay", "warmup_steps"}


def test_tuning_refuses_the_test_split_and_pruning_without_evaluations(data_dir, tmp_path):
    space = write_space(tmp_path, "learning_rate log 1e-4 1e-1\n")
    with pytest.raises(ConfigError, match="--validation_split=test: tuning and ensemble fitting never look"):
        tune_config(data_dir, tmp_path, space, validation_split="test")
    with pytest.raises(ConfigError, match=r"--eval_every=0: --tune_pruner=hyperband judges trials"):
        tune_config(data_dir, tmp_path, space, eval_every=0)


def test_tune_and_ensemble_called_directly_run_their_checks_whatever_the_configs_mode(data_dir, tmp_path):
    # A notebook calls tune(config) or ensemble(config) with a Config left at --mode=train: the checks are the
    # function's, not the flag's, and the test split is refused before any trial or member is read.
    space = write_space(tmp_path, "learning_rate log 1e-4 1e-1\n")
    config = helpers.make_config(
        data_dir,
        str(tmp_path / "tune"),
        **{**TUNE_DEFAULTS, "mode": "train"},
        tune_space=space,
        validation_split="test",
        tune_trials=1,
    )
    with pytest.raises(ConfigError, match="^--validation_split=test: tuning and ensemble fitting never look"):
        tune.tune(config)
    assert not (tmp_path / "tune").exists()
    members = f"{tmp_path / 'a'},{tmp_path / 'b'}"
    config = helpers.make_config(data_dir, str(tmp_path / "ensemble"), members=members, validation_split="test")
    with pytest.raises(ConfigError, match="^--validation_split=test: tuning and ensemble fitting never look"):
        ensemble.ensemble(config)
    assert not (tmp_path / "ensemble").exists()


def test_a_tuner_holds_the_lock_a_train_run_takes(data_dir, one_device, tmp_path, monkeypatch):
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    workdir = str(tmp_path / "study")
    config = tune_config(data_dir, workdir, space, tune_trials=1, tune_pruner="none")
    # A train run that holds the lock and has not written its config.json yet: the tuner is refused naming it.
    training = f"--workdir={workdir}: another run is training here: pid {os.getpid()} on host "
    with lock.Lock(workdir):
        with pytest.raises(ConfigError, match="^" + re.escape(training)):
            tune.tune(config, one_device)
    assert os.listdir(workdir) == []
    train, refusals = loop.train, {}

    def trial(run_config, strategy, on_eval):  # while the tuner runs a trial, each of the others is refused
        for name, start in [
            ("lock", lambda: lock.Lock(workdir).acquire()),
            ("train", lambda: train(helpers.make_config(data_dir, workdir), one_device)),
            ("tuner", lambda: tune.tune(config, one_device)),
        ]:
            with pytest.raises(ConfigError) as refused:
                start()
            refusals[name] = str(refused.value)
        return {"step": 60, "eval": {"accuracy": 0.5, "loss": 1.0, "examples": VALIDATION_EXAMPLES}}

    monkeypatch.setattr(loop, "train", trial)
    summary = tune.tune(config, one_device)
    assert (summary["trials"], summary["best"]["value"]) == (1, 0.5)
    tuning = f"--workdir={workdir}: another run is tuning study 'tune' here: pid {os.getpid()} on host "
    assert refusals["lock"].startswith(tuning) and refusals["tuner"].startswith(tuning), refusals
    assert refusals["train"].startswith(f"--workdir={workdir} holds a tuning study ({workdir}/study.json)")
    assert not os.path.exists(os.path.join(workdir, lock.LOCK_NAME))  # released at the end
    # The workdir holds this study: another is refused before it opens anything.
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, tune_study="other"), one_device)
    assert str(refused.value) == (
        f"--tune_study=other: --workdir={workdir} holds study 'tune' ({workdir}/study.json); resume it with "
        "--tune_study=tune, or give this study a new --workdir"
    )


def test_a_study_of_the_other_direction_is_refused(data_dir, one_device, tmp_path):
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    url = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(storage=url, study_name="tune")  # made outside the tuner: Optuna's default, minimize
    with pytest.raises(ConfigError) as refused:
        tune.tune(tune_config(data_dir, tmp_path, space, tune_trials=1), one_device)
    assert str(refused.value) == (
        f"--tune_direction=max: study 'tune' in {url} minimizes its objective; use another --tune_study or --workdir"
    )
    assert load_study(tmp_path).trials == []


def test_the_storage_password_is_masked_in_errors(data_dir, one_device, tmp_path, monkeypatch):
    monkeypatch.setattr(tune_study.time, "sleep", lambda seconds: None)  # the retries of a storage that will not open
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    cases = {
        f"nosuchdb://tuner:{SECRET}@db.example/studies": (
            "nosuchdb://tuner:***@db.example/studies: cannot open the study (Can't load plugin: "
            "sqlalchemy.dialects:nosuchdb)"
        ),
        f"postgresql//tuner:{SECRET}@db.example/studies": (
            "postgresql//tuner:***@db.example/studies: cannot open the study (Could not parse SQLAlchemy URL from "
            "given URL string)"
        ),
    }
    for url, message in cases.items():
        with pytest.raises(ConfigError) as refused:
            tune.tune(tune_config(data_dir, tmp_path / "study", space, tune_storage=url), one_device)
        assert str(refused.value) == f"--tune_storage={message}"
    assert (
        tune_study.masked(f"mysql://tuner:{SECRET}@h/db?password={SECRET}&x=1")
        == "mysql://tuner:***@h/db?password=***&x=1"
    )
    # Percent-encoded in the URL, as SQLAlchemy asks; a driver's message may quote it decoded.
    encoded = "postgresql://tuner:s3cret%3Ap%40ss@h/db"
    shown = tune_study.masked(encoded, f"{encoded}: login with {SECRET} failed")
    assert shown == "postgresql://tuner:***@h/db: login with *** failed"


def test_a_study_resumed_with_other_settings_or_another_space_is_refused_and_left_as_it_was(
    data_dir, one_device, tmp_path
):
    # Before: --train_steps=20 on a study of 60-step trials ran a 20-step trial beside them and wrote
    # --train_steps=20 into best.flags (which no longer reran the best trial); another space wrote its flags into
    # best.flags and summary.json, then ended in a KeyError traceback.
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    config = tune_config(data_dir, tmp_path, space, tune_trials=1, train_steps=20, eval_every=10, hidden_sizes=(16,))
    tune.tune(config, one_device)
    before = listing(tmp_path)
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, tune_trials=2, train_steps=30), one_device)
    assert str(refused.value) == (
        f"--train_steps=30: study 'tune' in sqlite:///{tmp_path}/study.db ran its trials with --train_steps=20; "
        "resume it with the same settings, or use another --tune_study or --workdir"
    )
    with pytest.raises(
        ConfigError, match=r"^--hidden_sizes=32: study 'tune' .* ran its trials with --hidden_sizes=16;"
    ):
        tune.tune(dataclasses.replace(config, tune_trials=2, hidden_sizes=(32,)), one_device)
    other = write_space(tmp_path / "trials", "weight_decay float 0 1e-3\n")
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, tune_trials=2, tune_space=other), one_device)
    assert str(refused.value) == (
        f"--tune_space={other}: study 'tune' in sqlite:///{tmp_path}/study.db searched another space "
        "(learning_rate log); use another --tune_study or --workdir"
    )
    assert listing(tmp_path) == {**before, "trials/search.space": b"weight_decay float 0 1e-3\n"}
    assert len(load_study(tmp_path).trials) == 1


def test_a_study_resumed_with_another_validation_split_or_determinism_is_refused(data_dir, one_device, tmp_path):
    # Before: --validation_split=train on a resumed study scored its new trials on the training split beside the
    # old ones scored on validation, and crowned one of them best; without --deterministic, best.flags said of a best
    # trial that ran with it "the trials ran without --deterministic" and --deterministic=false.
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    config = tune_config(data_dir, tmp_path, space, tune_trials=1, train_steps=20, eval_every=10, hidden_sizes=(16,))
    tune.tune(config, one_device)
    before = listing(tmp_path)
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, tune_trials=2, validation_split="train"), one_device)
    assert str(refused.value) == (
        f"--validation_split=train: study 'tune' in sqlite:///{tmp_path}/study.db ran its trials with "
        "--validation_split=validation; resume it with the same settings, or use another --tune_study or --workdir"
    )
    with pytest.raises(ConfigError, match=r"^--deterministic=false: study 'tune' .* with --deterministic=true;"):
        tune.tune(dataclasses.replace(config, tune_trials=2, deterministic=False), one_device)
    assert listing(tmp_path) == before
    # The command line's --eval_split is no trial's (they evaluate on --validation_split): it changes nothing.
    assert tune.tune(dataclasses.replace(config, eval_split="validation"), one_device)["trials"] == 1


def test_a_trial_pruned_just_before_a_kill_is_reported_at_its_step_with_its_value(data_dir, one_device, tmp_path):
    # Before: the rerun of a trial whose run the pruner had stopped (its summary written) before the tuner was killed
    # printed "tune: trial 1 pruned at step None" and left its value out of summary.json.
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    config = tune_config(
        data_dir, tmp_path / "study", space, tune_trials=1, train_steps=20, eval_every=10, hidden_sizes=(16,)
    )
    # What such a kill leaves: trial 0's run stopped by the pruner at its first evaluation, the trial requeued.
    enqueue(config)
    study = load_study(config.workdir)
    study.enqueue_trial({"learning_rate": 0.01}, user_attrs={tune_study.RESUMES: 0})
    stopped = loop.train(tune_study.trial_config(config, {"learning_rate": 0.01}, 0), one_device, lambda *_: True)
    assert stopped["step"] == 10
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        summary = tune.tune(config, one_device)
    accuracy = stopped["eval"]["accuracy"]
    trial = summary["all"][0]
    assert (trial["state"], trial["steps"], trial["value"]) == ("pruned", 10, accuracy)
    assert f"tune: trial 0 pruned at step 10 (accuracy={accuracy:.5g}) in " in console.getvalue()


def test_a_diverged_trial_is_pruned_and_the_summary_says_why(data_dir, one_device, tmp_path):
    # Before: summary.json listed it as any pruned trial, with no step and no value, and nothing said it diverged.
    space = write_space(tmp_path, "learning_rate log 1e5 1e6\n")
    config = tune_config(
        data_dir, tmp_path, space, tune_trials=1, train_steps=20, eval_every=10, optimizer="sgd", clip_norm=0.0
    )
    summary = tune.tune(config, one_device)
    (trial,) = summary["all"]
    assert (trial["state"], summary["pruned"], summary["best"]) == ("pruned", 1, None)
    assert trial["diverged"].startswith("non-finite loss or gradient between steps 1 and 10")
