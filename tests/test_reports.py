"""What a user opens after a run: tune_report.png and ensemble_report.png, built from small made-up studies
and ensembles (every axis stays within what the data can reach, ties are said to be ties, the legends
describe what is drawn), and TensorBoard's Profile tab showing a --profile_steps trace."""

import gzip
import itertools
import json
import os
import subprocess
import sys
import time
import urllib.request

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from engine.cluster.launcher import free_ports
from engine.settings.fields import Config
from research import ensemble_report, tune_report, tune_summary
from research.space import Param
from tests.helpers import ROOT, launch

# The MLP's search space (experiments/digits_mlp.space): eight axes, long names.
SPACE = [
    Param("optimizer", "choice", choices=("adamw", "sgd", "lamb")),
    Param("learning_rate", "log", 1e-4, 0.3),
    Param("hidden_sizes", "choice", choices=("64", "256", "64,64", "256,256", "512,512")),
    Param("weight_decay", "log", 1e-5, 0.1),
    Param("warmup_steps", "int", 0, 50),
    Param("global_batch_size", "choice", choices=(32, 64, 128)),
    Param("clip_norm", "choice", choices=(0.0, 1.0)),
    Param("precision", "choice", choices=("float32", "mixed_bfloat16")),
]
DISTRIBUTIONS = {
    p.name: CategoricalDistribution(p.choices)
    if p.kind == "choice"
    else IntDistribution(p.low, p.high)
    if p.kind == "int"
    else FloatDistribution(p.low, p.high, log=p.kind == "log")
    for p in SPACE
}
PARAMS = [  # one draw per trial, cycled
    dict(optimizer="sgd", learning_rate=0.2, hidden_sizes="512,512", weight_decay=2e-5, warmup_steps=40,
         global_batch_size=128, clip_norm=1.0, precision="mixed_bfloat16"),
    dict(optimizer="adamw", learning_rate=3e-4, hidden_sizes="64", weight_decay=1e-3, warmup_steps=0,
         global_batch_size=32, clip_norm=0.0, precision="float32"),
    dict(optimizer="lamb", learning_rate=0.01, hidden_sizes="256,256", weight_decay=0.05, warmup_steps=10,
         global_batch_size=64, clip_norm=1.0, precision="float32"),
]  # fmt: skip
COMPLETE, PRUNED = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED


def make_study(outcomes, direction="maximize"):
    """An in-memory study with one trial per (state, value, {step: intermediate value}); complete ones ran
    150 steps."""
    study = optuna.create_study(direction=direction)
    for (state, value, reports), params in zip(outcomes, itertools.cycle(PARAMS)):
        trial = optuna.trial.create_trial(
            state=state,
            value=value,
            params=params,
            distributions=DISTRIBUTIONS,
            intermediate_values=reports,
            user_attrs={"steps": 150} if state == COMPLETE else {},
        )
        study.add_trial(trial)
    return study


def tune_figure(study, objective=("accuracy", "max")):
    importances = tune_summary.param_importances(study)
    fig = tune_report.figure(Config(), study.get_trials(), SPACE, study.best_trial, importances, *objective)
    fig.draw_without_rendering()  # lays out the text, so extents can be compared
    return fig, {ax.get_label(): ax for ax in fig.axes}, importances


def visible_ticks(axis_limits, ticks):
    low, high = sorted(axis_limits)
    return [t for t in ticks if low <= t <= high]


def overlap(a, b):
    return a.get_window_extent().overlaps(b.get_window_extent())


# Five trials whose three complete ones all reached 0.9833; a pruned one stopped at its only evaluation.
TIED = [
    (COMPLETE, 0.9833, {50: 0.90, 100: 0.95}),
    (PRUNED, None, {50: 0.60}),
    (COMPLETE, 0.9833, {50: 0.93, 100: 0.97}),
    (PRUNED, None, {50: 0.70, 100: 0.80}),
    (COMPLETE, 0.9833, {50: 0.96, 100: 0.98}),
]


def test_tied_trials_are_reported_as_ties():
    fig, axes, importances = tune_figure(make_study(TIED))
    # PED-ANOVA cannot attribute a difference that does not exist: no importance, and the panel says why.
    assert importances == {}
    assert not axes["importance"].patches
    assert "all 3 complete trials reached 0.9833" in " ".join(t.get_text() for t in axes["importance"].texts)
    assert "3 complete trials tied at 0.9833" in fig.get_suptitle()
    # One value, nothing to map to colours: no colour bar inventing a range around it.
    assert "colorbar" not in axes
    # Trials are whole numbers; accuracy stays within [0, 1].
    history = axes["history"]
    ticks = visible_ticks(history.get_xlim(), history.get_xticks())
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    for name in ("history", "curves"):
        low, high = axes[name].get_ylim()
        assert 0 <= low < 0.6 and 0.9833 < high <= 1.0, (name, low, high)


