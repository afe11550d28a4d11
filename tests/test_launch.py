"""launch.py as a user runs it: the default job end to end, determinism, and bad input."""

import concurrent.futures
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from engine.run import build, compile_cache
from engine.settings.errors import ConfigError
from tests import helpers
from tests.helpers import launch

SUMMARY_KEYS = {
    "step",
    "train_loss",
    "eval",
    "examples_per_sec",
    "input_wait_fraction",
    "input_bytes_read",
    "skipped_steps",
    "loss_scale",
    "wall_seconds",
    "resumed_at",
    "strategy",
    "num_replicas",
    "precision",
    "global_batch_size",
    "class_names",
}
METRIC_KEYS = {
    "step", "loss", "learning_rate", "grad_norm", "loss_scale", "examples_per_sec", "skipped_steps", "traced"
}  # fmt: skip


@pytest.mark.slow
def test_default_job_end_to_end(data_dir, tmp_path):
    """`python launch.py` with nothing but where to write: the bundled digits, the default MLP."""
    result = launch(f"--workdir={tmp_path}", f"--data_dir={data_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert set(summary) == SUMMARY_KEYS
    assert summary["step"] == 1000 and summary["skipped_steps"] == 0
    assert summary["class_names"] == [str(i) for i in range(10)]  # the digits' label names
    assert summary["eval"]["examples"] == 360 and summary["eval"]["accuracy"] >= 0.95
    assert summary["strategy"] == "one_device" and summary["num_replicas"] == 1
    assert summary["loss_scale"] is None and summary["examples_per_sec"] > 0
    # digits: held in memory, so each step gathers its own batch and nothing waits for input
    assert summary["input_wait_fraction"] == 0.0 and summary["input_bytes_read"] is None
    assert " input=in-step jit_compile=" in result.stdout
    assert f"test accuracy {summary['eval']['accuracy']:.4f} on 360 examples" in result.stdout
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(100, 1001, 100))
    assert all(set(r) == METRIC_KEYS for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert sum(line.startswith("train step=") for line in result.stdout.splitlines()) == 10
    for events in ("train", "eval"):
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / events))


