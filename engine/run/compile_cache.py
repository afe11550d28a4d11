"""--compile_cache: XLA's compiled steps kept on disk, so the next run of the same program skips compiling them.

A run's first round traces its step and XLA compiles it: on the Shakespeare recipe about 4.5 of the first round's
16 s (bench/RESULTS.md). The same command run again (a recipe rerun, the benchmark's repeats, a job restarted from
scratch) compiles the same program again; with a cache it reads the compiled program back. TensorFlow's persistent
compilation cache does the work (TF_XLA_FLAGS=--tf_xla_persistent_cache_directory), keyed by the program and the
traced function's name: another model, batch or setting compiles anew, and a changed one is never served a stale
program. A traced function's name counts the functions traced before it in the process, and a resumed run restores
its checkpoint (and may evaluate) before it trains: so with a cache the round's loop and the evaluation are traced
first, before anything is restored (engine/run/loop.py trace), and a resumed run reads back what its first run compiled
(before that, a run stopped by SIGTERM at step 10 and resumed wrote a second entry). Not a first run that prepared
its tensorflow-datasets dataset: the preparation traces functions of its own first, so its entries serve no later
run (they compile once more).

No TensorFlow here: TensorFlow reads TF_XLA_FLAGS once, at its first op, so launch.py calls `use` before it starts
TensorFlow (a program that imports the engine sets TF_XLA_FLAGS itself, before its first op).

The entries go in a folder per TensorFlow version and CPU (its model and instruction sets): a directory on a file
system that machines of several CPU models share never hands one a program compiled for another's instructions.
Programs compiled for a GPU are not keyed by its model: keep one GPU model per directory.

Off unless asked for: TensorFlow fails the op it compiles when it cannot write the entry (a full disk ends the run at
its first step, in one line naming the cache, exit 4: engine/run/inputs.py), so the directory belongs on a disk that
checkpoints do not fill. An entry is the compiled step,
a few MB; nothing removes old ones.

A damaged entry would fail every rerun of its program (TensorFlow reads it back and stops on DataLossError or
InvalidArgumentError, naming no file, and keeps the failure for the process). TensorFlow 2.21 writes an entry to a
temporary file and renames it, so a kill mid-write leaves no half entry; a crash of the machine (no fsync), a file
system without atomic rename or an interrupted copy can. So every entry is checked before TensorFlow starts (`repair`):
one that is empty, cut short, not an entry at all, or another entry's (two swapped) is set aside under a name
TensorFlow does not read, and its program compiles again, said in one line. Damage inside the compiled program that
leaves the entry's framing whole (a block of it zeroed by a crash) shows only as TensorFlow loads it: that failure
(`unloadable`) stops the run in one line naming the cache, exit 4, its entries set aside (`set_aside`), and the
same command compiles them again.
"""

import functools
import hashlib
import importlib.metadata
import os
import platform
import tempfile
import time

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

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


def folder_of(path):
    """The folder of --compile_cache=`path` that this TensorFlow and CPU read and write (machine_key)."""
    return os.path.join(os.path.abspath(os.path.expanduser(path)), machine_key())


def use(path, environ=os.environ):
    """Points TensorFlow's compilation cache at `path`/machine_key(), made if missing, replacing any cache directory
    TF_XLA_FLAGS named, its damaged entries set aside (repair); returns that folder. ConfigError naming
    --compile_cache when it cannot be made or written."""
    folder = folder_of(path)
    if any(c.isspace() for c in folder):  # TensorFlow splits TF_XLA_FLAGS at whitespace: it would write elsewhere
        raise ConfigError(f"--compile_cache={path}: a path with a space cannot be passed to TensorFlow ({folder})")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"--compile_cache={path}: cannot write there ({e.strerror or e})") from None
    repair(folder)
    flags = [flag for flag in environ.get("TF_XLA_FLAGS", "").split() if not flag.startswith(FLAG + "=")]
    environ["TF_XLA_FLAGS"] = " ".join([*flags, f"{FLAG}={folder}"])
    return folder


