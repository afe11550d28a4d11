"""The commands of docs/running.md ("Commands"), run in order in one fresh copy of the repository, and the Markdown of
the README, BUILD.md and the docs/ pages rendered as CommonMark does."""

import json
import os
import re
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest
from markdown_it import MarkdownIt

from tests.helpers import DOC_PAGES, ROOT, bash_blocks

# Training commands run 4 steps in two rounds instead of their own count: each still builds its model, data and
# strategy, trains (the second round resumes the loop), evaluates and writes its summary, which is what the test
# proves of it; how well it trains is the recipes' and the other tests' business.
QUICK_STEPS = 4
QUICK = [f"--train_steps={QUICK_STEPS}", f"--steps_per_loop={QUICK_STEPS // 2}", "--warmup_steps=0"]
BUNDLED = ("digits", "synthetic")  # datasets that need no network


def running_commands():
    """The lines of the first bash block under docs/running.md's '## Commands', as argument lists."""
    with open(os.path.join(ROOT, "docs", "running.md")) as f:
        section = f.read().split("\n## Commands\n", 1)[1]
    return [shlex.split(line, comments=True) for line in bash_blocks(section)[0] if line.strip()]


def flag(args, name, repo):
    """The last value of --name in args or in the flagfiles they name (as absl reads them), else None."""
    value = None
    for arg in args:
        if arg.startswith("--flagfile="):
            with open(os.path.join(repo, arg.split("=", 1)[1])) as f:
                value = flag([line.strip() for line in f if line.startswith("--")], name, repo) or value
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
    return value


def online():
    try:
        socket.create_connection(("storage.googleapis.com", 443), timeout=5).close()
        return True
    except OSError:
        return False


def clone(destination):
    """The repository's files (committed, or new and not ignored) copied as a fresh clone would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):  # a tracked file someone deleted is no longer part of the tree
            os.makedirs(os.path.dirname(os.path.join(destination, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(destination, name))


@pytest.mark.slow
def test_running_commands_succeed_in_order_in_one_clone(tmp_path):
    repo = str(tmp_path / "repo")
    clone(repo)
    commands = running_commands()
    assert len(commands) >= 4 and all(c[:2] == ["python", "launch.py"] for c in commands), commands
    network = online()
    workdirs = []
    for args in commands:
        training = "--help" not in args
        dataset = flag(args, "dataset", repo) or "digits"
        if dataset not in BUNDLED and not network:
            # Without a network the run ends within seconds on a clear error (engine/data/tfds_source.py).
            print(f"skipped without a network: {shlex.join(args)}")
            continue
        command = [sys.executable, *args[1:], *(QUICK if training else [])]
        started, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            command,
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        print(f"{time.monotonic() - started:.1f} s ({seconds:.1f} s of CPU): {shlex.join(command[1:])}")
        assert proc.returncode == 0, (shlex.join(args), proc.stderr[-3000:])
        if not training:
            assert "--workdir" in proc.stdout + proc.stderr
            continue
        assert "test accuracy" in proc.stdout, shlex.join(args)
        workdir = flag(args, "workdir", repo) or "runs/default"
        workdirs.append(workdir)
        with open(os.path.join(repo, workdir, "summary.json")) as f:
            assert json.load(f)["step"] == QUICK_STEPS, shlex.join(args)
    # Runs of different settings in one workdir would resume each other's checkpoints.
    assert len(set(workdirs)) == len(workdirs), workdirs


def fence_problems(name, text):
    """Where a fenced code block, as CommonMark renders it, does not close on a plain ``` line or swallowed
    prose: another fence or a heading inside it."""
    problems = []
    lines = text.splitlines()
    for token in MarkdownIt("commonmark").parse(text):
        if token.type != "fence":
            continue
        start, end = token.map
        if lines[end - 1].rstrip() != "```":
            problems.append(f"{name}:{start + 1}: the block never closes")
        swallowed = [line for line in token.content.splitlines() if line.startswith(("```", "## "))]
        if swallowed:
            problems.append(f"{name}:{start + 1}: the block swallowed {swallowed}")
    return problems


@pytest.mark.parametrize("name", DOC_PAGES)
def test_code_blocks_close_where_they_should(name):
    with open(os.path.join(ROOT, name)) as f:
        assert fence_problems(name, f.read()) == []


def training_commands(text):
    """[(line, args)] of each bash block's `launch.py` commands that train (no --help, --mode train or none), `\\`
    continuations joined, one list per block; not those whose flagfile is not in the repository."""
    blocks = []
    for lines in bash_blocks(text):
        commands = []
        for line in lines:
            if "launch.py" not in line:
                continue
            words = line.split("launch.py", 1)[1].split(";", 1)[0].replace('"', " ")
            args = shlex.split(words, comments=True)
            flagfiles = [a.split("=", 1)[1] for a in args if a.startswith("--flagfile=")]
            if not all(os.path.exists(os.path.join(ROOT, f)) for f in flagfiles):
                continue  # a flagfile a run writes (a study's best.flags): its workdir is the run's to say
            if "--help" in args or flag(args, "mode", ROOT) not in (None, "train") or "..." in args:
                continue
            commands.append((line.strip(), args))
        blocks.append(commands)
    return blocks


@pytest.mark.parametrize("name", DOC_PAGES)
def test_a_pages_commands_pasted_in_order_train_in_workdirs_of_their_own(name):
    """Two training commands of one block that share a workdir: the second is refused as another run's (the first
    one's settings are there), unless it is the same command run again."""
    with open(os.path.join(ROOT, name)) as f:
        blocks = training_commands(f.read())
    for commands in blocks:
        seen = {}
        for line, args in commands:
            workdir = flag(args, "workdir", ROOT) or "runs/default"
            assert seen.setdefault(workdir, args) == args, f"{name}: {line!r} trains in {workdir}, as an earlier line"


@pytest.mark.parametrize("kind", ["model", "task", "dataset"])
def test_the_readmes_layout_names_every_plugin_of_this_checkout(kind):
    """The layout's line for models/, tasks/ and sources/ (with its continuation lines) names each file of the kind
    that --help lists: a plugin added or removed shows in the map."""
    from engine.settings import plugins

    with open(os.path.join(ROOT, "README.md")) as f:
        layout = f.read().split("\n## Layout\n", 1)[1].split("```", 2)[1]
    folder = plugins.FOLDERS[kind][0] + "/"
    lines = layout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(folder))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    named = set(re.findall(r"[a-z_0-9]+", " ".join(lines[start:end])))
    assert set(plugins.names(kind)) - named == set(), folder


def _pins(name):
    """The requirements a requirement file names itself (its -r includes left out), as written."""
    with open(os.path.join(ROOT, name)) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return sorted(line for line in lines if line and not line.startswith("-"))


def test_the_package_extras_pin_what_the_requirement_files_pin():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    assert sorted(project["dependencies"]) == _pins("requirements.txt")
    assert sorted(extras["research"]) == _pins("requirements-research.txt")
    assert sorted(extras["test"]) == _pins("requirements-test.txt")
    assert sorted(extras["gpu"]) == _pins("requirements-gpu.txt")
    assert extras["dev"] == ["tf-training-engine[research,test]"]
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        includes = [line.split()[1] for line in f if line.startswith("-r ")]
    assert includes == ["requirements.txt", "requirements-research.txt", "requirements-test.txt"]
