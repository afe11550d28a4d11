"""A study under faults: its storage failing part-way through a trial ends the tuner in one line and the same command
resumes it; a workdir whose study lives in another storage, or whose study.db was deleted or replaced, is refused
before anything is written; a moved workdir's study names its trials where they are now."""

import contextlib
import dataclasses
import json
import os
import types

import optuna
import pytest
import sqlalchemy.exc

from engine.settings.errors import CheckpointError, ConfigError
from research import tune, tune_study
from tests.test_tune import listing, load_study, tune_config, write_space


@contextlib.contextmanager
def storage_failing_at_the_first_report():
    """The study's database failing from a trial's first evaluation on (its disk full or made read-only), as Optuna's
    SQL storage raises it: every read and write of the study fails from then."""
    failing = []
    report = optuna.trial.Trial.report
    scoped = optuna.storages._rdb.storage._create_scoped_session

    def failing_report(trial, value, step):
        failing.append(step)
        return report(trial, value, step)

    @contextlib.contextmanager
    def session(*args, **kwargs):
        if failing:
            cause = sqlalchemy.exc.OperationalError("UPDATE trials", {}, OSError("disk I/O error"))
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from cause
        with scoped(*args, **kwargs) as opened:
            yield opened

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optuna.trial.Trial, "report", failing_report)
        patch.setattr(optuna.storages._rdb.storage, "_create_scoped_session", session)
        yield


@pytest.mark.slow
def test_a_storage_that_fails_during_a_trial_ends_in_one_line_and_the_study_resumes(data_dir, one_device, tmp_path):
    # Before: Optuna's own handling of the failed write failed again, and the tuner ended in an UnboundLocalError
    # traceback (exit 1) three exceptions deep.
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    workdir = tmp_path / "study"
    config = tune_config(data_dir, workdir, space, tune_trials=1, train_steps=20, eval_every=10, hidden_sizes=(16,))
    with storage_failing_at_the_first_report(), pytest.raises(CheckpointError) as failed:
        tune.tune(config, one_device)
    assert str(failed.value) == (
        f"--tune_storage=sqlite:///{workdir}/study.db: the study's storage failed (disk I/O error); its finished "
        "trials are kept there: run the same command to resume once it answers"
    )
    assert [t.state.name for t in load_study(workdir).trials] == ["RUNNING"]
    summary = tune.tune(config, one_device)  # the storage answers again: the interrupted trial runs again
    assert (summary["trials"], summary["complete"], summary["failed"], summary["interrupted"]) == (1, 1, 0, 1)
    assert summary["best"]["workdir"] == str(workdir / "trials" / "0")


@pytest.mark.slow
def test_a_study_kept_in_another_storage_is_refused_and_its_workdir_left_as_it_was(data_dir, one_device, tmp_path):
    # Before: resumed without its --tune_storage, the tuner opened a new study in the workdir's study.db, pointed
    # study.json at it, failed that study's trial 0 (trials/0 was the first study's) and blamed "a study of another
    # name"; run again, its trial 1 trained in the sub-workdir the first study's trial 1 would use.
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    workdir = tmp_path / "study"
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    config = tune_config(
        data_dir, workdir, space, tune_trials=1, train_steps=20, eval_every=10, hidden_sizes=(16,), tune_storage=shared
    )
    tune.tune(config, one_device)
    before = listing(workdir)
    for storage in ("", f"sqlite:///{tmp_path / 'other.db'}"):
        with pytest.raises(ConfigError) as refused:
            tune.tune(dataclasses.replace(config, tune_storage=storage, tune_trials=2), one_device)
        assert str(refused.value) == (
            f"--tune_storage={storage}: --workdir={workdir} holds study 'tune' in {shared} ({workdir}/study.json); "
            f"resume it with --tune_storage={shared}, or give this study a new --workdir"
        )
    assert listing(workdir) == before
    assert not (tmp_path / "other.db").exists()
    # A study in the workdir's own study.db is its own wherever the workdir is: moved, it resumes.
    local = tmp_path / "local"
    tune.tune(dataclasses.replace(config, workdir=str(local), tune_storage=""), one_device)
    moved = tmp_path / "moved"
    local.rename(moved)
    assert tune.tune(dataclasses.replace(config, workdir=str(moved), tune_storage=""), one_device)["trials"] == 1
    summary = json.loads((moved / "summary.json").read_text())
    # Before: its trials kept the sub-workdirs they ran in before the move, and summary.json named those.
    assert [t["workdir"] for t in summary["all"]] == [str(moved / "trials" / "0")]
    assert summary["best"]["workdir"] == str(moved / "trials" / "0")
    assert load_study(moved).trials[0].user_attrs["workdir"] == "trials/0"


