"""Who reads a setting, and which strategy a run will use, as the checks of engine/settings/config.py judge them.

A setting's readers are declared where it is declared (engine/settings/config.py's `readers=`, a file's SETTINGS, and a
file's READS for a setting another file declares): the identity check and "does this setting apply" read them.
Every refusal that depends on the strategy judges the one the run will use, whatever chose it.
"""

import json
import os
import subprocess
import sys

import pytest

from engine.cluster import distribute
from engine.settings import fields
from engine.settings.config import validate
from engine.settings.declared import declared_settings
from engine.settings.errors import ConfigError
from engine.settings.fields import Config, applies
from engine.settings.flagfiles import check_actions_typed_once
from engine.settings.identity import identity_changes
from engine.settings.strategy import planned_strategy
from engine.state import workdir
from tests.helpers import copy_checkout, launch

PS_CLUSTER = {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}


def _refused(config, message):
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert str(error.value) == message
    return error


@pytest.mark.parametrize(
    "tf_config,overrides,message",
    [
        (
            {"cluster": PS_CLUSTER, "task": {"type": "chief", "index": 0}},
            dict(precision="mixed_float16"),
            "--precision=mixed_float16: is not supported with the parameter_server strategy (TF_CONFIG has a 'ps' "
            "job): asynchronous workers cannot share one dynamic loss scale; use mixed_bfloat16 or float32",
        ),
        (
            None,
            dict(cluster_resolver="tpu"),
            "--tpu=: the tpu strategy (--cluster_resolver=tpu) needs --tpu=NAME_OR_ADDRESS ('local' on a TPU VM)",
        ),
        (
            None,
            dict(cluster_resolver="tpu", tpu="local", precision="mixed_float16"),
            "--precision=mixed_float16: the tpu strategy (--cluster_resolver=tpu) computes in bfloat16, not "
            "float16: use --precision=mixed_bfloat16",
        ),
    ],
)
def test_strategy_refusals_judge_the_strategy_the_run_will_use(monkeypatch, tf_config, overrides, message):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    _refused(Config(**overrides), message)
    # The refusal and the strategy that would be built read one resolution.
    unrefused = Config(**{**overrides, "precision": "float32", "tpu": "local"})
    assert distribute.strategy_name(unrefused.cluster) == planned_strategy(unrefused.cluster)
    assert planned_strategy(unrefused.cluster) in ("parameter_server", "multi_worker", "tpu")


def test_an_explicit_strategy_is_judged_without_reading_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": PS_CLUSTER, "task": {"type": "chief", "index": 0}}))
    config = validate(Config(strategy="one_device", precision="mixed_float16"))
    assert planned_strategy(config.cluster) == "one_device"
    monkeypatch.delenv("TF_CONFIG")
    assert planned_strategy(Config(num_cpu_devices=2).cluster) == "mirrored"
    assert planned_strategy(Config().cluster) is None  # the devices decide: one_device, or mirrored over GPUs


def test_a_source_reading_a_tasks_setting_makes_it_part_of_the_run():
    """Shakespeare reads --sequence_length, which language_model declares: a run of another task on it (a fork's)
    depends on it as much as a language_model run."""
    saved = validate(Config(task="classification", dataset="shakespeare"))
    assert applies("sequence_length", saved)
    assert not applies("sequence_length", validate(Config(task="classification")))
    changed = validate(Config(task="classification", dataset="shakespeare", sequence_length=16))
    assert identity_changes(saved, changed) == [("sequence_length", 64, 16)]
    readers = fields.readers("sequence_length")
    assert readers == {("task", "language_model"), ("dataset", "shakespeare")}


def test_an_actions_own_setting_is_cadence_not_the_runs_identity():
    """--histogram_every says when the histograms action writes, as --actions says whether it does: a run resumed
    with another interval is the same run; its model settings still are identity."""
    saved = validate(Config(actions="histograms", histogram_every=3))
    assert identity_changes(saved, validate(Config(actions="histograms", histogram_every=5))) == []
    changed = validate(Config(actions="histograms", histogram_every=5, hidden_sizes=(16,)))
    assert identity_changes(saved, changed) == [("hidden_sizes", (512, 512), (16,))]


