"""A training run needs nothing of research/'s tools: train, eval, export and sample run where Optuna, SciPy and
Matplotlib are not installed (a fake package of each that fails on import stands first on the path), and a tuning
run there says in one line what to install."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

HIDDEN = ("optuna", "scipy", "matplotlib")


def _launch(tmp_path, *args):
    fake = tmp_path / "hidden"
    for name in HIDDEN:
        (fake / name).mkdir(parents=True, exist_ok=True)
        (fake / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), ROOT]), "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, "launch.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # four TensorFlow processes: about 40 s on 2 cores
def test_train_eval_export_and_sample_run_without_the_research_tools(tmp_path, data_dir):
    workdir = str(tmp_path / "lm")
    run = [
        "--task=language_model",
        "--gpt_layers=1",
        "--gpt_dim=16",
        "--gpt_heads=2",
        "--sequence_length=16",
        "--global_batch_size=8",
        "--train_steps=4",
        "--steps_per_loop=2",
        "--jit_compile=false",
        f"--workdir={workdir}",
    ]
    trained = _launch(tmp_path, *run)
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.splitlines()[-1].startswith("test loss ")
    evaluated = _launch(tmp_path, "--mode=eval", f"--workdir={workdir}")
    assert evaluated.returncode == 0 and "eval step=4" in evaluated.stdout, evaluated.stderr
    exported = _launch(tmp_path, "--mode=export", f"--workdir={workdir}")
    assert exported.returncode == 0 and "exported step 4" in exported.stdout, exported.stderr
    sampled = _launch(tmp_path, "--mode=sample", f"--workdir={workdir}", "--sample_length=8")
    assert sampled.returncode == 0 and "(sampled 8 tokens from step 4" in sampled.stdout, sampled.stderr
    for result in (trained, evaluated, exported, sampled):
        assert not any(f"{name} is not installed" in result.stderr for name in HIDDEN)


def test_a_research_run_without_its_tools_says_so_before_it_starts(tmp_path):
    space = tmp_path / "space"
    space.write_text("learning_rate log 1e-4 1e-1\n")
    tuned = _launch(
        tmp_path, "--mode=tune", f"--tune_space={space}", f"--workdir={tmp_path / 'study'}", "--eval_every=5"
    )
    assert tuned.returncode == 2 and tuned.stderr.splitlines() == [
        "error: --mode=tune needs research's tools: pip install -r requirements-research.txt (optuna is not installed)"
    ]
    # SciPy and Matplotlib are imported where they are used: without them an ensemble ended in a traceback after
    # every member predicted, leaving its files behind.
    members = f"--members={tmp_path / 'a'},{tmp_path / 'b'}"
    combined = _launch(tmp_path, "--mode=ensemble", members, f"--workdir={tmp_path / 'ensemble'}")
    assert combined.returncode == 2 and combined.stderr.splitlines() == [
        "error: --mode=ensemble needs research's tools: pip install -r requirements-research.txt (matplotlib is not "
        "installed)"
    ]
    assert not (tmp_path / "ensemble").exists()
