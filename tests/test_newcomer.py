"""A newcomer's first hour (issue 22): the quick benchmark says what it is, the reports' pictures show the
differences, an export names its classes, --help is grouped, a finished study leaves no lock."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from bench import common
from bench import rows as bench_rows
from bench import run as bench_run
from engine.settings.fields import Config
from tests import helpers
from tests.helpers import ROOT

# ---- bench.run --quick: a smoke test, not a verdict ---------------------------------------------------------


def test_quick_rows_carry_no_verdict():
    models = {"mlp_1024": common.QUICK_MODELS["mlp_1024"]}
    table = bench_rows.rows(helpers.bench_measurements(), models, quick=True)
    results = {row["id"]: row["result"] for row in table}
    assert not {"PASS", "FALL SHORT"} & set(results.values()), results
    # The rows that have a target say they were not judged; the others stay information.
    assert results["speed/mlp_1024"] == "not judged"
    assert results["memory/mlp_1024"] == "not judged"
    assert results["end_to_end/mlp_1024/float32"] == "not judged"
    assert results["roofline/peak"] == "info"
    # A full run of the same numbers judges them.
    full = {row["id"]: row["result"] for row in bench_rows.rows(helpers.bench_measurements(), models)}
    assert full["speed/mlp_1024"] == "PASS" and full["memory/mlp_1024"] == "PASS"


def test_quick_mode_prints_what_it_is(monkeypatch, capsys):
    monkeypatch.setattr(bench_run, "measure", lambda models, quick, gpu, jobs: helpers.bench_measurements())
    assert bench_run.main(["--quick"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("--quick: a smoke test"), first
    assert "windows of 1 step" in first and "no row is judged" in first
    assert "PASS" not in out and "FALL SHORT" not in out


def test_detail_lists_its_figures_in_the_order_of_the_ratio():
    models = {"mlp_1024": common.MODELS["mlp_1024"]}
    table = {row["id"]: row for row in bench_rows.rows(helpers.bench_measurements(), models)}
    # "mixed_bfloat16 / float32" (a ratio of speeds): the numerator's figure first, each named.
    assert table["precision/mlp_1024/mixed_bfloat16"]["detail"] == ("mixed_bfloat16 8 ms/step vs float32 10 ms/step")
    assert table["mirrored/mlp_1024"]["detail"] == "jit=0: mirrored 20 ms/step vs one_device 10 ms/step"
    assert table["speed/mlp_1024"]["detail"].startswith("engine jit=1 10 ms/step vs fit spe=50 jit=1 14.1 ms/step")


# ---- launch.py --help: grouped, with what a newcomer asks first ---------------------------------------------

HELP_GROUPS = [
    "The run",
    "Data",
    "Model",
    "Task",
    "Optimizer",
    "Precision and compilation",
    "Devices and clusters",
    "Modes",
]


@pytest.fixture(scope="module")
def help_text():
    result = subprocess.run(
        [sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return result.stdout


def _sections(text):
    """{section title: its lines}, and the lines before the first section."""
    sections, current, preamble = {}, None, []
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":") and line[:-1] in HELP_GROUPS:
            current = sections.setdefault(line[:-1], [])
        elif current is None:
            preamble.append(line)
        else:
            current.append(line)
    return sections, "\n".join(preamble)


def test_help_groups_every_flag_once_by_what_it_is_about(help_text):
    import dataclasses

    from engine.settings.fields import Config

    sections, _ = _sections(help_text)
    assert list(sections) == HELP_GROUPS
    where = {}
    for title, lines in sections.items():
        for line in lines:
            match = re.match(r"  --(?:\[no\])?(\w+)", line)
            if match:
                assert match.group(1) not in where, f"--{match.group(1)} listed twice"
                where[match.group(1)] = title
    assert sorted(where) == sorted(f.name for f in dataclasses.fields(Config))
    expected = {
        "mode": "The run",
        "workdir": "The run",
        "train_steps": "The run",
        "dataset": "Data",
        "folder_eval_percent": "Data",
        "synthetic_shape": "Data",
        "model": "Model",
        "resnet_depth": "Model",
        "teacher": "Task",
        "learning_rate": "Optimizer",
        "precision": "Precision and compilation",
        "jit_compile": "Precision and compilation",
        "strategy": "Devices and clusters",
        "local_workers": "Devices and clusters",
        "export_dir": "Modes",
        "tune_trials": "Modes",
        "members": "Modes",
    }
    assert {name: where[name] for name in expected} == expected
    (jit,) = [line for line in sections["Precision and compilation"] if line.startswith("  --jit_compile")]
    assert jit.startswith("  --jit_compile=auto|true|false ")
    (nesterov,) = [line for line in sections["Optimizer"] if line.startswith("  --[no]nesterov")]
    (steps,) = [line for line in sections["The run"] if line.startswith("  --train_steps=1000 ")]
    # A plugin's setting says what its file declares it accepts: it was refused at once, --help having said nothing.
    data = " ".join(" ".join(line.split()) for line in sections["Data"])
    assert "hash of each path) (from 1 to 50) --synthetic_shape" in data
    assert "(required where read; default: empty) --tfrecord_classes" in data


def test_help_says_the_choices_and_range_a_plugins_file_declares():
    from types import SimpleNamespace

    from engine.settings.fields import FIELD_BY_NAME
    from engine.settings.help import accepted

    assert accepted(SimpleNamespace(type=str, metadata={"bounds": ("", "sgd", "adam")})) == "one of (empty)|sgd|adam"
    # Said once, where the help names them: research/ensemble.py's "nelder_mead|random (one of nelder_mead|random)".
    named = {"bounds": ("", "sgd", "adam"), "help": "sgd|adam (Kingma and Ba); empty: the run's"}
    assert accepted(SimpleNamespace(type=str, metadata=named)) == ""
    some = {"bounds": ("sgd", "adam", "lamb"), "help": "sgd|adam; lambda: not a choice"}
    assert accepted(SimpleNamespace(type=str, metadata=some)) == "one of sgd|adam|lamb"
    assert [accepted(FIELD_BY_NAME[name]) for name in ("ensemble_search", "tune_direction", "tune_sampler")] == [""] * 3
    assert accepted(SimpleNamespace(type=int, metadata={"bounds": (0, None)})) == "at least 0"
    assert accepted(SimpleNamespace(type=float, metadata={"bounds": (0.5, 20000)})) == "from 0.5 to 20,000"
    assert accepted(SimpleNamespace(type=str, metadata={"bounds": "required"})) == "required where read"
    assert accepted(SimpleNamespace(type=int, metadata={"bounds": None})) == ""
    assert accepted(SimpleNamespace(type=int, metadata={"help": "an engine setting: its help says it"})) == ""


def test_help_starts_with_flagfiles_resuming_datasets_and_gpus(help_text):
    from engine.settings.fields import BUNDLED_DATASETS

    _, preamble = _sections(help_text)
    assert "--flagfile=experiments/digits_resnet.flags" in preamble
    assert "resumes" in preamble and "same command" in preamble
    assert "CUDA_VISIBLE_DEVICES=0,1" in preamble and "--strategy=one_device" in preamble
    for kind in ("folder:PATH", "tfrecord:GLOB", "npz:PATH", "tensorflow-datasets name"):
        assert kind in preamble, kind
    for name in BUNDLED_DATASETS:  # a source added to sources/ must be listed too
        assert re.search(rf"\b{name}\b", preamble), name
    assert "--helpfull" in preamble
    # Every plugin of the checkout, named by its file, with its docstring's summary line.
    from engine.settings import plugins
    from engine.settings.help import summary

    for kind in ("model", "task", "dataset", "actions"):
        for name in plugins.names(kind):
            assert re.search(rf"^  {name} +{re.escape(summary(plugins.path(kind, name))[:40])}", preamble, re.M), name
    # -h and --helpshort print the same page.
    short = subprocess.run([sys.executable, "launch.py", "-h"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert short.returncode == 0 and short.stdout == help_text


def test_helpfull_is_the_help_and_then_absls_own_flags(help_text):
    # --help promises "--helpfull also lists absl's own flags": absl's own listing left out the plugins and groups.
    full = subprocess.run(
        [sys.executable, "launch.py", "--helpfull"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert full.returncode == 0 and full.stderr == "", full.stderr
    assert full.stdout.startswith(help_text.rstrip("\n") + "\n")
    rest = full.stdout[len(help_text) :]
    for flag in ("--flagfile", "--undefok", "logtostderr", "helpxml"):
        assert flag in rest, flag
    assert "--train_steps" not in rest  # the engine's flags are said once, in their groups


def test_the_strategy_flags_help_names_every_way_an_empty_one_is_planned(help_text):
    from types import SimpleNamespace

    from engine.settings.strategy import planned_strategy

    cpus = SimpleNamespace(strategy="", cluster_resolver="", num_cpu_devices=2)
    assert planned_strategy(cpus) == "mirrored"  # what its help said was one device
    sections, _ = _sections(help_text)
    text = " ".join(" ".join(line.split()) for line in sections["Devices and clusters"])
    said = text.partition("--strategy=")[2].partition("--num_cpu_devices=")[0]
    for cause in ("TF_CONFIG", "--cluster_resolver", "--num_cpu_devices above 1", "several GPUs", "one device"):
        assert cause in said, cause


# ---- An export names its classes; summary.json and config.json too -------------------------------------------


@pytest.mark.slow  # a training run and a SavedModel: 29 s on 2 shared cores
def test_a_folder_runs_export_returns_the_folder_name_of_its_prediction(data_dir, tmp_path, one_device):
    import numpy as np
    import tensorflow as tf

    from engine.run import loop
    from engine.run import modes as evaluate

    root, names = tmp_path / "photos", ("ant", "bee", "cat")
    rng = np.random.default_rng(0)
    for label, name in enumerate(names):  # six PNGs a class, each tinted by its class's colour channel
        (root / name).mkdir(parents=True)
        for i in range(6):
            pixels = rng.integers(0, 80, (10, 12, 3))
            pixels[..., label] += 170
            (root / name / f"{i}.png").write_bytes(tf.io.encode_png(pixels.astype(np.uint8)).numpy())
    config = helpers.make_config(
        data_dir,
        str(tmp_path / "run"),
        dataset=f"folder:{root}",
        image_size=8,
        global_batch_size=8,
        hidden_sizes=(8,),
        train_steps=2,
        steps_per_loop=2,
        folder_eval_percent=30,
    )
    summary = loop.train(config, one_device)
    assert summary["class_names"] == list(names)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["class_names"] == list(names)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["class_names"] == list(names)

    export_dir = evaluate.export(dataclasses.replace(config, mode="export"))
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    images = np.random.default_rng(0).random((4, 8, 8, 3), dtype=np.float32)
    out = serve(images=tf.constant(images))
    assert sorted(out) == ["class_names", "classes", "logits", "probabilities"]
    classes = out["classes"].numpy()
    assert [n.decode() for n in out["class_names"].numpy()] == [names[i] for i in classes]
    assert [n.decode() for n in tf.saved_model.load(export_dir).class_names.numpy()] == list(names)


def test_a_source_without_names_calls_its_classes_by_their_indices():
    import tensorflow as tf

    from tasks import classification

    spec = {"image": tf.TensorSpec([4], tf.float32), "label": tf.TensorSpec([], tf.int64)}
    assert classification.Task(None, spec, {"num_classes": 3}).class_names == ("0", "1", "2")
    named = classification.Task(None, spec, {"num_classes": 2, "class_names": ("cat", "dog")})
    assert named.class_names == ("cat", "dog")


# ---- The reports' pictures show the differences ------------------------------------------------------------


def test_ensemble_report_plots_the_error_rate_on_an_axis_fitted_to_it():
    from research import ensemble_report
    from tests.test_reports import ENSEMBLE

    fig = ensemble_report.figure(ENSEMBLE)
    fig.draw_without_rendering()
    ax = {a.get_label(): a for a in fig.axes}["accuracy"]
    assert ax.get_title() == "error rate (1 - accuracy), lower is better"
    rows = [*ENSEMBLE["members"], ENSEMBLE["average"], ENSEMBLE["weighted"]]
    errors = [1 - r[split]["accuracy"] for split in ("validation", "test") for r in rows]
    assert [bar.get_height() for bar in ax.patches] == pytest.approx(errors)
    low, high = ax.get_ylim()
    # The largest error is 0.0278: the axis ends just above it, not at 1.
    assert low == 0 and max(errors) < high <= 1.3 * max(errors), (low, high)


def test_tune_report_colours_exclude_a_collapsed_trial_and_mark_it_apart():
    from tests.test_reports import COMPLETE, make_study, tune_figure

    values = [0.95, 0.9833, 0.9611, 0.9722, 0.9667, 0.9556, 0.9778, 0.0944, 0.9806, 0.9694]
    fig, axes, _ = tune_figure(make_study([(COMPLETE, v, {50: v}) for v in values]))
    assert axes["colorbar"].get_ylim() == (0.95, 0.9833)  # the other nine's range, not 0.0944's
    coords = axes["coordinates"]
    collapsed = [line for line in coords.get_lines() if line.get_gid() == "collapsed"]
    assert len(collapsed) == 1 and collapsed[0].get_color() == "0.6" and collapsed[0].get_linestyle() == "--"
    assert "1 collapsed (0.0944, grey)" in coords.get_title()
    # The objective and the learning curves on axes fitted to the other nine, the collapsed trial marked at the edge.
    for name in ("history", "curves"):
        low, high = axes[name].get_ylim()
        assert 0.94 < low < 0.95 and 0.9833 < high <= 0.985, (name, low, high)
        assert "1 collapsed: trial 7 at 0.0944, below the axis" in axes[name].get_title()
    marks = [t for t in axes["history"].texts if t.get_text() == "trial 7: 0.0944"]
    assert len(marks) == 1 and marks[0].xy == (7, axes["history"].get_ylim()[0])
    # Without an outlier nothing is set apart.
    fig, axes, _ = tune_figure(make_study([(COMPLETE, v, {50: v}) for v in values if v > 0.5]))
    assert not [line for line in axes["coordinates"].get_lines() if line.get_gid() == "collapsed"]
    assert axes["colorbar"].get_ylim() == (0.95, 0.9833)
    assert axes["history"].get_title() == "objective per trial" and not axes["history"].texts


def test_a_trial_that_reported_an_infinite_loss_leaves_the_fitted_axes_finite():
    from research import tune_report
    from tests.test_reports import COMPLETE, PRUNED, SPACE, make_study

    losses = [0.21, 0.25, 0.19, 48.0, 0.3, 0.22]
    outcomes = [(COMPLETE, v, {50: v}) for v in losses] + [(PRUNED, None, {50: float("inf")})]
    study = make_study(outcomes, direction="minimize")
    fig = tune_report.figure(Config(), study.get_trials(), SPACE, study.best_trial, {}, "loss", "min")
    axes = {ax.get_label(): ax for ax in fig.axes}
    for name in ("history", "curves"):
        assert axes[name].get_ylim() == pytest.approx((0.1845, 0.3055)), name  # 0.19 to 0.3, 5% margins


def test_a_diverged_loss_is_set_apart_too():
    from research import tune_report
    from tests.test_reports import COMPLETE, SPACE, make_study

    losses = [0.21, 0.25, 0.19, 48.0, 0.3, 0.22]
    study = make_study([(COMPLETE, v, {50: v}) for v in losses], direction="minimize")
    fig = tune_report.figure(Config(), study.get_trials(), SPACE, study.best_trial, {}, "loss", "min")
    axes = {ax.get_label(): ax for ax in fig.axes}
    assert axes["colorbar"].get_ylim() == (0.19, 0.3)
    assert "1 collapsed (48, grey)" in axes["coordinates"].get_title()


# ---- A finished study leaves no lock -----------------------------------------------------------------------


@pytest.mark.slow  # a one-trial study: 30 s on 2 shared cores
def test_a_finished_study_leaves_no_lock_anywhere_in_its_workdir(data_dir, one_device, tmp_path):
    import os

    from research import tune

    space = tmp_path / "search.space"
    space.write_text("learning_rate log 1e-3 1e-1\n")
    workdir = tmp_path / "study"
    config = helpers.make_config(
        data_dir,
        str(workdir),
        mode="tune",
        tune_space=str(space),
        tune_trials=1,
        tune_pruner="none",
        train_steps=10,
        steps_per_loop=10,
        eval_every=10,
    )
    summary = tune.tune(config, one_device)
    assert (summary["trials"], summary["complete"]) == (1, 1)
    files = sorted(
        os.path.relpath(os.path.join(root, name), workdir) for root, _, names in os.walk(workdir) for name in names
    )
    assert "trials/0/summary.json" in files and "study.db" in files
    assert [name for name in files if "lock" in name] == []