def test_an_old_config_json_resumes_and_is_checked_with_the_readers(tmp_path):
    """A config.json written before the readers were declared (a bool jit_compile, a setting since removed, an
    ignored --image_size, newer settings missing) still resumes, and its identity is judged by what the run reads."""
    saved = {"task": "classification", "dataset": "shakespeare", "model": "mlp", "sequence_length": 64}
    # --image_size was accepted and ignored on a source that does not read it: the run is what it was without it.
    saved.update(jit_compile=False, steps_per_epoch=10, image_size=32)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-10.index").write_bytes(b"")  # it trained: its checkpoints are there
    same = validate(Config(task="classification", dataset="shakespeare", workdir=str(tmp_path)))
    resumed = workdir.check_same_run(same)
    assert (resumed.jit_compile, resumed.image_size, resumed.sequence_length) == ("false", 0, 64)
    with pytest.raises(ConfigError) as error:
        workdir.check_same_run(validate(Config(**{**same.__dict__, "sequence_length": 16})))
    assert "): --sequence_length=64 there, 16 here. Rerun it" in str(error.value)


def _package(root, directory, files):
    os.makedirs(root / directory)
    for name, text in files.items():
        (root / directory / f"{name}.py").write_text(text)
    return str(root / directory), sorted(files)


def test_two_files_declaring_one_setting_are_one_error_naming_both(tmp_path):
    packages = [
        ("model", *_package(tmp_path, "models", {"wide": 'SETTINGS = {"width": (8, "units")}'})),
        ("task", *_package(tmp_path, "tasks", {"clash": 'SETTINGS = {"width": (4, "units")}', "reader": ""})),
        ("dataset", *_package(tmp_path, "sources", {"odd": 'READS = ("no_such",)'})),
    ]
    fields, readers, errors = declared_settings(packages, str(tmp_path), {"dropout"})
    assert [name for name, _, _ in fields] == ["width"] and readers == {}
    assert errors == [
        "tasks/clash.py: declares the setting width, which models/wide.py declares already: rename one of them",
        "sources/odd.py: READS no_such, which no file declares",
    ]


def test_settings_a_flag_could_not_hold_are_one_error_naming_the_file(tmp_path):
    # Each stopped every command with a traceback at `import launch`, or, for the tuple of names, with an error about a
    # flag nobody typed (--st_names=a,b: must be comma-separated integers), naming no file.
    files = {
        "a_expression": "N = 8\nSETTINGS = {'a_size': (N, 'n')}",
        "b_dash": "SETTINGS = {'my-size': (8, 'n')}",
        "c_names": "SETTINGS = {'c_names': (('a', 'b'), 'names')}",
        "d_choices": "SETTINGS = {'d_kind': ('x', 'a name', (10, 20))}",
        "e_help": "SETTINGS = {'e_size': (5, 7)}",
        "f_range": "SETTINGS = {'f_size': (5, 'n', ('1', None))}",
        "f_unbounded_below": "SETTINGS = {'f_width': (8, 'n', (None, 64))}",
        "f_syntax": "def create(config, spec, outputs, info)\n    pass\n",
        "f_x_twice": "SETTINGS = {\n    'f_depth': (8, 'n'),\n    'f_depth': (4, 'n'),\n}",
        "g_good": "SETTINGS = {'g_size': (5, 'n', (1, None)), 'g_kind': ('x', 'k', ('x', 'y')), 'g_dims': ((8,), 'd')}",
    }
    fields, _, errors = _declared_models(tmp_path, files)
    assert sorted(name for name, _, _ in fields) == ["g_dims", "g_kind", "g_size"]
    assert [error.split(":")[0] for error in errors] == [f"models/{name}.py" for name in sorted(files)[:-1]]
    assert errors[0].startswith("models/a_expression.py: SETTINGS must be written as a literal (numbers, strings")
    assert errors[1] == "models/b_dash.py: SETTINGS names 'my-size': a setting's name is a flag's, as resnet_depth"
    assert errors[2].endswith("a tuple default is of integers (a flag's 64,64), not ('a', 'b')")
    assert errors[3].endswith("""a string's choices are a tuple of strings or "required", not (10, 20)""")
    assert errors[4].endswith("its help is 7, not a string")
    assert errors[5].endswith("a range (low, high) of numbers, not ('1', None)")
    assert errors[6] == "models/f_syntax.py: not Python that parses: expected ':' (line 1)"  # not blamed on SETTINGS
    assert errors[7].endswith("a range (low, high) of numbers, not (None, 64)")  # every command failed on it
    # Kept the second silently: the file's author read 8 as the default and --help said 4.
    assert errors[8] == (
        "models/f_x_twice.py: SETTINGS names 'f_depth' twice (lines 2 and 3): Python keeps the second, silently; "
        "keep one"
    )


