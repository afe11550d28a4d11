"""A workdir keeps what it holds and nothing outside it: damaged checkpoints stop the run instead of restarting it,
a refusal writes nothing, links planted in a workdir are never followed for a write or a delete, and a
continuous_eval sidecar waits for its run and writes nothing when nothing came."""

import dataclasses
import glob
import json
import os
import resource
import shutil
import signal

import pytest
import tensorflow as tf

from engine.run import build, loop
from engine.run import modes as evaluate
from engine.settings.config import validate
from engine.settings.errors import ConfigError
from engine.settings.fields import Config
from engine.state import checkpoint, files, lock
from engine.state import workdir as workdir_lib
from engine.state.checkpoint import CheckpointError
from engine.state.files import make_workdir
from engine.state.report import Report
from tests import forkserver, helpers


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A finished 20-step MLP run with checkpoints at steps 10 and 20 (copy it before changing it)."""
    path = str(tmp_path_factory.mktemp("trained") / "run")
    config = helpers.make_config(data_dir, path, train_steps=20, checkpoint_every=10, keep_checkpoints=2)
    loop.train(config, tf.distribute.OneDeviceStrategy("/cpu:0"))
    return config


def copy_of(trained, tmp_path, name="run"):
    shutil.copytree(trained.workdir, tmp_path / name)
    return dataclasses.replace(trained, workdir=str(tmp_path / name))


def contents(directory):
    """{relative path: bytes} of every file under `directory`."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, directory)] = open(path, "rb").read()
    return found


def outside(tmp_path, text="keep me\n"):
    target = tmp_path / "outside.txt"
    target.write_text(text)
    return target


# Item 15: every checkpoint damaged stops the run; only damage counts as damage.


def test_every_checkpoint_damaged_stops_the_run_naming_them_and_writes_nothing(trained, tmp_path, one_device):
    config = copy_of(trained, tmp_path)
    directory = os.path.join(config.workdir, "checkpoints")
    with open(os.path.join(directory, "ckpt-20.index"), "wb") as f:
        f.write(b"garbage")
    data = os.path.join(directory, "ckpt-10.data-00000-of-00001")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    before = contents(config.workdir)
    with pytest.raises(ConfigError) as refused:
        loop.train(dataclasses.replace(config, train_steps=30), one_device)
    assert str(refused.value) == (
        f"--workdir={config.workdir}: every checkpoint in {directory} is unreadable: {directory}/ckpt-20 (file is "
        f"too short to be an sstable), {directory}/ckpt-10 (Read less bytes than requested); nothing was changed. "
        f"To start this run over from step 0 on purpose, move {directory} away, or give this run a new --workdir"
    )
    assert contents(config.workdir) == before


def test_a_file_where_checkpoints_go_is_named_with_what_mends_it(trained, tmp_path, one_device):
    # It said "run the same command again once it can be read", which no rerun mends.
    config = copy_of(trained, tmp_path)
    directory = os.path.join(config.workdir, "checkpoints")
    shutil.rmtree(directory)
    with open(directory, "w") as f:
        f.write("a file of the user's\n")
    before = contents(config.workdir)
    with pytest.raises(CheckpointError) as failed:
        loop.train(dataclasses.replace(config, train_steps=30), one_device)
    assert str(failed.value) == (
        f"cannot read checkpoint directory {directory}: it is a file, not a directory; nothing was changed: move that "
        "file away, then run the same command again"
    )
    assert contents(config.workdir) == before


def test_a_file_where_tensorboards_folder_goes_is_one_plain_line(trained, tmp_path, one_device):
    # It ended "cannot write PATH/train: Not a directory [Op:CreateSummaryFileWriter] name:", TensorFlow's op and all.
    config = copy_of(trained, tmp_path)
    shutil.rmtree(os.path.join(config.workdir, "train"))
    (tmp_path / "run" / "train").write_text("a file of the user's\n")
    with pytest.raises(CheckpointError) as failed:
        loop.train(dataclasses.replace(config, train_steps=30), one_device)
    assert str(failed.value) == f"cannot write {config.workdir}/train: Not a directory"


class _Failing:
    """A tf.train.Checkpoint whose restore fails as the storage under it does."""

    def __init__(self, error):
        self.error = error

    def restore(self, path):
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        tf.errors.UnavailableError(None, None, "GCS: 503 Service Unavailable"),
        tf.errors.DeadlineExceededError(None, None, "deadline exceeded after 120 s"),
        tf.errors.PermissionDeniedError(None, None, "caller does not have storage.objects.get access"),
        # The checkpoint reader reports every error of its file system as UNKNOWN with the file system's text.
        tf.errors.OpError(None, None, "Error executing an HTTP request: HTTP response code 503", tf.errors.UNKNOWN),
    ],
)
def test_a_storage_error_is_an_io_error_not_a_damaged_checkpoint(error):
    with pytest.raises(CheckpointError) as failed:
        checkpoint.restore(_Failing(error), "gs://bucket/run/checkpoints/ckpt-20")
    assert str(failed.value).startswith("cannot read checkpoint gs://bucket/run/checkpoints/ckpt-20: ")
    assert str(failed.value).endswith("; nothing was changed: run the same command again once the storage answers")


