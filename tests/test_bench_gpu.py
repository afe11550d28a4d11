"""bench/gpu.sh and what it runs (bench/gpu_table.py, bench/torch_gpt.py), on the CPU: the whole driver on a tiny
decoder, the table it appends, and the parts a GPU run leans on when a process runs past its time or float16
overflows.

PyTorch comes from bench/pytorch.py's own virtual environment (.venv-torch or BENCH_TORCH_VENV, made on first use);
these tests skip only where it cannot be installed. Speed is never asserted.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from bench import common, gpu_table, pytorch

TINY = [
    "--device=cpu",
    "--layers=1",
    "--dim=16",
    "--heads=2",
    "--sequence_length=16",
    "--batch=4",
    "--steps=3",
    "--warmup_steps=1",
    "--matmul_size=128",
]
PRECISIONS = ["float32", "mixed_bfloat16", "mixed_float16"]


@pytest.fixture(scope="module")
def torch_python():
    try:
        return pytorch.ensure_torch(common.TORCH_VENV)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"PyTorch could not be installed: {e}")


def _cells(line):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@pytest.mark.slow
def test_gpu_sh_appends_every_precisions_row_and_the_matmuls(tmp_path, torch_python):
    """gpu.sh as a GPU machine without a network runs it: a python3 that imports TensorFlow as it is (no venv, no
    pip), PyTorch in a python of its own without PYTHONPATH; every row measured, appended to the file it is given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nearlier sections\n")
    # What a wrapper puts on PYTHONPATH for TensorFlow is not for PyTorch's processes: here, a torch that fails.
    (tmp_path / "tf_site" / "torch").mkdir(parents=True)
    (tmp_path / "tf_site" / "torch" / "__init__.py").write_text("raise ImportError('PYTHONPATH reached PyTorch')\n")
    with open(common.RESULTS, "rb") as f:
        recorded = f.read()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "BENCH_TORCH_PYTHON": torch_python,
        "PYTHONPATH": str(tmp_path / "tf_site"),
    }
    command = ["bash", os.path.join(common.ROOT, "bench", "gpu.sh"), *TINY, f"--results={results}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "installed in" not in proc.stderr  # TensorFlow's python3 used as it is
    assert re.search(r"bench/gpu\.sh: \d+ s in all", proc.stderr)
    with open(common.RESULTS, "rb") as f:
        assert f.read() == recorded  # the real results are not touched

    text = results.read_text()
    assert text.startswith("# Results\n\nearlier sections\n\n## ")
    section = text.split("\n## ", 1)[1]
    assert "--device=cpu" in section.splitlines()[0] and "GPU: none (--device=cpu)" in section
    import tensorflow as tf

    assert f"TensorFlow {tf.__version__}, PyTorch 2." in section
    assert "1 layers, 16 wide, 2 heads, context 16, batch 4, AdamW, 3 steps" in section

    rows = {_cells(line)[0]: _cells(line) for line in section.splitlines() if line.startswith("| ")}
    assert rows["engine"][:3] == ["engine", "PyTorch", "engine ms/step"]  # the header
    torch_side = {"float32": "float32", "mixed_bfloat16": "bfloat16 autocast"}
    torch_side["mixed_float16"] = "float16 autocast, GradScaler"
    for precision in PRECISIONS:
        cells = rows[precision]
        assert cells[1] == torch_side[precision] and cells[12] == "", cells  # no note: both sides finished
        engine_ms, torch_ms, engine_loss, torch_loss, engine_s, torch_s = map(float, [*cells[2:4], *cells[5:9]])
        assert min(engine_ms, torch_ms, engine_s, torch_s) > 0
        # The ratios of the unrounded numbers, which the cells show to 0.1.
        for ratio, a, b in ((cells[4], engine_ms, torch_ms), (cells[9], engine_s, torch_s)):
            assert (a - 0.05) / (b + 0.05) - 0.005 <= float(ratio.rstrip("x")) <= (a + 0.05) / (b - 0.05) + 0.005
        # The same initial weights, batches and evaluation windows: 3 steps leave the two within rounding.
        assert abs(engine_loss - torch_loss) < 5e-3, cells
        assert cells[10] == "0, 0" and cells[11] in ("true", "false"), cells
    for framework in ("TensorFlow", "PyTorch"):
        (matmul,) = [cells for name, cells in rows.items() if name.startswith(framework + " ")]
        assert all(float(value) > 0 for value in matmul[1:4]) and matmul[4] == "", matmul


def _ends_within(pid, seconds):
    """Whether process `pid` has ended (gone, or a zombie not yet reaped by its new parent) within `seconds`: a SIGKILL
    is delivered when the kernel next schedules the process, so it can read as running a moment after the kill."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_process_past_its_time_is_killed_with_its_children_and_its_row_says_so(tmp_path, monkeypatch):
    """A run that does not finish in its part of the budget costs that part, not the table: it is killed (a child it
    started too) and its cells are empty, with a note."""
    monkeypatch.setattr(gpu_table, "MIN_PROCESS_S", 0)
    child = tmp_path / "child"
    script = f"sleep 60 & echo $! > {child}; wait"
    start = time.monotonic()
    result = gpu_table.attempt("sleeper", lambda t: pytorch.timed(["bash", "-c", script], t), 2.0)
    assert result == {"error": "did not finish in 2 s"} and time.monotonic() - start < 30
    assert _ends_within(int(child.read_text()), 10.0)  # the child too: its sleep had 58 s to go

    theirs = {"wall": 20.0, "step_ms": 22.3, "loss": 2.5, "skipped": 0}
    cells = _cells(gpu_table.row("mixed_bfloat16", result, theirs))
    assert cells[2:5] == ["-", "22.3", "-"] and cells[5:8] == ["-", "2.5000", "-"] and cells[9] == "-"
    assert cells[10] == "-, 0" and cells[12] == "engine did not finish in 2 s"
    not_started = gpu_table.attempt("late", lambda t: pytest.fail("started"), -3.0)
    assert not_started == {"error": "not run: 0 s of the budget left"}


def test_the_budget_shares_what_is_left_among_the_processes_still_to_start(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(gpu_table.time, "monotonic", lambda: clock[0])
    budget = gpu_table.Budget(90, 3)
    assert budget.share() == 30  # a third of 90
    clock[0] = 10.0  # the first took 10 of its 30 s: the rest share 80
    assert budget.share() == 40
    clock[0] = 50.0
    assert budget.share() == 40  # the last has all that is left


def test_pytorch_float16_skips_and_counts_the_steps_whose_scaled_gradients_overflow(torch_python):
    """bench/torch_gpt.py's train with float16 autocast on the CPU: a loss scale far too high overflows the float16
    gradients, GradScaler halves it at each such step and AdamW does not count it; the skipped steps reported are
    those halvings. The same with the fused AdamW a GPU runs (which masks a skipped step on the device instead of
    not being called): the same count, the same weights after."""
    script = """
import json, torch
from bench import torch_gpt
plain = torch_gpt.optimizer
recipe = dict(learning_rate=1e-2, beta_1=0.9, beta_2=0.99, epsilon=1e-8, weight_decay=0.1, warmup_steps=2,
              lr_schedule="cosine", train_steps=20, clip_norm=1.0, initial_loss_scale=2.0**24,
              loss_scale_growth_interval=1000)
for fused in (False, True):
    torch_gpt.optimizer = lambda model, recipe, fused, chosen=fused: plain(model, recipe, chosen)
    torch.manual_seed(0)
    model = torch_gpt.GPT(vocabulary=11, sequence_length=8, layers=1, heads=2, dim=16)
    batches = torch.randint(0, 11, (1, 4, 9)).repeat(20, 1, 1)  # one batch again and again: its loss falls
    first, last, times, skipped, scale = torch_gpt.train(model, recipe, batches, torch.float16)
    print(json.dumps(dict(first=first, last=last, steps=len(times), skipped=skipped, scale=scale)))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [torch_python, "-c", script], cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, fused = [json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]]
    assert plain["steps"] == 20 and 0 < plain["skipped"] < 20, plain
    assert plain["scale"] == 2.0**24 * 0.5 ** plain["skipped"]  # one halving a skipped step, no growth
    assert plain["last"] < plain["first"] - 0.5  # the steps after them trained
    assert fused["skipped"] == plain["skipped"] and fused["scale"] == plain["scale"]
    assert fused["last"] == pytest.approx(plain["last"], abs=1e-4)