@pytest.mark.slow
def test_same_seed_same_losses(data_dir, tmp_path):
    args = [
        f"--data_dir={data_dir}",
        "--deterministic",
        "--seed=3",
        "--train_steps=100",
        "--steps_per_loop=10",
        "--optimizer=sgd",
        "--learning_rate=0.05",
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda d: launch(f"--workdir={tmp_path / d}", *args), ["a", "b"]))
    losses = []
    for run, name in zip(runs, ["a", "b"]):
        assert run.returncode == 0, run.stderr[-3000:]
        losses.append([json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl")])
    assert len(losses[0]) == 10 and losses[0] == losses[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [[], ["--strategy=mirrored", "--num_cpu_devices=2"]], ids=["one", "mirrored"])
def test_compile_cache_serves_the_next_run_of_the_same_program_and_a_resumed_one(data_dir, tmp_path, strategy):
    """--compile_cache: the first run writes its compiled step and evaluation there, in this TensorFlow's and CPU's
    folder; the same flags in another workdir read them back (nothing compiled and written again), and so does that
    run resumed from its checkpoint to train on (it restores before it trains), to the first run's numbers."""
    cache = tmp_path / "cache"
    folder = cache / compile_cache.machine_key()
    args = [f"--data_dir={data_dir}", f"--compile_cache={cache}", "--deterministic", "--steps_per_loop=10"]
    args += ["--jit_compile=true", *strategy]
    entries = []
    for name, steps in (("first", 20), ("second", 10), ("second", 20)):  # the last resumes the second's step 10
        # Fresh processes (an environment other than the fork server's): a forked one's TensorFlow read TF_XLA_FLAGS
        # in the server, before launch.py could set where the cache is.
        workdir = f"--workdir={tmp_path / name}"
        result = launch(workdir, *args, f"--train_steps={steps}", env=helpers.without_xla_cache())
        assert result.returncode == 0, result.stderr[-3000:]
        entries.append({entry.name: entry.stat().st_mtime_ns for entry in folder.iterdir()})
    assert "resumed from step 10" in result.stdout
    assert os.listdir(cache) == [compile_cache.machine_key()]
    assert entries[0] and all(name.startswith("xla_compile_cache__") for name in entries[0]), entries[0]
    assert entries[1] == entries[0]  # the same entries, none written again
    assert entries[2] == entries[0], "the resumed run compiled its step or evaluation again"
    losses = [
        [json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl")] for name in ("first", "second")
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def test_compile_cache_is_keyed_by_the_cpu_and_replaces_a_cache_already_named(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    keys = []
    for flags in ("fpu avx2 fma", "fpu avx2 fma avx512f", "fpu avx2 fma avx512f"):
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: A CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
        keys.append(compile_cache.machine_key(str(cpuinfo)))
    assert keys[0] != keys[1] and keys[1] == keys[2] and keys[0].startswith("tf")
    arm = "processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: {}\n"
    cpuinfo.write_text(arm.format("0xd0c"))  # Arm says which CPU it is in other lines
    neoverse = compile_cache.machine_key(str(cpuinfo))
    cpuinfo.write_text(arm.format("0xd40"))
    assert neoverse != compile_cache.machine_key(str(cpuinfo)) and neoverse not in keys
    with pytest.raises(ConfigError, match="--compile_cache=a b: a path with a space"):
        compile_cache.use("a b", {})
    environ = {"TF_XLA_FLAGS": "--tf_xla_auto_jit=0 --tf_xla_persistent_cache_directory=/elsewhere"}
    folder = compile_cache.use(str(tmp_path / "cache"), environ)
    assert folder == str(tmp_path / "cache" / compile_cache.machine_key()) and os.path.isdir(folder)
    assert environ["TF_XLA_FLAGS"] == f"--tf_xla_auto_jit=0 --tf_xla_persistent_cache_directory={folder}"


def _tf_config(index):
    return json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": index}}
    )


def _ps_tf_config():
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}
    return json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})


BAD_INPUT = [
    (["--strategy=bogus"], {}, "--strategy=bogus"),
    (["--model=nope"], {}, "--model=nope"),
    (["--dataset=no_such_dataset"], {}, "--dataset=no_such_dataset"),
    (["--precision=float8"], {}, "--precision=float8"),
    (["--optimizer=adagrad"], {}, "--optimizer=adagrad"),
    (["--train_steps=0"], {}, "--train_steps=0"),
    (["--learning_rate=-0.1"], {}, "--learning_rate=-0.1"),
    (["--steps_per_loop=-5"], {}, "--steps_per_loop=-5"),
    (["--hidden_sizes=wide"], {}, "--hidden_sizes=wide"),
    (["--no_such_flag=1"], {}, "no_such_flag"),
    (["--strategy=tpu", "--tpu=local"], {}, "--tpu=local"),
    (["--strategy=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": '}, "TF_CONFIG"),
    (["--strategy=multi_worker"], {"TF_CONFIG": _tf_config(5)}, "task index 5"),
    # No --strategy: the 'ps' job makes it a parameter-server job, which float16 cannot train.
    (["--precision=mixed_float16"], {"TF_CONFIG": _ps_tf_config()}, "--precision=mixed_float16: is not supported"),
]


def test_bad_input_one_clear_line(data_dir, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text("earlier run\n")

    def attempt(case):
        args, env, expected = case
        return case, launch(f"--workdir={workdir}", f"--data_dir={data_dir}", *args, env=env, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for (args, _, expected), result in pool.map(attempt, BAD_INPUT):
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert result.returncode == 2, (args, result.stderr[-2000:])
            assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr[-2000:])
            assert expected in lines[0], (args, lines[0])
    assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]
    assert (workdir / "metrics.jsonl").read_text() == "earlier run\n"


def test_a_flag_that_contradicts_a_trained_run_is_refused_even_at_its_default(data_dir, tmp_path):
    # --hidden_sizes=512,512 is the default: taken for "not given", it was ignored and the 8-wide run evaluated, exit 0.
    trained = launch(f"--workdir={tmp_path}", f"--data_dir={data_dir}", "--train_steps=2", "--hidden_sizes=8")
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = launch(f"--workdir={tmp_path}", f"--data_dir={data_dir}", "--mode=export", "--hidden_sizes=512,512")
    assert result.returncode == 2 and result.stderr == (
        f"error: --hidden_sizes=512,512: {tmp_path} was trained with --hidden_sizes=8; drop the flag (the run is "
        "rebuilt from its config.json)\n"
    ), result.stderr[-3000:]
    # A recipe reused to evaluate its run (the run trained with it and a typed --hidden_sizes=8): its defaults are
    # not the user's word against the run.
    recipe = tmp_path.parent / f"{tmp_path.name}.flags"
    recipe.write_text("--model=mlp\n--hidden_sizes=512,512\n--train_steps=1000\n")
    evaluated = launch(f"--workdir={tmp_path}", f"--data_dir={data_dir}", f"--flagfile={recipe}", "--mode=eval")
    assert evaluated.returncode == 0 and "eval step=2 split=test " in evaluated.stdout, evaluated.stderr[-2000:]


def test_a_checkpoint_that_does_not_fit_is_the_last_line(data_dir, tmp_path):
    # TensorFlow warned of each value the refused restore left unrestored as the process ended: 8 to 22 lines after
    # the error line.
    run, bare = tmp_path / "run", tmp_path / "bare"  # bare: the checkpoints alone, no config.json to refuse it by
    trained = launch(f"--workdir={run}", f"--data_dir={data_dir}", "--train_steps=2", "--hidden_sizes=8")
    assert trained.returncode == 0, trained.stderr[-3000:]
    shutil.copytree(run / "checkpoints", bare / "checkpoints")
    for mode in ("train", "eval"):  # a process of its own: the warnings came as it ended
        command = ["launch.py", f"--workdir={bare}", f"--data_dir={data_dir}", f"--mode={mode}", "--hidden_sizes=16"]
        result = subprocess.run([sys.executable, *command], cwd=helpers.ROOT, capture_output=True, text=True)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1, (mode, result.stderr[-3000:])
        assert "does not fit this run: models/model/mlp/dense/bias has shape [8] in the checkpoint and [16]" in lines[0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(global_batch_size=63), "--global_batch_size=63: must be divisible by the number of replicas (2)"),
        (dict(eval_batch_size=7), "--eval_batch_size=7: must be divisible by the number of replicas (2)"),
        (dict(eval_split="nope"), "--eval_split=nope: not a split of digits"),
    ],
)
def test_bad_input_found_with_tensorflow_running(data_dir, mirrored, overrides, message):
    """What only a running TensorFlow can check (replica counts, dataset splits) fails before any training."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        build.run(helpers.make_config(data_dir, **overrides), mirrored)


def test_a_split_tensorflow_datasets_cannot_parse_is_one_line(data_dir, one_device):
    # tfds's own error is two lines (where its format is documented, then the split): the refusal was too.
    with pytest.raises(ConfigError) as refused:
        build.run(helpers.make_config(data_dir, train_split="train["), one_device)
    assert str(refused.value).startswith(
        "--train_split=train[: not a split of digits (splits: train, validation, test;"
    )
    assert "\n" not in str(refused.value), str(refused.value)


def test_an_evaluation_checks_the_batch_it_reads_against_the_replicas(data_dir):
    # An evaluation on 3 devices of a run trained at --global_batch_size=128 was refused over that batch, which it
    # does not read, even with --eval_batch_size=120.
    from engine.settings.checks import check_batch

    check_batch(helpers.make_config(data_dir, global_batch_size=128, eval_batch_size=120), 3, training=False)
    with pytest.raises(ConfigError) as refused:
        check_batch(helpers.make_config(data_dir, global_batch_size=128), 3, training=False)
    assert str(refused.value) == (
        "--global_batch_size=128: must be divisible by the number of replicas (3), as the evaluation's batch (give "
        "--eval_batch_size)"
    )
    with pytest.raises(ConfigError, match=r"^--global_batch_size=128: must be divisible by the number of replicas"):
        check_batch(helpers.make_config(data_dir, global_batch_size=128, eval_batch_size=120), 3)


def exit_code_tables(readme):
    """The first column of each Markdown table in `readme` whose header starts with `exit code`."""
    tables, rows = [], None
    for line in readme.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells and cells[0] == "exit code":
            rows = []
            tables.append(rows)
        elif cells is None:
            rows = None
        elif rows is not None and not set(cells[0]) <= set("-: "):
            rows.append(cells[0])
    return tables


def test_the_readme_has_one_table_of_every_exit_code():
    import launch as launch_module  # defines the flags: imported here, by the tests that need them
    from engine.cluster import signals as preemption
    from engine.cluster.resolvers import NOT_FORMED_EXIT_CODE
    from engine.cluster.signals import LOST_PEER_EXIT_CODE

    with open(os.path.join(helpers.ROOT, "docs", "exit-codes.md")) as f:
        tables = exit_code_tables(f.read())
    for page in set(helpers.DOC_PAGES) - {"docs/exit-codes.md"}:
        with open(os.path.join(helpers.ROOT, page)) as f:
            assert exit_code_tables(f.read()) == [], page  # they point to docs/exit-codes.md: a copy would drift
    assert len(tables) == 1, tables
    # 1: Python's own, for an error of the engine's or TensorFlow's runtime, which keeps its traceback.
    used = {
        0,
        1,
        launch_module.BAD_INPUT,
        launch_module.NON_FINITE,
        launch_module.CANNOT_WRITE,
        launch_module.LOST_PEER,
    }
    used |= {NOT_FORMED_EXIT_CODE, preemption.PREEMPTED_EXIT_CODE, preemption.INTERRUPTED_EXIT_CODE}
    assert LOST_PEER_EXIT_CODE == launch_module.LOST_PEER  # the watcher's own exit, without launch.py
    assert sorted(tables[0], key=lambda code: (not code.isdigit(), int(code) if code.isdigit() else 0)) == [
        *(str(code) for code in sorted(used)),
        "128 + N",
    ]


@pytest.mark.slow
def test_a_damaged_compile_cache_entry_is_set_aside_and_compiled_again(data_dir, tmp_path):
    """Each way an entry can be damaged (garbage, emptied, cut short, two entries swapped) would fail every rerun of
    its program: each is set aside, said in one line, and the run compiles it again, to the first run's numbers."""
    cache = tmp_path / "cache"
    folder = cache / compile_cache.machine_key()
    args = [f"--data_dir={data_dir}", f"--compile_cache={cache}", "--jit_compile=true", "--train_steps=10"]
    args += ["--steps_per_loop=5", "--hidden_sizes=16"]

    def run(name):
        result = launch(f"--workdir={tmp_path / name}", *args, env=helpers.without_xla_cache())
        assert result.returncode == 0, result.stderr[-3000:]
        return result, [json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl")]

    _, losses = run("first")
    entries = sorted(p for p in folder.iterdir() if p.suffix == ".pb")
    assert len(entries) >= 2  # the step's and the evaluation's
    whole = {p: p.read_bytes() for p in entries}
    damages = {
        "garbage": lambda p: p.write_bytes(b"\x00garbage\xff" * 100),
        "empty": lambda p: p.write_bytes(b""),
        "cut_short": lambda p: p.write_bytes(whole[p][: len(whole[p]) // 2]),
        "swapped": lambda p: (p.write_bytes(whole[entries[1]]), entries[1].write_bytes(whole[entries[0]])),
    }
    reasons = {
        "garbage": "not a cache entry: garbage, or cut short",
        "empty": "empty",
        "cut_short": "not a cache entry: garbage, or cut short",
        "swapped": f"it holds the entry {entries[1].name}: files swapped or renamed",
    }
    for name, damaged in damages.items():  # each set aside with its reason, as the run's start does (repair)
        damaged(entries[0])
        said = []
        asides = compile_cache.repair(str(folder), log=said.append)  # swapped: both entries
        assert said[0] == (
            f"--compile_cache: set aside {entries[0].name} ({reasons[name]}) as {os.path.basename(asides[0])}; its "
            "program compiles again"
        ), name
        for aside in asides:
            os.remove(aside)
        for p in entries:
            p.write_bytes(whole[p])
    # A run over a damaged entry (the subtlest: two swapped) sets it aside, compiles again to the first run's numbers
    # and writes the entries whole again.
    damages["swapped"](entries[0])
    result, again = run("swapped")
    said = [line for line in result.stdout.splitlines() if line.startswith("--compile_cache:")]
    assert said[0].startswith(f"--compile_cache: set aside {entries[0].name} ({reasons['swapped']}) as "), said
    assert said[0].endswith("; its program compiles again") and again == losses
    for p in entries:
        assert compile_cache.damage(str(p)) is None


def test_the_last_line_counts_one_step_as_one(capsys):
    """A one-step run's last line read "(1 steps, ...)"."""
    import launch as entry

    config = helpers.make_config("", train_steps=1)
    for step, said in ((1, "1 step"), (2, "2 steps")):
        entry._print_result(config, {"eval": {"accuracy": 0.5, "examples": 360}, "step": step, "wall_seconds": 3.0})
        assert capsys.readouterr().out == f"test accuracy 0.5000 on 360 examples ({said}, 3.0 s)\n"
    # A resumed run's time is this process's: it read "(3000 steps, 8.8 s)" of a run resumed at step 1349.
    result = {"eval": {"accuracy": 0.5, "examples": 360}, "step": 3000, "wall_seconds": 8.8, "resumed_at": 1349}
    entry._print_result(config, result)
    said = capsys.readouterr().out
    assert said == "test accuracy 0.5000 on 360 examples (3000 steps, 8.8 s since it resumed at step 1349)\n"
    entry._print_result(config, {**result, "step": 2, "wall_seconds": 1.0, "resumed_at": 0})  # its step-0 checkpoint
    assert (
        capsys.readouterr().out == "test accuracy 0.5000 on 360 examples (2 steps, 1.0 s since it resumed at step 0)\n"
    )


def test_a_studys_last_line_counts_one_trial_as_one(capsys):
    """A one-trial study's last line read "(1 trials: ...)"."""
    import launch as entry

    config = helpers.make_config("", mode="tune")
    for trials, said in ((1, "1 trial"), (3, "3 trials")):
        result = {"best": None, "trials": trials, "complete": 0, "pruned": trials, "wall_seconds": 2.0}
        entry._print_result(config, result)
        assert capsys.readouterr().out == f"no trial completed ({said}: 0 complete, {trials} pruned; 2.0 s)\n"


def test_an_ensembles_last_line_scores_the_member_best_on_validation(capsys):
    """It named the best of the members' test scores: a member picked by looking at test, which the ensemble never
    does (its weights and its choice among them are validation's)."""
    import launch as entry

    def member(validation, test):
        return {"validation": {"accuracy": validation}, "test": {"accuracy": test}}

    result = {"objective": "accuracy", "direction": "max", "test_examples": 360}
    result.update(weighted={"test": {"accuracy": 0.98}}, average={"test": {"accuracy": 0.97}})
    result["members"] = [member(0.95, 0.99), member(0.96, 0.93), member(0.96, 0.90)]
    entry._print_result(helpers.make_config("", mode="ensemble"), result)
    said = capsys.readouterr().out
    assert said == (
        "test accuracy 0.9800 weighted, 0.9700 average, 0.9300 the member best on validation (3 members, 360 "
        "examples)\n"
    )


def test_an_empty_dataset_or_model_on_eval_is_the_trained_runs_own_not_a_contradiction(monkeypatch):
    """`--mode=sample --dataset=` was refused quoting a value never typed: "--dataset=digits: ... was trained with
    --dataset=shakespeare" (empty is the task's own: the command line's classification's digits)."""
    from absl import flags

    import launch as entry
    from engine.settings.config import for_evaluation

    saved = helpers.make_config("", task="language_model")  # shakespeare, gpt
    try:
        for flag, refused in (("--dataset=", False), ("--model=", False), ("--dataset=digits", True)):
            argv = ["launch.py", "--mode=sample", "--workdir=w", flag]
            monkeypatch.setattr(sys, "argv", argv)
            flags.FLAGS.unparse_flags()
            flags.FLAGS(argv)
            config = entry._config_from_flags()
            if refused:
                with pytest.raises(ConfigError, match="^--dataset=digits: w was trained with --dataset=shakespeare"):
                    for_evaluation(config, saved, "w", entry._given(config))
                continue
            rebuilt = for_evaluation(config, saved, "w", entry._given(config))
            assert (rebuilt.dataset, rebuilt.model) == ("shakespeare", "gpt")
    finally:
        flags.FLAGS.unparse_flags()


@pytest.mark.slow
def test_a_compiled_program_damaged_inside_its_entry_stops_in_one_line_and_the_same_command_compiles_it(
    data_dir, tmp_path
):
    """A block zeroed inside an entry's compiled program (a crash before the file reached the disk) leaves its framing
    whole: the next run failed as TensorFlow loaded it, with a traceback that named no cache, and every rerun again."""
    cache = tmp_path / "cache"
    folder = cache / compile_cache.machine_key()
    args = [f"--data_dir={data_dir}", f"--compile_cache={cache}", "--jit_compile=true", "--train_steps=10"]
    args += ["--steps_per_loop=5", "--hidden_sizes=16"]

    def run(name):
        return launch(f"--workdir={tmp_path / name}", *args, env=helpers.without_xla_cache())

    first = run("first")
    assert first.returncode == 0, first.stderr[-3000:]
    entries = sorted((p for p in folder.iterdir() if p.suffix == ".pb"), key=lambda p: p.stat().st_size)
    damaged = bytearray(entries[-1].read_bytes())  # the step's, the largest
    damaged[len(damaged) // 2 : len(damaged) // 2 + 4096] = bytes(4096)
    entries[-1].write_bytes(bytes(damaged))
    assert compile_cache.damage(str(entries[-1])) is None  # its framing whole: not found before TensorFlow loads it
    stopped = run("second")
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    (line,) = stopped.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"error: --compile_cache={cache}: TensorFlow could not load a compiled program read back ")
    assert line.endswith(
        f"a damaged entry; its {len(entries)} entries are set aside, and the same command compiles them again"
    )
    assert "Traceback" not in stopped.stderr
    # Set aside, none read back: the same command compiles them again (as after `repair`, the test above).
    assert not [p for p in folder.iterdir() if p.suffix == ".pb"]
    assert len([p for p in folder.iterdir() if ".pb.damaged-" in p.name]) == len(entries)


@pytest.mark.slow
def test_a_compile_cache_that_cannot_be_written_stops_in_one_line_with_exit_4(data_dir, tmp_path):
    """A full disk under --compile_cache: TensorFlow fails the step it compiled, which ended the run in a traceback of
    TensorFlow's graph, exit 1, its partial entry left behind."""
    cache = tmp_path / "cache"

    def small_disk():  # files may not grow past 20 KiB: the step's compiled program cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    proc = subprocess.run(
        [sys.executable, "launch.py", f"--workdir={tmp_path / 'run'}", f"--data_dir={data_dir}", "--train_steps=5"]
        + [f"--compile_cache={cache}", "--jit_compile=true"],
        cwd=helpers.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **helpers.without_xla_cache()},
        preexec_fn=small_disk,
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --compile_cache={cache}: cannot write a compiled program there (File too large); free space there, "
        "or run without --compile_cache, and run the same command"
    )
    assert os.listdir(cache / compile_cache.machine_key()) == []  # the partial entry removed