@pytest.mark.parametrize(
    "error",
    [
        tf.errors.DataLossError(None, None, "Checksum does not match: stored 1 vs. calculated on the restored bytes 2"),
        tf.errors.OpError(None, None, "file is too short to be an sstable", tf.errors.UNKNOWN),
        tf.errors.OpError(None, None, "/w/ckpt-10.data-00000-of-00001; No such file or directory", tf.errors.UNKNOWN),
        tf.errors.NotFoundError(None, None, "Unsuccessful TensorSliceReader constructor: Failed to find any matching"),
        IndexError("Read less bytes than requested"),
    ],
)
def test_a_damaged_checkpoint_reads_as_damaged(error):
    with pytest.raises(checkpoint.Unreadable):
        checkpoint.restore(_Failing(error), "/w/checkpoints/ckpt-10")


class _RotatedAway:
    """A tf.train.Checkpoint whose files a run still training deletes (--keep_checkpoints) as it reads them: the
    objects it read first are restored, the rest are not, and TensorFlow's match assertion fails."""

    def restore(self, path):
        for name in tf.io.gfile.glob(path + ".*"):
            tf.io.gfile.remove(name)
        return self

    def expect_partial(self):
        pass

    def assert_existing_objects_matched(self):
        raise AssertionError("Found 1 Python objects that were not bound to checkpointed values")


def test_a_checkpoint_rotated_away_as_it_is_read_is_unreadable_not_another_runs(trained, tmp_path):
    # A sidecar following a run with --keep_checkpoints=1 stopped on "checkpoint ckpt-250 does not fit this run: its
    # objects differ (another model?)", or on a NotFoundError traceback from the check that names the difference.
    config = copy_of(trained, tmp_path)
    with pytest.raises(checkpoint.Unreadable) as unreadable:
        checkpoint.restore(_RotatedAway(), os.path.join(config.workdir, "checkpoints", "ckpt-20"), partial=True)
    assert str(unreadable.value).startswith("its files went away as it was read")


def test_a_storage_failure_while_naming_a_mismatch_is_a_storage_error(trained, tmp_path, monkeypatch):
    # The check that names what differs read the checkpoint again; a gs:// blip there marked a good checkpoint
    # damaged for good (a sidecar passed it over, eval counted it).
    config = copy_of(trained, tmp_path)
    path = os.path.join(config.workdir, "checkpoints", "ckpt-20")

    class Mismatched(_RotatedAway):
        def restore(self, path):  # its files stay
            return self

    def unavailable(path):
        raise tf.errors.UnavailableError(None, None, "GCS: 503 Service Unavailable")

    monkeypatch.setattr(tf.train, "load_checkpoint", unavailable)
    with pytest.raises(CheckpointError) as failed:
        checkpoint.restore(Mismatched(), path, partial=True)
    assert str(failed.value).startswith(f"cannot read checkpoint {path}: UnavailableError: GCS: 503")


def test_an_ensemble_member_rotated_away_as_it_is_read_moves_to_the_newer_checkpoint(trained, tmp_path):
    # TensorFlow deletes a rotated checkpoint's index first: its data files were still there, so the member was
    # refused as "--members: .../ckpt-10 is unreadable" though ckpt-20 had replaced it.
    from research import ensemble_members

    config = dataclasses.replace(copy_of(trained, tmp_path), mode="eval")
    listed = os.path.join(config.workdir, "checkpoints", "ckpt-10")
    os.remove(listed + ".index")
    run = evaluate._evaluated(config, tf.distribute.OneDeviceStrategy("/cpu:0"))
    ensemble_members._restored(run.state, config.workdir, listed)
    assert int(run.state.step.numpy()) == 20


def test_eval_of_a_run_still_training_reads_the_checkpoint_that_replaced_one_rotated_away(trained, tmp_path):
    # Listed with ckpt-10 its newest, the run saved ckpt-20 and was deleting ckpt-10 (its index first, as TensorFlow
    # does): eval said "checkpoint ckpt-10 is unreadable ...; trying the previous one", then "no readable checkpoint
    # (all 1 are damaged)", exit 2.
    config = dataclasses.replace(copy_of(trained, tmp_path), mode="eval")
    listed = os.path.join(config.workdir, "checkpoints", "ckpt-10")
    os.remove(listed + ".index")
    run = evaluate._evaluated(config, tf.distribute.OneDeviceStrategy("/cpu:0"))
    assert evaluate._restore(run, config, [listed]) == os.path.join(config.workdir, "checkpoints", "ckpt-20")
    assert int(run.state.step.numpy()) == 20


