"""A study under faults: its storage failing part-way through a trial ends the tuner in one line and the same command
resumes it; a workdir whose study lives in another storage is refused before anything is written."""

import contextlib
import dataclasses

import optuna
import pytest
import sqlalchemy.exc

from engine.settings.errors import CheckpointError, ConfigError
from research import tune
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
