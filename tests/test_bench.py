"""bench/: the quick mode runs every part of the table, and the table judges each number against its target.

Speed is never asserted: a shared machine makes any timing flaky. The smoke test checks only that
every row was measured and is a finite number, so the benchmark cannot rot.
"""

import json
import math
import os
import re

import pytest

from bench import common, end_to_end, rows
from tests import forkserver, helpers

QUICK_ROWS = [
    "speed/mlp_1024",
    "roofline/peak",
    "roofline/mlp_1024",
    "roofline/bfloat16_peak",
    "roofline/mlp_1024/bfloat16",
    "roofline/mlp_1024/matmuls",
    "precision/mlp_1024/mixed_bfloat16",
    "precision/mlp_1024/mixed_float16",
    "mirrored/mlp_1024",
    "overhead/host",
    "overhead/graph",
    "input/mlp_1024",
    "memory/mlp_1024",
    "end_to_end/mlp_1024/float32",
    "end_to_end/mlp_1024/float32/matmuls",
]


@pytest.mark.slow
def test_quick_mode_measures_every_row(tmp_path):
    out = tmp_path / "bench.json"
    result = forkserver.run(
        ["-m", "bench.run", "--quick", f"--json={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads(out.read_text())["rows"]
    assert [row["id"] for row in table] == QUICK_ROWS
    for row in table:
        assert row["result"] in ("not judged", "info"), row  # --quick judges nothing
        assert math.isfinite(row["value"]), row
        assert row["measurement"] in result.stdout and row["shown"] in result.stdout
    measured = {row["id"]: row["value"] for row in table}
    assert measured["roofline/peak"] > 0 and measured["memory/mlp_1024"] > 0
    assert 0 < measured["speed/mlp_1024"] and 0 < measured["mirrored/mlp_1024"]


def _results(engine_vs_fit, peak_rss_engine):
    """Measurements for one model as bench/worker.py reports them, with two numbers chosen by the test, bfloat16's
    step 1.282x float32's, and the mirrored comparison not measured."""
    results = helpers.bench_measurements(engine_vs_fit, peak_rss_engine)
    results["speed"]["models"]["mlp_1024"]["precision_seconds_per_step"]["mixed_bfloat16"] = 0.0078
    results["mirrored"] = {}
    return results


def test_rows_judge_each_number_against_its_target():
    models = {"mlp_1024": common.MODELS["mlp_1024"]}
    table = {row["id"]: row for row in rows.rows(_results(engine_vs_fit=1.41, peak_rss_engine=105), models)}
    assert table["speed/mlp_1024"]["result"] == "PASS" and table["speed/mlp_1024"]["shown"] == "1.41x"
    # 6 x 1000 parameters x 25,600 examples/s = 0.1536 GFLOP/s of a 0.16 GFLOP/s peak.
    assert table["roofline/mlp_1024"]["value"] == pytest.approx(0.96)
    assert table["roofline/mlp_1024"]["result"] == "PASS"
    assert table["roofline/mlp_1024/matmuls"]["value"] == 0.5 and table["roofline/mlp_1024/matmuls"]["result"] == "info"
    assert table["precision/mlp_1024/mixed_bfloat16"]["value"] == pytest.approx(1.282, abs=1e-3)
    assert table["precision/mlp_1024/mixed_bfloat16"]["result"] == "PASS"
    assert table["precision/mlp_1024/mixed_float16"]["result"] == "info"
    assert table["overhead/host"]["value"] == pytest.approx(10.0) and table["overhead/host"]["result"] == "PASS"
    assert table["memory/mlp_1024"]["value"] == pytest.approx(1.05) and table["memory/mlp_1024"]["result"] == "PASS"
    assert table["mirrored/mlp_1024"]["result"] == "ERROR"  # not measured: shown, never hidden

    table = {row["id"]: row for row in rows.rows(_results(engine_vs_fit=1.39, peak_rss_engine=111), models)}
    assert table["speed/mlp_1024"]["result"] == "FALL SHORT"
    assert table["memory/mlp_1024"]["result"] == "FALL SHORT"


def test_end_to_end_rows_take_the_median_ratio_against_the_better_fit_configuration():
    models = {name: common.MODELS[name] for name in ("mlp_256", "mlp_1024")}
    # Per repeat: engine 100, 130, 90 examples/s against fit jit=1 (median 100, the faster configuration): 100, 90, 120.
    row = {
        "engine": [100.0, 130.0, 90.0],
        "fit": {0: [80.0, 100.0, 70.0], 1: [100.0, 90.0, 120.0]},
        "jit_choice": "true (auto: ...)",
    }
    matmuls = {"seconds_per_step": 256 / 120.0, "flops_per_step": 1e9}
    results = {
        "mlp_256": {"float32": row},
        "mlp_1024": {"float32": {**row, "matmuls": matmuls}, "mixed_bfloat16": {"error": "launch.py failed\nboom"}},
    }
    table = {r["id"]: r for r in end_to_end.rows(results, models)}
    assert table["end_to_end/mlp_256/float32"]["value"] == 1.0  # the median of 1.0, 1.44, 0.75
    assert table["end_to_end/mlp_256/float32"]["result"] == "FALL SHORT"  # its target is 1.15x
    assert (
        table["end_to_end/mlp_1024/float32"]["result"] == "PASS"
        and table["end_to_end/mlp_1024/float32"]["shown"] == "1.00x"
    )
    # The engine's median 100 examples/s against its matmuls' 120: 83%, short of 95%.
    share = table["end_to_end/mlp_1024/float32/matmuls"]
    assert share["value"] == pytest.approx(100 / 120) and share["result"] == "FALL SHORT"
    assert table["end_to_end/mlp_1024/mixed_bfloat16"]["result"] == "ERROR"
    assert table["end_to_end/mlp_1024/mixed_bfloat16"]["detail"] == "boom"


def test_end_to_end_pairs_the_engine_with_one_fit_configuration_not_each_repeats_faster_fit():
    """The engine's one process per repeat against the better of fit's two would favour fit: a process's speed
    varies from one to the next. The pairs are with the configuration of the better median."""
    row = {
        "engine": [100.0, 100.0, 100.0],
        "fit": {0: [95.0, 120.0, 95.0], 1: [120.0, 90.0, 90.0]},  # medians 95 and 90: jit=0 is the faster
        "jit_choice": "false (auto: ...)",
    }
    assert end_to_end.paired_ratios(row) == (0, [100 / 95, 100 / 120, 100 / 95])
    table = {
        r["id"]: r for r in end_to_end.rows({"mlp_1024": {"float32": row}}, {"mlp_1024": common.MODELS["mlp_1024"]})
    }
    # Each repeat's faster fit (120, 120, 95) would have given a median of 0.83x and a verdict of FALL SHORT.
    assert table["end_to_end/mlp_1024/float32"]["value"] == pytest.approx(100 / 95)
    assert table["end_to_end/mlp_1024/float32"]["result"] == "PASS"
    assert "(best jit=0)" in table["end_to_end/mlp_1024/float32"]["detail"]


TINY_GPT = dict(gpt_layers=1, gpt_dim=16, gpt_heads=2, sequence_length=16, train_steps=3, global_batch_size=4)


def test_a_fit_window_is_its_steps_not_fits_teardown(monkeypatch):
    """fit's window runs from its first batch to its epoch's end: what fit does after its steps (deleting its
    iterator waited for seconds in some processes) is not its speed, and the engine's rounds leave theirs out too."""
    import time

    from bench import runners

    config = runners.make_config(common.QUICK_MODELS["mlp_256"], precision="float32")
    runner = runners.FitRunner(config, steps_per_execution=5, jit_compile=False)
    runner.window(10)  # traced: the window below is ten tiny steps
    fit = runner.model.fit
    calls = []

    def fit_then_a_slow_teardown(*args, **kwargs):
        history = fit(*args, **kwargs)
        calls.append(kwargs["epochs"])
        time.sleep(8.0)  # after the epoch's end: as the iterator's deletion waited
        return history

    monkeypatch.setattr(runner.model, "fit", fit_then_a_slow_teardown)
    seconds = runner.window(10)
    assert calls == [1] and 0 < seconds < 8.0, seconds  # not the sleep: ten tiny steps, however loaded the machine


def test_pytorch_side_gets_the_engines_initial_weights_batches_and_evaluation(tmp_path):
    """bench/pytorch.py's prepare: what bench/torch_gpt.py starts from is the engine's own run, not a copy."""
    import numpy as np

    from engine.run import inputs
    from engine.settings.config import validate
    from engine.settings.fields import Config

    flags = [f"--{k}={v}" for k, v in TINY_GPT.items()]
    forkserver.run(
        ["-m", "bench.pytorch", f"--prepare={tmp_path}", "--task=language_model", *flags],
        check=True,
        capture_output=True,
        timeout=300,
    )
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert (recipe["layers"], recipe["heads"], recipe["dim"], recipe["vocabulary"]) == (1, 2, 16, 65)
    assert (recipe["train_steps"], recipe["learning_rate"], recipe["beta_2"]) == (3, 1e-3, 0.999)
    weights = np.load(tmp_path / "weights.npz")
    block = ["norm1", "qkv", "proj", "norm2", "mlp_in", "mlp_out"]
    expected = {"embed.weight", "position", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    expected |= {f"blocks.0.{part}.{kind}" for part in block for kind in ("weight", "bias")}
    assert set(weights.files) == expected
    assert weights["blocks.0.mlp_in.weight"].shape == (16, 64)  # Keras's [in, out]: the PyTorch side transposes
    assert weights["position"].shape == (16, 16) and weights["head.weight"].shape == (16, 65)
    assert weights["blocks.0.norm1.weight"].tolist() == [1.0] * 16  # LayerNormalization's gamma starts at 1
    # The batches are the ones the engine's steps gather, in its order.
    batches = np.load(tmp_path / "batches.npy")
    assert batches.shape == (3, 4, 17)
    config = validate(Config(task="language_model", workdir=str(tmp_path / "unused"), **TINY_GPT))
    engine = inputs.run_data(config)
    for k in range(3):
        np.testing.assert_array_equal(batches[k], engine.gather(np.int64(k), 0, 1)["tokens"].numpy())
    # Every validation character is a target exactly once.
    tokens, real = np.load(tmp_path / "eval_tokens.npy"), np.load(tmp_path / "eval_weights.npy")
    assert tokens.shape[1] == 17 and real.sum() == 111_540 and (real > 0).sum() == engine.eval_examples


def test_pytorch_rows_give_the_median_and_range_of_paired_ratios():
    from bench import pytorch

    def side(wall, step_ms, loss):
        return dict(wall=wall, step_ms=step_ms, loss=loss, jit="true")

    pairs = [
        {"engine": side(60.0, 20.0, 1.80), "torch": side(90.0, 40.0, 1.79), "load": 1.0},
        {"engine": side(80.0, 30.0, 1.81), "torch": side(80.0, 30.0, 1.80), "load": 3.0},
        {"engine": side(70.0, 25.0, 1.79), "torch": side(100.0, 25.0, 1.78), "load": 2.0},
    ]
    cells = [c.strip() for c in pytorch.row("shakespeare_char", "float32", pairs).split("|")[1:-1]]
    assert cells[2:6] == ["1.8000", "1.7900", "70.0", "90.0"]
    assert cells[6] == "0.70x (0.67-1.00)"  # the median of 60/90, 80/80, 70/100; not 70/90
    assert cells[7:10] == ["25.0", "30.0", "1.00x (0.50-1.00)"]  # 20/40, 30/30, 25/25
    assert cells[10] == "1.0-3.0"


@pytest.mark.slow  # about 15 s: writes 16 record files and reads them back
def test_resume_quick_reads_each_byte_once_per_epoch_and_restarts_by_arithmetic():
    result = forkserver.run(["-m", "bench.resume", "--quick"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # Each of 1, 2 and 4 pipelines reads its share of the split's bytes: together, each byte once.
    totals = [line.rsplit("(total ", 1)[1] for line in lines if "of the split's bytes in one epoch" in line]
    assert totals == ["1.000)"] * 3
    # Restarting by the files' record counts reads less than an epoch's bytes, near the start and 100,000 steps
    # (8,000 epochs) in: replaying the stream would read every byte before the position.
    split = float(next(line for line in lines if " files x " in line).split("records, ")[1].split(" MiB")[0])
    read = [float(line.split("batch")[1].split("MiB")[0]) for line in lines if line.startswith("files   restart")]
    assert len(read) == 2 and all(0 < r < split for r in read), (read, split)
    # The replay's ratio compares a far restart with a near one.
    far, near = re.search(r"^replay: step ([\d,]+) / step ([\d,]+):", result.stdout, re.M).groups()
    assert int(far.replace(",", "")) > int(near.replace(",", ""))


def test_end_to_end_quick_judges_no_row(monkeypatch, capsys):
    """`python -m bench.end_to_end --quick` times a tiny MLP once, under mlp_1024's name: it printed PASS and FALL
    SHORT against mlp_1024's targets (its matmul share, 10% against >= 95%), as bench.run --quick does not."""
    row = {"engine": [60000.0], "fit": {0: [50000.0]}, "jit_choice": "true (auto: ...)", "input_wait": [0.0]}
    row["matmuls"] = {"seconds_per_step": 32 / 600000.0, "flops_per_step": 1.4e6}
    monkeypatch.setattr(end_to_end, "measure_all", lambda *args, **kwargs: {"mlp_1024": {"float32": row}})
    assert end_to_end.main(["--quick"]) == 0
    printed = capsys.readouterr().out
    assert "PASS" not in printed and "FALL SHORT" not in printed
    assert printed.count("not judged") == 2 and "no row is judged" in printed


def test_end_to_end_row_says_the_input_wait_was_not_timed_where_launch_timed_none():
    """launch.py's summary has input_wait_fraction null on a GPU (and under --deterministic): formatting it as a
    percentage raised a TypeError after every run of the table had been measured."""
    row = {"engine": [120.0], "fit": {0: [100.0], 1: [80.0]}, "jit_choice": "true (auto: ...)", "input_wait": [None]}
    (ratio,) = end_to_end.rows({"resnet": {"float32": row}}, {"resnet": common.MODELS["resnet"]})
    assert ratio["value"] == pytest.approx(1.2) and ratio["result"] == "PASS"
    assert ratio["detail"].endswith(
        "the engine's input wait was not timed (launch.py times it on CPUs only, not under --deterministic)"
    )


def test_end_to_end_quick_runs_the_steps_it_is_given_and_refuses_flags_it_would_ignore(monkeypatch, capsys):
    """--quick ran 40 steps whatever --steps said, and a tiny MLP in float32 whatever --models, --precisions and
    --repeats said, printing the table as if it had run them."""
    ran = []
    monkeypatch.setattr(end_to_end, "measure", lambda name, spec, precision, repeats, steps, *_: ran.append(steps))
    end_to_end.measure_all({"mlp_1024": end_to_end.QUICK}, ["float32"], 1, quick=True, steps=100)
    assert ran == [100]
    for flags in (["--quick", "--models=resnet"], ["--quick", "--precisions=mixed_bfloat16"], ["--repeats=0"]):
        with pytest.raises(SystemExit) as stopped:
            end_to_end.main(flags)
        assert stopped.value.code == 2, flags
    err = capsys.readouterr().err
    assert "--quick measures a tiny MLP in float32 once" in err and "--repeats=0: must be at least 1" in err


def test_machine_names_the_cores_this_process_may_use(monkeypatch):
    """Under taskset or a cgroup's cpuset TensorFlow runs on the cores it may use: the header said the machine's."""
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(common.os, "cpu_count", lambda: 4)
    assert ", 1 of the machine's 4 cores (" in common.machine()


def test_decode_quick_judges_no_row(monkeypatch, capsys):
    """`python -m bench.decode --quick` judged its tiny ResNet-8 step against the pipeline: PASS at 28x."""
    from bench import decode

    speeds = {"local": 3600.0, "service": 650.0}
    results = dict(cores=2, images=24, sides=[48, 96], mean_megapixels=0.01, image_size=32, batch=8)
    results.update(examples_per_sec=speeds, examples_per_sec_per_core={k: v / 2 for k, v in speeds.items()})
    results.update(service_vs_local=650 / 3600, uint8_vs_float32=1.1, bfloat16_vs_float32=0.2)
    results.update(normalise_examples_per_sec={"uint8": 12000.0, "float32": 11000.0, "bfloat16": 2600.0})
    results.update(step={"examples_per_sec": 128.0, "model": "ResNet-8", "batch": 4}, delivered_vs_consumed=28.1)
    monkeypatch.setattr(decode, "measure", lambda quick: results)
    assert decode.main(["--quick"]) == 0
    printed = capsys.readouterr().out
    assert "PASS" not in printed and "FALL SHORT" not in printed
    assert printed.count("not judged") == 1 and "no row is judged" in printed


def test_memory_refuses_an_unknown_recipe_in_one_line(capsys):
    """`python -m bench.memory --recipes=digits-mlp` ended in a KeyError traceback after printing its header."""
    from bench import memory

    with pytest.raises(SystemExit) as stopped:
        memory.main(["--recipes=digits_mlp,digits-mlp"])
    assert stopped.value.code == 2
    printed = capsys.readouterr()
    assert "error: --recipes: unknown digits-mlp; choose from digits_mlp," in printed.err and printed.out == ""


def test_pytorch_rows_and_progress_say_where_a_side_timed_no_step(monkeypatch, capsys):
    """An engine run of one round (--engine_flags="--steps_per_loop=..." as long as the run) times no step: its
    progress line and its row raised KeyError: 'step_ms' after both sides had run."""
    from bench import pytorch

    note = "timed no step: its one round traced and compiled the step (more steps)"
    engine = dict(wall=60.0, loss=1.80, jit="false", skipped=0, note=note)
    theirs = dict(wall=90.0, step_ms=40.0, loss=1.79, skipped=0)
    monkeypatch.setattr(pytorch, "engine_run", lambda *args: dict(engine))
    monkeypatch.setattr(pytorch, "torch_run", lambda *args: dict(theirs))
    pairs = pytorch.measure("shakespeare_char", "float32", "python", "data", 2)
    assert f"engine 60.0 s ({note}, loss 1.8000), PyTorch 90.0 s (40.0 ms/step" in capsys.readouterr().err
    cells = [c.strip() for c in pytorch.row("shakespeare_char", "float32", pairs).split("|")[1:-1]]
    assert cells[4:9] == ["60.0", "90.0", "0.67x (0.67-0.67)", "-", "40.0"]
    assert cells[9] == f"-; engine {note}"


def test_memory_keeps_each_runs_files_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """bench.memory wrote its worker's numbers to /tmp/bench_memory_NAME.json: two runs at once read each other's,
    and one left there by another user stopped the next run (the worker could not write it)."""
    import subprocess
    import tempfile

    from bench import memory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # $TMPDIR, as a user sets it
    seen = []

    def worker(command, **kwargs):  # the worker's command: python -c WORKER OUT FLAGS...
        out, workdir = command[3], command[-1].split("=", 1)[1]
        seen.append((out, workdir))
        with open(out, "w") as f:
            json.dump({"measured": len(seen)}, f)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(memory.subprocess, "run", worker)
    assert [memory.measure("digits_mlp", ["--train_steps=20"])["measured"] for _ in range(2)] == [1, 2]
    (first, first_run), (second, second_run) = seen
    assert os.path.dirname(first) != os.path.dirname(second)
    for out, workdir in seen:
        folder = os.path.dirname(out)
        assert os.path.dirname(folder) == str(tmp_path) and os.path.dirname(workdir) == folder
        assert not os.path.exists(folder)  # removed once read


def test_pytorch_prepares_what_the_engines_flags_change_for_both_sides(monkeypatch, capsys):
    """--engine_flags="--train_steps=40" trained the engine 40 steps and PyTorch the recipe's (prepared without the
    flag): a row of 3.52 against 4.09 in loss, and time ratios of two different runs."""
    from bench import pytorch

    commands = []
    side = dict(wall=1.0, step_ms=1.0, loss=1.0, jit="true", details={"torch": "2"})
    monkeypatch.setattr(pytorch, "timed", lambda command, *args, **kwargs: commands.append(command))
    monkeypatch.setattr(pytorch, "torch_python", lambda venv: "python")
    monkeypatch.setattr(pytorch, "measure", lambda *args: [{"engine": side, "torch": side, "load": 1.0}])
    assert pytorch.main(["--precisions=float32", "--engine_flags=--train_steps=40 --gpt_dim=64"]) == 0
    (prepare,) = commands
    assert prepare[-2:] == ["--train_steps=40", "--gpt_dim=64"]  # after the recipe's flags: they win