# Item 20: a refused --init_checkpoint leaves no workdir behind.


@pytest.mark.parametrize("source", ["missing", "garbage"])
def test_a_refused_init_checkpoint_creates_no_workdir(trained, tmp_path, one_device, source):
    if source == "garbage":
        (tmp_path / "garbage.index").write_bytes(b"not a checkpoint")
    config = dataclasses.replace(trained, workdir=str(tmp_path / "new" / "run"), init_checkpoint=str(tmp_path / source))
    with pytest.raises(ConfigError, match=rf"^--init_checkpoint={tmp_path}/{source}: "):
        loop.train(config, one_device)
    assert sorted(os.listdir(tmp_path)) == (["garbage.index"] if source == "garbage" else [])


def test_a_lock_leaves_a_workdir_it_created_only_when_something_was_written(tmp_path):
    with pytest.raises(ConfigError), lock.Lock(str(tmp_path / "a" / "b")):
        raise ConfigError("refused")
    assert os.listdir(tmp_path) == []
    (tmp_path / "kept").mkdir()
    with pytest.raises(ConfigError), lock.Lock(str(tmp_path / "kept" / "run")):
        raise ConfigError("refused")
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []
    with pytest.raises(ConfigError), lock.Lock(str(tmp_path / "written")):
        (tmp_path / "written" / "config.json").write_text("{}")
        raise ConfigError("refused")
    assert os.listdir(tmp_path / "written") == ["config.json"]


# Item 21: a workdir that cannot be written at the start exits 4, as docs/exit-codes.md says.