def _declared_models(tmp_path, files):
    """declared_settings of model files `files` ({module: text}) in a checkout at `tmp_path`."""
    return declared_settings([("model", *_package(tmp_path, "models", files))], str(tmp_path), {"dropout"})


def test_a_default_its_own_checks_refuse_is_one_error_naming_the_file(tmp_path):
    # Each refused every run, of any model or task, as a flag nobody gave: "--h_dims=: must be a list of positive
    # integers", naming no file.
    files = {
        "h_empty": "SETTINGS = {'h_dims': ((), 'd')}",
        "i_zero": "SETTINGS = {'i_size': (0, 'n')}",
        "j_inf": "SETTINGS = {'j_scale': (1e400, 's')}",
        "k_choice": "SETTINGS = {'k_kind': ('gelu', 'k', ('relu', 'tanh'))}",
        "l_range": "SETTINGS = {'l_rate': (-1.0, 'r', (0.0, None)), 'l_frac': (2.0, 'f', (0.0, 1.0))}",
        "m_good": "SETTINGS = {'m_top': (0, 'k', (0, 9)), 'm_opt': ('', 'o', ('', 'a')), 'm_t': (0.0, 't', (0, None))}",
    }
    fields, _, errors = _declared_models(tmp_path, files)
    assert sorted(name for name, _, _ in fields) == ["m_opt", "m_t", "m_top"]
    assert [error.split(":")[0] for error in errors] == [f"models/{name}.py" for name in sorted(files)[:-1]] + [
        "models/l_range.py"
    ]
    assert errors[0].endswith("a tuple default is of positive integers, not ()")
    assert errors[1].endswith("a number's default with no range is positive, not 0")
    assert errors[2].endswith("a number's default with no range is positive, not inf")
    assert errors[3].endswith("its default 'gelu' is none of its choices ('relu', 'tanh')")
    assert errors[4].endswith("its default -1.0 is outside its range (0.0, None)")
    assert errors[5].endswith("its default 2.0 is outside its range (0.0, 1.0)")


def test_a_source_whose_argument_is_not_a_name_and_its_meaning_is_one_error_naming_it(tmp_path):
    sources = {"mine": 'ARGUMENT = "PATH"', "good": 'ARGUMENT = ("GLOB", "record files")'}
    packages = [("dataset", *_package(tmp_path, "sources", sources))]
    _, _, errors = declared_settings(packages, str(tmp_path), {"dropout"})
    assert errors == [
        'sources/mine.py: ARGUMENT must be ("NAME", "what it names"), as ("PATH", "a folder"), not \'PATH\''
    ]


def test_a_tasks_defaults_that_cannot_be_read_are_one_error_each_naming_the_file(tmp_path):
    # Each ended the run that chose the task in a traceback (ast's ValueError; "No module named
    # 'engine.run.actions.h'" for a string ACTIONS; the same for an action that is no file).
    files = {
        "a_inherited": "from tasks import binary\nDATASET = binary.DATASET",
        "b_number": "MODEL = 5",
        "c_string": 'ACTIONS = "histograms"',
        "d_typo": 'ACTIONS = ("histogram",)',
        "e_good": 'DATASET = "spirals"\nMODEL = "mlp"\nACTIONS = ("histograms", "update_ratios")',
    }
    packages = [("task", *_package(tmp_path, "tasks", files))]
    _, _, errors = declared_settings(packages, str(tmp_path), {"dropout"})
    assert errors == [
        "tasks/a_inherited.py: DATASET must be written as a literal (numbers, strings, tuples, dicts), not "
        "binary.DATASET (line 2)",
        'tasks/b_number.py: MODEL must be a name, as "digits" or "mlp", not 5',
        "tasks/c_string.py: ACTIONS must be a tuple of action names, as (\"histograms\",), not 'histograms'",
        "tasks/d_typo.py: ACTIONS names histogram, which is not a file of engine/run/actions/ (histograms, "
        "update_ratios)",
    ]


