"""--compile_cache: XLA's compiled steps kept on disk, so the next run of the same program skips compiling them.

A run's first round traces its step and XLA compiles it: on the Shakespeare recipe about 4.5 of the first round's
16 s (bench/RESULTS.md). The same command run again (a recipe rerun, the benchmark's repeats, a job restarted from
scratch) compiles the same program again; with a cache it reads the compiled program back. TensorFlow's persistent
compilation cache does the work (TF_XLA_FLAGS=--tf_xla_persistent_cache_directory), keyed by the program and the
traced function's name: another model, batch or setting compiles anew, and a changed one is never served a stale
program. A traced function's name counts the functions traced before it in the process, and a resumed run restores
its checkpoint (and may evaluate) before it trains: so with a cache the round's loop and the evaluation are traced
first, before anything is restored (Trainer.trace), and a resumed run reads back what its first run compiled
(before that, a run stopped by SIGTERM at step 10 and resumed wrote a second entry). Not a first run that prepared
its tensorflow-datasets dataset: the preparation traces functions of its own first, so its entries serve no later
run (they compile once more).

No TensorFlow here: TensorFlow reads TF_XLA_FLAGS once, at its first op, so launch.py calls `use` before it starts
TensorFlow (a program that imports the engine sets TF_XLA_FLAGS itself, before its first op).

The entries go in a folder per TensorFlow version and CPU (its model and instruction sets): a directory on a file
system that machines of several CPU models share never hands one a program compiled for another's instructions.
Programs compiled for a GPU are not keyed by its model: keep one GPU model per directory.

Off unless asked for: TensorFlow fails the op it compiles when it cannot write the entry (a full disk ends the run at
its first step), so the directory belongs on a disk that checkpoints do not fill. An entry is the compiled step,
a few MB; nothing removes old ones.
"""

import hashlib
import importlib.metadata
import os
import platform
import tempfile

from engine.settings.errors import ConfigError

FLAG = "--tf_xla_persistent_cache_directory"
# The lines of /proc/cpuinfo that say which instructions a compiled program may use: x86's model name and flags,
# Arm's implementer, part and features.
CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")
# The distributions TensorFlow is installed as; the first found names the cache's folder.
TENSORFLOW_PACKAGES = ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-macos")


def machine_key(cpuinfo="/proc/cpuinfo"):
    """The folder of this TensorFlow and CPU: `tf<version>-<12 hex digits of the CPU's model name and flags>`."""
    version = "unknown"
    for package in TENSORFLOW_PACKAGES:
        try:
            version = importlib.metadata.version(package)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    described = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                name, _, value = line.partition(":")
                described.setdefault(name.strip(), value.strip())
    except OSError:  # not Linux
        pass
    cpu = [platform.machine(), *(described.get(k, "") for k in CPU_FIELDS)]
    if not any(cpu[1:]):  # no /proc/cpuinfo (macOS, Windows): what Python knows of the processor
        cpu.append(platform.processor())
    return f"tf{version}-{hashlib.sha256(chr(10).join(cpu).encode()).hexdigest()[:12]}"


def use(path, environ=os.environ):
    """Points TensorFlow's compilation cache at `path`/machine_key(), made if missing, replacing any cache directory
    TF_XLA_FLAGS named; returns that folder. ConfigError naming --compile_cache when it cannot be made or written."""
    folder = os.path.join(os.path.abspath(os.path.expanduser(path)), machine_key())
    if any(c.isspace() for c in folder):  # TensorFlow splits TF_XLA_FLAGS at whitespace: it would write elsewhere
        raise ConfigError(f"--compile_cache={path}: a path with a space cannot be passed to TensorFlow ({folder})")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"--compile_cache={path}: cannot write there ({e.strerror or e})") from None
    flags = [flag for flag in environ.get("TF_XLA_FLAGS", "").split() if not flag.startswith(FLAG + "=")]
    environ["TF_XLA_FLAGS"] = " ".join([*flags, f"{FLAG}={folder}"])
    return folder