def test_a_full_workdir_at_the_start_is_an_error_writing_it(tmp_path):
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))  # no file may grow: as on a full disk
    try:
        with pytest.raises(CheckpointError) as full:
            make_workdir(str(tmp_path / "run"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert str(full.value) == f"--workdir={tmp_path}/run: cannot write there (File too large)"
    assert os.listdir(tmp_path / "run") == []


def test_a_workdir_that_cannot_be_made_exits_4_in_one_line(data_dir, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    proc = forkserver.run(
        ["launch.py", f"--workdir={tmp_path}/file/run", f"--data_dir={data_dir}", "--train_steps=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: --workdir={tmp_path}/file/run: cannot write there ({tmp_path}/file is not a directory)"
    ]
    assert os.listdir(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "not a directory"


# Item 22: links planted in a workdir are replaced or refused, never followed; nothing outside it is deleted.


@pytest.mark.parametrize("planted", ["summary.json", "summary.json.tmp", ".write_probe"])
def test_a_planted_link_is_never_written_through(tmp_path, planted):
    target = outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / planted)
    make_workdir(str(run))
    files.write_json(str(run / "summary.json"), {"step": 1})
    assert target.read_text() == "keep me\n"
    assert json.loads((run / "summary.json").read_text()) == {"step": 1} and not (run / "summary.json").is_symlink()
    assert sorted(os.listdir(run)) == sorted({"summary.json", planted})


def test_bytes_replace_a_link_too(tmp_path):
    target = outside(tmp_path)
    os.symlink(target, tmp_path / "report.png")
    files.replace_text(str(tmp_path / "report.png"), b"\x89PNG\r\n")
    assert target.read_text() == "keep me\n" and (tmp_path / "report.png").read_bytes() == b"\x89PNG\r\n"
    assert sorted(os.listdir(tmp_path)) == ["outside.txt", "report.png"]


def test_a_link_at_a_log_is_refused_not_appended_through(tmp_path):
    target = outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / "metrics.jsonl")
    with pytest.raises(CheckpointError) as refused:
        files.append_text(str(run / "metrics.jsonl"), '{"step": 1}\n')
    assert str(refused.value) == (
        f"cannot write {run}/metrics.jsonl: it is a symbolic link (to {target}); a run writes only inside its "
        "workdir: remove the link"
    )
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize("remote", [False, True])
def test_a_record_appended_after_a_torn_last_line_starts_a_line_of_its_own(tmp_path, remote):
    # A sidecar killed mid-line left '{"step": 15, "checkpoint": ...'; the next one's record was glued onto it, could
    # not be read back, and its checkpoint was evaluated and recorded again by the sidecar after it.
    path = tmp_path / "continuous_eval.jsonl"
    path.write_text('{"step": 10, "split": "test", "checkpoint": "ckpt-10"}\n{"step": 15, "checkpoint": "ck')
    record = {"step": 20, "split": "test", "checkpoint": "ckpt-20"}
    files.append_text(("file://" if remote else "") + str(path), json.dumps(record) + "\n")
    assert [r["step"] for r in evaluate._followed(str(tmp_path), "test")] == [10, 20]
    assert path.read_text().endswith('"ck\n' + json.dumps(record) + "\n")
    files.append_text(str(path), json.dumps(record) + "\n")  # after a whole line: nothing added
    assert path.read_text().endswith(json.dumps(record) + "\n" + json.dumps(record) + "\n")


def test_eval_and_export_refuse_to_write_into_the_checkout_or_a_runs_own_folders(trained, tmp_path):
    # eval --checkpoint left eval_test.json in the checkout and in another run's TensorBoard folder; an --export_dir
    # inside checkpoints/ was taken for a checkpoint, and every later eval and resume of that run ended in a traceback.
    config = copy_of(trained, tmp_path)
    workdir, before = config.workdir, contents(config.workdir)
    ckpt = os.path.join(workdir, "checkpoints", "ckpt-20")
    cases = [
        (evaluate.evaluate, dict(workdir=helpers.ROOT), f"--workdir={helpers.ROOT} is this checkout itself"),
        (
            evaluate.evaluate,
            dict(workdir=os.path.join(workdir, "train")),
            f"--workdir={workdir}/train is inside the workdir of another run ({workdir}): give this run a folder",
        ),
        (
            evaluate.export,
            dict(export_dir=os.path.join(workdir, "checkpoints", "ckpt-99")),
            f"--export_dir={workdir}/checkpoints/ckpt-99 is inside {workdir}/checkpoints, the folder of a run's own "
            f"checkpoints files: give it a folder of its own (without --export_dir: {workdir}/export/STEP)",
        ),
    ]
    for mode, given, said in cases:
        with pytest.raises(ConfigError) as refused:
            mode(dataclasses.replace(config, checkpoint=ckpt, **given))
        assert str(refused.value).startswith(said)
    assert contents(workdir) == before
    assert not os.path.exists(os.path.join(helpers.ROOT, "eval_test.json"))


def test_an_export_killed_as_it_writes_leaves_no_half_savedmodel_and_the_same_command_exports(
    trained, tmp_path, monkeypatch
):
    # A SIGTERM mid-write (exit 75: restart) left export/20 holding an empty variables/, where a model server looks
    # for versions, and the same command was refused: "exists and is not an empty directory".
    config = dataclasses.replace(copy_of(trained, tmp_path), mode="export")
    export = os.path.join(config.workdir, "export", "20")
    save = tf.saved_model.save

    def killed(module, path, signatures):
        os.makedirs(os.path.join(path, "variables"))
        raise KeyboardInterrupt  # what SIGINT raises; SIGTERM's handler stops the process alike

    monkeypatch.setattr(tf.saved_model, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        evaluate.export(config)
    assert not os.path.exists(export)
    monkeypatch.setattr(tf.saved_model, "save", save)
    assert evaluate.export(config) == export
    assert sorted(os.listdir(os.path.dirname(export))) == ["20"]
    assert "serving_default" in tf.saved_model.load(export).signatures


def test_an_exports_leftover_incomplete_link_is_removed_without_emptying_its_target(trained, tmp_path):
    # export removed a leftover export/<step>.incomplete with tf.io.gfile.rmtree, which follows a link there and
    # emptied the folder it pointed to; then it failed with exit 4 ("...incomplete; Not a directory").
    config = dataclasses.replace(copy_of(trained, tmp_path), mode="export")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "precious").write_text("keep me\n")
    (elsewhere / "sub" / "more").write_text("keep me too\n")
    os.makedirs(os.path.join(config.workdir, "export"))
    os.symlink(elsewhere, os.path.join(config.workdir, "export", "20.incomplete"))
    precious = contents(elsewhere)
    export = evaluate.export(config)
    assert export == os.path.join(config.workdir, "export", "20")
    assert contents(elsewhere) == precious
    assert sorted(os.listdir(os.path.dirname(export))) == ["20"]
    assert "serving_default" in tf.saved_model.load(export).signatures


def test_an_export_dir_that_is_a_link_is_refused_in_one_line_and_nothing_is_written(trained, tmp_path):
    # A link to an empty folder passed the "exists and is not an empty directory" check; the rename then failed
    # with exit 4 (a storage error: "restart, same command") and left <link>.incomplete beside it.
    config = dataclasses.replace(copy_of(trained, tmp_path), mode="export")
    empty = tmp_path / "empty"
    empty.mkdir()
    for name, target in (("link", empty), ("dangling", tmp_path / "nowhere")):
        link = tmp_path / name
        os.symlink(target, link)
        with pytest.raises(ConfigError) as refused:
            evaluate.export(dataclasses.replace(config, export_dir=str(link)))
        assert str(refused.value) == (
            f"--export_dir={link}: is a symbolic link (to {target}); an export is renamed into place, not written "
            "through a link: name the folder itself"
        )
    assert sorted(os.listdir(tmp_path)) == ["dangling", "empty", "link", "run"]  # no <link>.incomplete
    assert os.listdir(empty) == []


def test_an_export_dir_spelled_with_a_dot_exports_into_that_folder(trained, tmp_path, monkeypatch):
    # --export_dir=. (from an empty folder) and --export_dir=out/. wrote the SavedModel to "..incomplete" inside the
    # folder, then failed to rename it onto the folder: exit 4, "Device or resource busy" / "Directory not empty".
    config = dataclasses.replace(copy_of(trained, tmp_path), mode="export")
    for name, spelled in (("here", "."), ("out", str(tmp_path / "out") + "/.")):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder if spelled == "." else tmp_path)
        assert evaluate.export(dataclasses.replace(config, export_dir=spelled)) == spelled
        assert sorted(os.listdir(folder)) == ["assets", "fingerprint.pb", "saved_model.pb", "variables"]
        assert "serving_default" in tf.saved_model.load(str(folder)).signatures
    assert sorted(os.listdir(tmp_path)) == ["here", "out", "run"]


def test_a_sidecar_with_a_short_timeout_evaluates_the_checkpoint_before_one_without_its_index(
    trained, tmp_path, one_device
):
    # ckpt-20 without its index waited a minute to count as damaged, so with --eval_timeout=4 the sidecar said "no
    # checkpoint appeared ... within --eval_timeout=4 s; nothing evaluated" beside a readable ckpt-10.
    config = copy_of(trained, tmp_path)
    os.remove(os.path.join(config.workdir, "checkpoints", "ckpt-20.index"))
    follow = dataclasses.replace(config, mode="continuous_eval", eval_timeout=4)
    assert [r["step"] for r in evaluate.follow(follow, one_device, poll_seconds=0.2)] == [10]


def test_a_sidecar_evaluates_a_checkpoint_passed_over_for_want_of_its_index_once_the_index_is_written(
    trained, tmp_path, one_device, monkeypatch
):
    # A save slower than the wait for its index (a large checkpoint on gs://) was passed over for good: the index
    # written, the sidecar still said "no new checkpoint for 4 s (--eval_timeout) after step 10 of 20; stopping",
    # the run's final step never evaluated.
    config = copy_of(trained, tmp_path)
    index = os.path.join(config.workdir, "checkpoints", "ckpt-20.index")
    os.rename(index, str(tmp_path / "index"))
    recorded = evaluate._recorded

    def then_the_index(run, config, checkpoint, writer):
        result = recorded(run, config, checkpoint, writer)
        if os.path.exists(tmp_path / "index"):  # the save finishes once ckpt-20 was passed over for ckpt-10
            os.rename(str(tmp_path / "index"), index)
        return result

    monkeypatch.setattr(evaluate, "_recorded", then_the_index)
    follow = dataclasses.replace(config, mode="continuous_eval", eval_timeout=4)
    assert [r["step"] for r in evaluate.follow(follow, one_device, poll_seconds=0.2)] == [10, 20]


def test_a_sidecar_of_a_run_an_action_stopped_stops_after_its_last_checkpoint(trained, tmp_path, one_device, capsys):
    # A run an early stop ended at step 10 (summary.json's stopped_by; a rerun trains no further): its sidecar waited
    # out --eval_timeout (600 s by default) for a checkpoint that could never come.
    config = copy_of(trained, tmp_path)
    for path in glob.glob(os.path.join(config.workdir, "checkpoints", "ckpt-20*")):
        os.remove(path)
    summary_path = os.path.join(config.workdir, "summary.json")
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary_path, "w") as f:
        json.dump({**summary, "step": 10, "stopped_by": "engine/run/actions/patience.py"}, f)
    follow = dataclasses.replace(config, mode="continuous_eval", eval_timeout=120)
    assert [r["step"] for r in evaluate.follow(follow, one_device, poll_seconds=0.2)] == [10]
    assert capsys.readouterr().out.splitlines()[-1] == (
        "continuous_eval: engine/run/actions/patience.py stopped the run at step 10; stopping"
    )


def test_a_sidecar_or_eval_of_a_study_says_so_at_once_and_a_sidecar_refuses_a_checkpoint(trained, tmp_path):
    # A sidecar waited its whole --eval_timeout (600 s by default) on a study's workdir, then said "no run appeared
    # there"; eval said "train first". A sidecar's --checkpoint was ignored, its model that run's.
    study, ensemble = tmp_path / "study", tmp_path / "ensemble"
    for workdir, name in ((study, "study.json"), (ensemble, "summary.json")):
        workdir.mkdir()
        (workdir / name).write_text("{}")
    for mode in (evaluate.follow, evaluate.evaluate):
        with pytest.raises(ConfigError) as refused:
            mode(dataclasses.replace(trained, workdir=str(study), eval_timeout=1))
        assert str(refused.value) == (
            f"--workdir={study} holds a tuning study ({study}/study.json), not a train run: its trials are the runs, "
            f"in {study}/trials"
        )
        with pytest.raises(ConfigError) as refused:
            mode(dataclasses.replace(trained, workdir=str(ensemble), eval_timeout=1))
        assert str(refused.value) == (
            f"--workdir={ensemble} holds another job's results ({ensemble}/summary.json, an ensemble's), not a train "
            "run"
        )
    ckpt = os.path.join(trained.workdir, "checkpoints", "ckpt-20")
    with pytest.raises(ConfigError) as refused:
        evaluate.follow(dataclasses.replace(trained, workdir=str(tmp_path / "side"), checkpoint=ckpt))
    assert str(refused.value) == (
        f"--checkpoint={ckpt}: continuous_eval follows the checkpoints of --workdir; for one checkpoint, --mode=eval"
    )


def test_eval_of_a_checkpoint_into_a_new_workdir_writes_its_results_there(trained, tmp_path, one_device):
    # It evaluated, then ended with exit 4 ("cannot write .../eval_test.json: No such file or directory"): the result
    # was lost.
    config = copy_of(trained, tmp_path)
    ckpt = os.path.join(config.workdir, "checkpoints", "ckpt-20")
    new = tmp_path / "new" / "eval"
    summary = evaluate.evaluate(dataclasses.replace(config, mode="eval", workdir=str(new), checkpoint=ckpt), one_device)
    assert json.loads((new / "eval_test.json").read_text()) == json.loads(json.dumps(summary))


def test_eval_replaces_links_at_its_outputs_and_leaves_their_targets(trained, tmp_path, one_device):
    config = copy_of(trained, tmp_path)
    target = outside(tmp_path)
    os.remove(os.path.join(config.workdir, "summary.json"))
    for name in ("eval_test.json", "eval_test.json.tmp", "summary.json"):
        os.symlink(target, os.path.join(config.workdir, name))
    evaluate.evaluate(dataclasses.replace(config, mode="eval"), one_device)
    assert target.read_text() == "keep me\n"
    assert json.load(open(os.path.join(config.workdir, "eval_test.json")))["step"] == 20


def test_a_state_file_naming_checkpoints_elsewhere_deletes_nothing_there(trained, tmp_path, one_device, capsys):
    config = copy_of(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(config.workdir, "checkpoints"), elsewhere)
    precious = sorted(os.listdir(elsewhere))
    state = os.path.join(config.workdir, "checkpoints", "checkpoint")
    with open(state, "w") as f:
        f.write(
            f'model_checkpoint_path: "ckpt-20"\nall_model_checkpoint_paths: "{elsewhere}/ckpt-10"\n'
            'all_model_checkpoint_paths: "../../elsewhere/ckpt-20"\nall_model_checkpoint_paths: "ckpt-20"\n'
            "all_model_checkpoint_timestamps: 1.0\nall_model_checkpoint_timestamps: 2.0\n"
            "all_model_checkpoint_timestamps: 3.0\nlast_preserved_timestamp: 0.5\n"
        )
    capsys.readouterr()
    loop.train(dataclasses.replace(config, train_steps=30, keep_checkpoints=1), one_device)
    assert sorted(os.listdir(elsewhere)) == precious
    warning = f"{state} names checkpoints outside {os.path.dirname(state)} ({elsewhere}/ckpt-10)"
    assert warning in capsys.readouterr().out
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(os.path.dirname(state))] == ["ckpt-30"]