def test_a_loss_objective_is_drawn_on_its_own_scale_and_never_below_zero():
    losses = [
        (COMPLETE, 0.31, {50: 1.2, 100: 0.6}),
        (PRUNED, None, {50: 2.3}),
        (COMPLETE, 0.05, {50: 0.9, 100: 0.2}),
        (COMPLETE, 1.7, {50: 2.1, 100: 1.9}),
    ]
    study = make_study(losses, direction="minimize")
    fig = tune_report.figure(Config(), study.get_trials(), SPACE, study.best_trial, {}, "loss", "min")
    fig.draw_without_rendering()
    axes = {ax.get_label(): ax for ax in fig.axes}
    assert "(min validation loss)" in fig.get_suptitle()
    for name, top in (("history", 2.3), ("curves", 2.3)):
        low, high = axes[name].get_ylim()
        assert low == 0 and high > top, (name, low, high)  # no negative loss; nothing clipped at 1
        assert axes[name].get_ylabel() == "validation loss"
    # The best so far steps down: the lowest loss is the best.
    best_line = [line for line in axes["history"].get_lines() if line.get_label() == "best so far"][0]
    assert list(best_line.get_ydata()) == [0.31, 0.05, 0.05]


def test_curves_are_drawn_as_the_legend_says():
    fig, axes, _ = tune_figure(make_study(TIED))
    curves = axes["curves"]
    legend = {h.get_label().split(" (")[0]: h for h in curves.get_legend().legend_handles}
    assert set(legend) == {"complete", "pruned", "best"}
    drawn = {"complete": [], "pruned": [], "best": []}
    for line in curves.get_lines():
        drawn[line.get_gid()].append(line)
    assert [len(drawn[k]) for k in ("complete", "pruned", "best")] == [2, 2, 1]
    for kind, lines in drawn.items():
        for line in lines:
            for prop in ("color", "linestyle", "marker"):
                assert getattr(line, f"get_{prop}")() == getattr(legend[kind], f"get_{prop}")(), (kind, prop)
    # The pruned trial with a single evaluation still shows the pruned marker, not an anonymous dot.
    single = [line for line in drawn["pruned"] if len(line.get_xdata()) == 1]
    assert len(single) == 1 and single[0].get_marker() == "x"


def test_colour_bar_spans_exactly_the_complete_trials():
    outcomes = [
        (COMPLETE, 0.95, {50: 0.90}),
        (COMPLETE, 0.9833, {50: 0.93}),
        (PRUNED, None, {50: 0.30}),
        (COMPLETE, 0.9611, {50: 0.92}),
        (COMPLETE, 0.9722, {50: 0.91}),
    ] * 2
    fig, axes, importances = tune_figure(make_study(outcomes))
    assert axes["colorbar"].get_ylim() == (0.95, 0.9833)
    assert sum(importances.values()) == pytest.approx(1.0) and len(set(importances.values())) > 1
    widths = sorted(round(bar.get_width(), 9) for bar in axes["importance"].patches)
    assert widths == sorted(round(v, 9) for v in importances.values())
    low, high = axes["importance"].get_xlim()
    assert low == 0 and max(widths) < high <= 1.15 * max(widths)
    ticks = visible_ticks(axes["history"].get_xlim(), axes["history"].get_xticks())
    assert all(float(t).is_integer() for t in ticks) and min(ticks) >= 0 and max(ticks) <= 9


def test_parallel_coordinates_labels_are_readable():
    fig, axes, _ = tune_figure(make_study(TIED))
    coords = axes["coordinates"]
    names = coords.get_xticklabels()
    assert [t.get_text() for t in names] == [p.name for p in SPACE]
    assert all(t.get_rotation() == 0 for t in names)
    for a, b in itertools.combinations(names, 2):
        assert not overlap(a, b), (a.get_text(), b.get_text())
    # Every axis names its ends (and each choice), inside the panel, on a background the lines do not cross.
    labels = [t for t in coords.texts if t.get_text()]
    assert {t.get_text() for t in labels} >= {"adamw", "lamb", "0.0001", "0.3", "0", "50", "32", "128"}
    box = coords.get_window_extent()
    for label in labels:
        extent = label.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, label.get_text()
        assert label.get_bbox_patch() is not None and label.get_zorder() > max(
            line.get_zorder() for line in coords.lines
        )


def scores(accuracy, loss, examples):
    return {"accuracy": accuracy, "loss": loss, "examples": examples}


def member(name, model, weight, val, test):
    return {"name": name, "model": model, "step": 500, "weight": weight, "weights": [], "validation": val, "test": test}