def test_pytorch_leaves_a_short_runs_warm_up_out_of_its_time_a_step(tmp_path, torch_python):
    """bench/torch_gpt.py's median step left out the first 20 steps only: a run of 20 steps or fewer (the tiny
    table's 3) counted its warm-up steps, as the engine's summary, leaving out its first round, does not."""
    import numpy as np

    recipe = dict(seed=0, vocabulary=11, sequence_length=8, layers=1, heads=2, dim=16, learning_rate=1e-3, beta_1=0.9)
    recipe.update(beta_2=0.999, epsilon=1e-8, weight_decay=0.0, warmup_steps=0, lr_schedule="constant")
    recipe.update(clip_norm=0.0, initial_loss_scale=2.0**15, loss_scale_growth_interval=2000, eval_batch_size=2)
    recipe.update(train_steps=4)
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    np.savez(tmp_path / "weights.npz")
    tokens = np.random.default_rng(0).integers(0, 11, (4, 2, 9))
    np.save(tmp_path / "batches.npy", tokens)
    np.save(tmp_path / "eval_tokens.npy", tokens[0])
    np.save(tmp_path / "eval_weights.npy", np.full(2, 8, np.float32))
    script = """
import sys
from bench import torch_gpt
torch_gpt.load_weights = lambda model, weights: None  # the model's own initial weights
data = sys.argv[1]
for times in ([0.5, 0.3, 0.01, 0.01], [0.5, 0.01], [0.5]):  # warm-up steps of 0.5 and 0.3 s, then of 10 ms
    torch_gpt.StepClock.seconds = lambda self, times=times: times
    sys.argv = ["torch_gpt.py", "--data=" + data, "--device=cpu"]
    torch_gpt.main()
"""
    proc = subprocess.run(
        [torch_python, "-c", script, str(tmp_path)],
        cwd=common.ROOT,
        env=pytorch.torch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    four, two, one = [json.loads(line)["step_ms"] for line in proc.stdout.strip().splitlines()[-3:]]
    assert four == pytest.approx(10.0)  # it said 155.0: the median of all four
    assert two == pytest.approx(10.0)  # it said 255.0
    assert one is None  # one step, its warm-up: none timed