@functools.cache
def _entry_class():
    """The message of a cache entry (TensorFlow's XlaSerializedCacheEntry: its key, its HLO module, its executable),
    declared here field for field as TensorFlow's tensorflow/compiler/jit/xla_compilation_cache.proto has it: the
    pip package holds no Python class of it, and reading an entry must not start TensorFlow. The HLO module is
    read as bytes."""
    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="engine_compile_cache.proto", package="engine_compile_cache")
    key = proto.message_type.add(name="Key")
    for number, (name, kind) in enumerate(
        (
            ("signature_fingerprint", field.TYPE_UINT64),
            ("cluster_fingerprint", field.TYPE_UINT64),
            ("device_type", field.TYPE_STRING),
            ("prefix", field.TYPE_STRING),
            ("compiled_using_pjrt", field.TYPE_BOOL),
        ),
        start=1,
    ):
        key.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    entry = proto.message_type.add(name="Entry")
    entry.field.add(
        name="key", number=1, type=field.TYPE_MESSAGE, type_name=".engine_compile_cache.Key", label=field.LABEL_OPTIONAL
    )
    entry.field.add(name="hlo_module", number=2, type=field.TYPE_BYTES, label=field.LABEL_OPTIONAL)
    entry.field.add(name="executable", number=3, type=field.TYPE_BYTES, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("engine_compile_cache.Entry"))


def entry_name(key):
    """The file name TensorFlow gives the entry of `key`: <prefix>__<signature>__<cluster>__<device>[__pjrt].pb."""
    parts = [key.prefix] if key.prefix else []
    parts += [str(key.signature_fingerprint), str(key.cluster_fingerprint), key.device_type]
    return "__".join(parts + (["pjrt"] if key.compiled_using_pjrt else [])) + ".pb"


def damage(path):
    """Why the entry at `path` cannot be read back, in words; None for a whole entry under its own name. Its three
    fields are written in order, each with its length: a file cut anywhere fails to parse or lacks one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    if not data:
        return "empty"
    entry = _entry_class()()
    try:
        entry.ParseFromString(data)
    except DecodeError:
        return "not a cache entry: garbage, or cut short"
    if not (entry.HasField("key") and entry.hlo_module and entry.executable):
        return "cut short"
    if entry_name(entry.key) != os.path.basename(path):
        return f"it holds the entry {entry_name(entry.key)}: files swapped or renamed"
    return None


# What TensorFlow says of an entry it read back and cannot load: its framing whole, the program inside it not.
UNLOADABLE = ("Failed to parse serialized", "Failed to add object file")


def unloadable(message):
    """Whether TensorFlow's error `message` says it could not load a compiled program read back from the cache."""
    return any(said in message for said in UNLOADABLE)


def set_aside(path, why, log=print):
    """Sets aside every entry of the cache --compile_cache=`path` names for this TensorFlow and CPU, which of them
    failed to load being unknown (TensorFlow names the function, not the entry); returns their count."""
    folder = folder_of(path)
    names = [n for n in sorted(os.listdir(folder)) if n.endswith(".pb")] if os.path.isdir(folder) else []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name in names:
        os.replace(os.path.join(folder, name), os.path.join(folder, f"{name}.damaged-{stamp}"))
    log(f"--compile_cache: set aside the {len(names)} entries of {folder} as *.pb.damaged-{stamp} ({why})")
    return len(names)


def repair(folder, log=print):
    """Sets aside every damaged entry in `folder` (renamed to <name>.damaged-<time>, which TensorFlow does not read:
    kept for a look, never deleted), one line each; returns the paths set aside."""
    moved = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        why = damage(path) if name.endswith(".pb") and os.path.isfile(path) else None
        if why:
            aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
            os.replace(path, aside)
            log(f"--compile_cache: set aside {name} ({why}) as {os.path.basename(aside)}; its program compiles again")
            moved.append(aside)
    return moved