# docs/research.md's real table: three members, the average and the weighted ensemble.
ENSEMBLE = {
    "members": [
        member("runs/ens_mlp", "mlp", 0.0, scores(0.9722, 0.1066, 180), scores(0.9778, 0.0719, 360)),
        member("runs/ens_resnet", "resnet", 0.658, scores(0.9722, 0.0742, 180), scores(0.9778, 0.0684, 360)),
        member("runs/ens_transformer", "transformer", 0.342, scores(0.9722, 0.1404, 180), scores(0.9833, 0.0735, 360)),
    ],
    "average": {"name": "average", "weights": [1 / 3] * 3, "validation": scores(0.9722, 0.0505, 180),
                "test": scores(0.9889, 0.0433, 360)},
    "weighted": {"name": "weighted (nelder_mead)", "chosen": "nelder_mead", "weights": [0.0, 0.658, 0.342],
                 "validation": scores(0.9833, 0.0468, 180), "test": scores(0.9778, 0.0435, 360)},
    "task": "classification",
    "combines": "probabilities",
    "mean": "arithmetic",
    "objective": "accuracy",
    "direction": "max",
    "validation_split": "validation",
    "eval_split": "test",
    "validation_examples": 180,
    "test_examples": 360,
}  # fmt: skip


def test_ensemble_report_bars_start_at_zero_with_loss_and_a_clear_legend():
    fig = ensemble_report.figure(ENSEMBLE)
    fig.draw_without_rendering()
    axes = {ax.get_label(): ax for ax in fig.axes}
    assert {"accuracy", "loss", "weights"} <= set(axes), sorted(axes)
    assert axes["accuracy"].get_title() == "error rate (1 - accuracy), lower is better"
    assert axes["loss"].get_title() == "loss"
    rows = [*ENSEMBLE["members"], ENSEMBLE["average"], ENSEMBLE["weighted"]]
    expected = {
        name: [r[split][name] for split in ("validation", "test") for r in rows] for name in ("accuracy", "loss")
    }
    expected["accuracy"] = [1 - v for v in expected["accuracy"]]  # drawn as the error rate
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert legends
    for name, values in expected.items():
        ax = axes[name]
        heights = [bar.get_height() for bar in ax.patches]
        assert heights == pytest.approx(values)
        # Bars start at 0 so their lengths compare; the top leaves room for the labels and no more.
        low, high = ax.get_ylim()
        assert low == 0 and max(values) < high <= 1.3 * max(values), (name, low, high)
        for legend, bar in itertools.product(legends, ax.patches):
            assert not overlap(legend, bar), name
        top = ax.get_window_extent().y1
        assert all(label.get_window_extent().y1 <= top for label in ax.texts), name
    weights = axes["weights"]
    assert [bar.get_height() for bar in weights.patches] == [0.0, 0.658, 0.342]
    assert weights.get_ylim() == (0, 1)


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)  # TensorBoard gzips its data


def test_the_docs_ensemble_table_is_what_the_ensemble_prints():
    """docs/research.md shows the table of its four commands as --mode=ensemble prints it (its average and weighted
    rows had lost the blank weight column, their numbers four places left of their headings)."""
    with open(os.path.join(ROOT, "docs", "research.md")) as f:
        shown = f.read().split("```\nensemble of ", 1)[1].split("\n```", 1)[0]
    assert "ensemble of " + shown == ensemble_report.table(ENSEMBLE)


@pytest.mark.slow
def test_tensorboard_profile_tab_shows_a_profile_steps_trace(tmp_path):
    workdir = tmp_path / "run"
    proc = launch(
        "--train_steps=4", "--steps_per_loop=1", "--hidden_sizes=32,32", "--profile_steps=1,3", f"--workdir={workdir}"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    port = free_ports(1)[0]
    board = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "tensorboard"),
            f"--logdir={workdir}",
            "--host=127.0.0.1",
            f"--port={port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                plugins = get_json(f"http://127.0.0.1:{port}/data/plugins_listing")
                break
            except OSError:
                assert time.monotonic() < deadline and board.poll() is None, "TensorBoard did not start"
                time.sleep(1)
        # Without tensorboard-plugin-profile the tab is missing: "There's no dashboard by the name of profile".
        assert "profile" in plugins and plugins["profile"]["enabled"] is True, sorted(plugins)
        runs = get_json(f"http://127.0.0.1:{port}/data/plugin/profile/runs")
        assert len(runs) == 1 and runs[0].startswith("profile/"), runs
        tools = get_json(f"http://127.0.0.1:{port}/data/plugin/profile/run_tools?run={runs[0]}")
        assert "trace_viewer@" in tools and "overview_page" in tools, tools
    finally:
        board.terminate()
        board.wait(timeout=30)