def test_a_plugin_file_read_before_the_settings_exist_fails_every_command_in_one_line(tmp_path):
    """A source whose ARGUMENT is no literal failed every command as the settings loaded, and a plugin file that
    does not parse failed --help, each in a traceback (rc 1); declared.py has the line that names the file."""
    fork = copy_checkout(tmp_path / "fork")
    cases = {
        "sources/mine.py": (
            'HELP = "a folder"\nARGUMENT = ("PATH", HELP)\n',
            "error: sources/mine.py: ARGUMENT must be written as a literal (numbers, strings, tuples, dicts), not "
            "('PATH', HELP) (line 2)\n",
        ),
        "tasks/mine.py": ("DATASET = \n", "error: tasks/mine.py: not Python that parses: invalid syntax (line 1)\n"),
    }
    for path, (text, said) in cases.items():
        (fork / path).write_text(text)
        for args in (["--help"], [f"--workdir={tmp_path}/work"]):
            result = subprocess.run([sys.executable, "launch.py", *args], cwd=fork, capture_output=True, text=True)
            assert (result.returncode, result.stderr) == (2, said), result.stderr[-2000:]
        (fork / path).unlink()
    assert not (tmp_path / "work").exists()


def test_a_fork_declaring_a_taken_name_fails_as_one_line(tmp_path):
    fork = copy_checkout(tmp_path / "fork")
    (fork / "tasks" / "clash.py").write_text('SETTINGS = {"resnet_depth": (8, "a name models/resnet.py has")}\n')
    result = subprocess.run(
        [sys.executable, "launch.py", f"--workdir={tmp_path}/work"], cwd=fork, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "error: tasks/clash.py: declares the setting resnet_depth, which models/resnet.py declares already: "
        "rename one of them\n"
    )
    assert not (tmp_path / "work").exists()
    # A name absl's own flags take: absl's DuplicateFlagError at `import launch`, a traceback.
    (fork / "tasks" / "clash.py").write_text('SETTINGS = {"log_dir": ("", "where my logs go")}\n')
    result = subprocess.run(
        [sys.executable, "launch.py", f"--workdir={tmp_path}/work"], cwd=fork, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr == (
        "error: tasks/clash.py: declares the setting log_dir, which absl's own flags define: rename it\n"
    ), result.stderr[-2000:]
    # absl's help flags, which app.run defines only as it starts: the same line, not its DuplicateFlagError.
    for name in ("help", "helpshort", "helpxml", "only_check_flags"):
        (fork / "tasks" / "clash.py").write_text(f'SETTINGS = {{"{name}": ("", "a name absl takes")}}\n')
        result = subprocess.run(
            [sys.executable, "launch.py", f"--workdir={tmp_path}/work"], cwd=fork, capture_output=True, text=True
        )
        assert result.returncode == 2 and result.stderr == (
            f"error: tasks/clash.py: declares the setting {name}, which absl's own flags define: rename it\n"
        ), result.stderr[-2000:]
    (fork / "tasks" / "clash.py").write_text('SETTINGS = {"resnet_depth": (8, "a name models/resnet.py has")}\n')
    # --help lists the flags, and says what stops every other command: a help read as healthy would hide it.
    result = subprocess.run([sys.executable, "launch.py", "--help"], cwd=fork, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout.startswith("usage: ")
    assert result.stderr == (
        "error: tasks/clash.py: declares the setting resnet_depth, which models/resnet.py declares already: "
        "rename one of them\n"
    )


def test_actions_typed_twice_on_the_command_line_is_one_line_naming_them_all():
    # Before: absl kept the last --actions, and --actions=histograms --actions=update_ratios ran update_ratios alone.
    check_actions_typed_once(["--flagfile=x.flags", "--actions=histograms", "--train_steps=5"])  # one: fine
    with pytest.raises(ConfigError) as error:
        check_actions_typed_once(["--actions=histograms", "--train_steps=5", "--actions", "update_ratios,histograms"])
    assert str(error.value) == (
        "--actions is given 2 times ('histograms' and 'update_ratios,histograms'): only the last would run; name them "
        "all in one: --actions=histograms,update_ratios"
    )
    result = launch("--actions=histograms", "--actions=update_ratios", "--train_steps=2")
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (
        2,
        "error: --actions is given 2 times ('histograms' and 'update_ratios'): only the last would run; name them all "
        "in one: --actions=histograms,update_ratios",
    )