def test_a_state_file_listing_a_checkpoint_that_is_gone_is_rebuilt_and_rotation_goes_on(
    trained, tmp_path, one_device, capsys
):
    # A state file naming a checkpoint no longer there (ckpt-90) was kept: the manager never deleted ckpt-10 and
    # ckpt-20, which it did not list, and a run of --keep_checkpoints=2 ended holding 4.
    config = copy_of(trained, tmp_path)
    state = os.path.join(config.workdir, "checkpoints", "checkpoint")
    with open(state, "w") as f:
        f.write('model_checkpoint_path: "ckpt-90"\nall_model_checkpoint_paths: "ckpt-90"\n')
    capsys.readouterr()
    loop.train(dataclasses.replace(config, train_steps=40), one_device)
    warning = f"warning: {state} lists ckpt-90, the folder holds ckpt-10, ckpt-20; rebuilt from the files"
    assert warning in capsys.readouterr().out.splitlines()
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(os.path.dirname(state))] == ["ckpt-40", "ckpt-30"]


def test_a_leftover_temp_link_is_removed_without_touching_its_target(trained, tmp_path, one_device):
    config = copy_of(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep me\n")
    os.symlink(elsewhere, os.path.join(config.workdir, "checkpoints", "ckpt-30_temp"))
    checkpoint.Checkpoints(build.run(config, one_device).state, config.workdir, keep=2)
    assert (elsewhere / "precious").read_text() == "keep me\n"
    assert not os.path.lexists(os.path.join(config.workdir, "checkpoints", "ckpt-30_temp"))


def test_a_checkpoints_link_is_refused_before_rotation_deletes_through_it(trained, tmp_path, one_device):
    config = copy_of(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    directory = os.path.join(config.workdir, "checkpoints")
    shutil.move(directory, elsewhere)
    os.symlink(elsewhere, directory)
    precious = contents(elsewhere)
    with pytest.raises(ConfigError) as refused:
        loop.train(dataclasses.replace(config, train_steps=30, keep_checkpoints=1), one_device)
    assert str(refused.value) == (
        f"{directory} is a symbolic link (to {elsewhere}); checkpoints rotate inside the workdir only: make it a "
        "directory, or link the whole --workdir instead"
    )
    assert contents(elsewhere) == precious


# Item 26: a workdir path through a missing directory.


def test_a_workdir_through_a_missing_directory_and_dot_dot_trains(data_dir, tmp_path, one_device):
    config = helpers.make_config(data_dir, f"{tmp_path}/missing/../run", train_steps=2, steps_per_loop=1)
    assert loop.train(config, one_device)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert json.load(open(tmp_path / "run" / "summary.json"))["step"] == 2


# Items 28 and 19: continuous_eval waits for its run, and says so when nothing came.


def test_a_sidecar_started_before_its_run_waits_for_config_json(trained, tmp_path, one_device, monkeypatch):
    run = tmp_path / "run"
    # --mode=continuous_eval --workdir=W: the model is the run's, whatever the defaults build.
    sidecar = validate(Config(mode="continuous_eval", workdir=str(run), data_dir=trained.data_dir, eval_timeout=60))
    assert sidecar.hidden_sizes != trained.hidden_sizes
    sleeps = []

    def sleep(seconds):  # the trainer starts while the sidecar waits
        sleeps.append(seconds)
        if not run.exists():
            shutil.copytree(trained.workdir, run)

    monkeypatch.setattr(evaluate.time, "sleep", sleep)
    results = evaluate.follow(sidecar, one_device, poll_seconds=0.01)
    assert [r["step"] for r in results] == [20] and len(sleeps) == 1
    assert helpers.logged_steps(run, "continuous_eval.jsonl") == [20]


def test_a_sidecar_that_sees_no_checkpoint_says_so_and_writes_nothing(trained, tmp_path, one_device):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(os.path.join(trained.workdir, "config.json"), run)
    sidecar = dataclasses.replace(trained, workdir=str(run), mode="continuous_eval", eval_timeout=0.2)
    with pytest.raises(ConfigError) as nothing:
        evaluate.follow(sidecar, one_device, poll_seconds=0.01)
    assert str(nothing.value) == (
        f"--workdir={run}: no checkpoint appeared in {run}/checkpoints within --eval_timeout=0.2 s; nothing evaluated"
    )
    assert os.listdir(run) == ["config.json"]


def test_a_sidecar_of_a_run_that_never_starts_says_so(trained, tmp_path, one_device):
    sidecar = dataclasses.replace(trained, workdir=str(tmp_path / "run"), mode="continuous_eval", eval_timeout=0.2)
    with pytest.raises(ConfigError) as nothing:
        evaluate.follow(sidecar, one_device, poll_seconds=0.01)
    assert str(nothing.value) == (
        f"--workdir={tmp_path}/run: no run appeared there (no config.json, no checkpoint) within --eval_timeout=0.2 s;"
        " nothing evaluated"
    )
    assert os.listdir(tmp_path) == []


def test_a_picture_that_cannot_be_encoded_fails_as_a_write_naming_it(tmp_path):
    """A task's picture PNG cannot hold (5 channels) stops the run as a failed write of its file (exit 4), with
    nothing written in its place."""
    out = Report(str(tmp_path), True, 10)
    with pytest.raises(CheckpointError, match=f"^cannot write {tmp_path / 'digits.png'}: "):
        out.pictures(5, {"digits": tf.zeros([8, 8, 5], tf.uint8)})
    assert not (tmp_path / "digits.png").exists()


class _Figure:
    def savefig(self, buffer, **kwargs):
        buffer.write(b"a picture")


@pytest.mark.parametrize("writer", ["tune_report", "ensemble_report", "predictions"])
def test_researchs_files_fail_as_writes_naming_them(tmp_path, monkeypatch, writer):
    """tune_report.png, ensemble_report.png and predictions.npz that cannot be written (a folder at the name) stop the
    run as a failed write of the file (CheckpointError, exit 4), as the engine's own files do."""
    from research import ensemble_members, ensemble_report, tune_report

    path = tmp_path / "taken"
    path.mkdir()
    monkeypatch.setattr(tune_report, "figure", lambda *args: _Figure())
    monkeypatch.setattr(ensemble_report, "figure", lambda *args: _Figure())
    write = {
        "tune_report": lambda: tune_report.plot(str(path), *[None] * 7),
        "ensemble_report": lambda: ensemble_report.plot(str(path), None),
        "predictions": lambda: ensemble_members.write_predictions(str(path), {}, [], None, None),
    }[writer]
    with pytest.raises(CheckpointError, match=f"^cannot write {path}: "):
        write()
    assert path.is_dir()


def test_a_remote_workdir_or_export_dir_inside_a_run_is_refused_as_a_local_one():
    # gs:// paths passed every check: an eval's workdir inside a run's, an export inside its checkpoints/. ram://
    # stands in for an object store.
    run = "ram://bucket/runs/trained"
    tf.io.gfile.makedirs(f"{run}/checkpoints")
    with tf.io.gfile.GFile(f"{run}/config.json", "w") as f:
        f.write("{}")
    with pytest.raises(ConfigError) as refused:
        workdir_lib.check_not_inside_a_run(f"{run}/train/")
    assert str(refused.value) == (
        f"--workdir={run}/train/ is inside the workdir of another run ({run}): give this run a folder of its own, "
        "beside it"
    )
    with pytest.raises(ConfigError) as refused:
        workdir_lib.check_not_in_run_folders(f"{run}/checkpoints/ckpt-99", "export_dir", f"{run}/export/STEP")
    assert str(refused.value) == (
        f"--export_dir={run}/checkpoints/ckpt-99 is inside {run}/checkpoints, the folder of a run's own checkpoints "
        f"files: give it a folder of its own (without --export_dir: {run}/export/STEP)"
    )
    workdir_lib.check_not_inside_a_run("ram://bucket/runs/beside")  # beside it: its own
    workdir_lib.check_not_in_run_folders("ram://bucket/exports/1", "export_dir", f"{run}/export/STEP")
    # A run at a bucket's root holds the folders below it too.
    tf.io.gfile.makedirs("ram://root/checkpoints")
    with tf.io.gfile.GFile("ram://root/config.json", "w") as f:
        f.write("{}")
    with pytest.raises(
        ConfigError, match=r"^--workdir=ram://root/sub is inside the workdir of another run \(ram://root\)"
    ):
        workdir_lib.check_not_inside_a_run("ram://root/sub")


def test_a_workdir_below_a_folder_named_in_bytes_that_are_not_utf8_is_checked_by_its_bytes(tmp_path):
    # TensorFlow's file system cannot name such a folder: the upward walk ended in a UnicodeEncodeError traceback.
    parent = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9")
    os.makedirs(os.path.join(parent, "run", "checkpoints"))
    with open(os.path.join(parent, "run", "config.json"), "w") as f:
        f.write("{}")
    workdir_lib.check_not_inside_a_run(os.path.join(parent, "other"))
    with pytest.raises(ConfigError, match="is inside the workdir of another run"):
        workdir_lib.check_not_inside_a_run(os.path.join(parent, "run", "train"))
    workdir_lib.check_not_in_run_folders(os.path.join(parent, "exports"), "export_dir", "there")


# A checkpoints/ folder the run cannot list, a summary.json or train.lock it cannot read: exit 4, nothing changed.


def test_a_checkpoints_folder_that_cannot_be_listed_stops_the_run_before_its_logs_are_rewound(
    trained, tmp_path, one_device, monkeypatch
):
    config = copy_of(trained, tmp_path)
    directory = os.path.join(config.workdir, "checkpoints")
    before = contents(config.workdir)
    os.chmod(directory, 0)
    if os.getuid() == 0:  # root lists it all the same: as another user, where TensorFlow's glob finds nothing in it
        listdir, glob = os.listdir, tf.io.gfile.glob

        def refused(path):
            if os.path.normpath(path) == directory:
                raise PermissionError(13, "Permission denied", path)
            return listdir(path)

        monkeypatch.setattr(os, "listdir", refused)
        monkeypatch.setattr(tf.io.gfile, "glob", lambda p: [] if p.startswith(directory + "/") else glob(p))
    try:
        with pytest.raises(CheckpointError) as failed:
            loop.train(dataclasses.replace(config, train_steps=30), one_device)
    finally:
        os.chmod(directory, 0o755)
    assert str(failed.value) == (
        f"cannot read checkpoint directory {directory}: Permission denied; nothing was changed: run the same command "
        "again once it can be read"
    )
    monkeypatch.undo()
    assert contents(config.workdir) == before  # metrics.jsonl, eval.jsonl and the events not rewound to step 0


def test_a_summary_that_cannot_be_read_is_an_error_naming_it(trained, tmp_path, one_device):
    config = copy_of(trained, tmp_path)
    summary = os.path.join(config.workdir, "summary.json")
    os.remove(summary)
    os.mkdir(summary)
    with pytest.raises(CheckpointError) as failed:
        loop.train(config, one_device)
    assert str(failed.value) == f"cannot write {summary}: Is a directory"


def test_a_lock_that_cannot_be_read_is_an_error_naming_it(tmp_path):
    (tmp_path / "run" / lock.LOCK_NAME).mkdir(parents=True)
    with pytest.raises(CheckpointError) as failed:
        with lock.Lock(str(tmp_path / "run")):
            pass
    assert str(failed.value) == f"cannot write {tmp_path}/run/{lock.LOCK_NAME}: Is a directory"