def test_a_trials_workdir_is_read_where_the_study_is_now_and_an_old_absolute_one_where_it_still_is(tmp_path):
    config = types.SimpleNamespace(workdir=str(tmp_path / "moved"))
    (tmp_path / "moved" / "trials" / "0").mkdir(parents=True)
    (tmp_path / "other" / "trials" / "1").mkdir(parents=True)

    def workdir(**attrs):  # of a trial with these user attributes
        return tune_study.trial_workdir(config, optuna.trial.create_trial(value=0.5, user_attrs=attrs))

    here = str(tmp_path / "moved" / "trials" / "0")
    assert workdir(workdir="trials/0", tuner_workdir="/gone") == here
    assert workdir(workdir="/gone/trials/0") == here  # a study of before, moved
    assert workdir(workdir="study/trials/0") == here  # relative, of before
    other = str(tmp_path / "other" / "trials" / "1")
    assert workdir(workdir=other) == other  # of before, not moved
    # Another tuner's trial of a shared study: where that tuner keeps it.
    assert workdir(workdir="trials/1", tuner_workdir=str(tmp_path / "other")) == other
    assert workdir() is None  # it drew no config


@pytest.mark.slow
def test_a_study_db_deleted_or_replaced_under_its_workdir_is_refused_in_one_line(data_dir, one_device, tmp_path):
    # Before: the tuner opened a new study there, failed its trial 0 ("trials/0 exists but study 'tune' has not run
    # it"), on the next run its trial 1, and from the third on trained its trials beside the first study's.
    space = write_space(tmp_path, "learning_rate log 1e-3 1e-1\n")
    workdir = tmp_path / "study"
    config = tune_config(data_dir, workdir, space, tune_trials=1, train_steps=20, eval_every=10, hidden_sizes=(16,))
    tune.tune(config, one_device)
    database = workdir / "study.db"
    drawn = load_study(workdir).trials[0].params["learning_rate"]
    database.unlink()
    before = listing(workdir)
    with pytest.raises(ConfigError) as refused:
        tune.tune(dataclasses.replace(config, tune_trials=2), one_device)
    assert str(refused.value) == (
        f"--workdir={workdir}: {database} is gone, which holds study 'tune' ({workdir}/study.json); put it back, or "
        "give this study a new --workdir"
    )
    assert listing(workdir) == before
    url = f"sqlite:///{database}"
    for made in ({}, {"learning_rate": drawn * 2}):  # a study made anew; another study's, whose trial 0 drew another
        database.unlink(missing_ok=True)
        other = optuna.create_study(storage=url, study_name="tune", direction="maximize")
        if made:
            distribution = optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)
            distributions = {"learning_rate": distribution}
            other.add_trial(optuna.trial.create_trial(params=made, distributions=distributions, value=0.5))
        with pytest.raises(ConfigError) as refused:
            tune.tune(dataclasses.replace(config, tune_trials=3), one_device)
        assert str(refused.value) == (
            f"--workdir={workdir}: study 'tune' in {url} did not run {workdir}/trials/0 (the study was replaced, or "
            "made anew); put back the storage of the study that ran it, or give this study a new --workdir"
        )
        assert len(load_study(workdir).trials) == len(made)  # no trial failed there
    assert sorted(os.listdir(workdir / "trials")) == ["0"]
