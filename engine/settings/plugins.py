"""The plugins of this checkout, found by convention and read by path, never imported here: model families
(models/NAME.py, --model), tasks (tasks/NAME.py, --task), data sources (sources/NAME.py, --dataset), actions
(engine/run/actions/NAME.py, --actions) and research's modes (research/NAME.py, --mode). A file's module-level
literals (its SETTINGS, READS, a task's DATASET, MODEL and ACTIONS) are read from its text, so flags are checked
against the plugins before TensorFlow starts, and the engine imports a plugin only to run it (`member`)."""

import ast
import functools
import importlib
import os
import re
import textwrap
import traceback

from engine.settings.errors import TaskError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
# Each kind: the folder of its files, and the files there that are not plugins of the kind (a protocol, the
# engine's own actions); None where the plugins are named, not found.
FOLDERS = {
    "model": ("models", ()),
    "task": ("tasks", ("base",)),
    "dataset": ("sources", ()),
    "actions": (os.path.join("engine", "run", "actions"), ("base", "builtin")),
    "mode": ("research", None),  # not found by name: the modes research/ adds, below
}
# The modes research/ adds (research/tune.py, research/ensemble.py), after the engine's own (engine/settings/fields.py
# MODES): they need research's requirements, which launch.py imports for them alone.
RESEARCH_MODES = ("tune", "ensemble")


def directory(kind):
    """The folder of a kind's files: "model" -> <checkout>/models."""
    return os.path.join(ROOT, FOLDERS[kind][0])


def names(kind):
    """The plugins of a kind in this checkout, sorted: the .py files of its folder named as identifiers, but
    private ones (_name) and the kind's own files that are no plugin."""
    folder, not_plugins = FOLDERS[kind]
    if not_plugins is None:
        return sorted(RESEARCH_MODES)
    return sorted(
        name[:-3]
        for name in os.listdir(os.path.join(ROOT, folder))
        if name.endswith(".py") and name[:-3].isidentifier() and name[0] != "_" and name[:-3] not in not_plugins
    )


def path(kind, name):
    return os.path.join(directory(kind), f"{name}.py")


# What each kind's file defines for the engine to run, as a message names it.
MEMBERS = {
    "model": ("create", "def create(config, spec, outputs, info) returning the model"),
    "task": ("Task", "class Task(base.Task), the protocol of tasks/base.py"),
    "dataset": ("load", "def load(config, eval_split) returning the Source"),
    "actions": ("Action", "class Action(base.Action), built as Action(config)"),
}


def member(kind, name):
    """What plugin `name` of `kind` defines for the engine to run (MEMBERS: a task file's Task), imported now;
    TaskError naming the file where it defines none."""
    attribute, shape = MEMBERS[kind]
    found = getattr(importlib.import_module(f"{FOLDERS[kind][0].replace(os.sep, '.')}.{name}"), attribute, None)
    if found is None:
        raise TaskError(f"{file(kind, name)}: defines no {attribute}: a {kind} file defines {shape}")
    return found


def file_of(obj):
    """The file that defines `obj`'s class, as a message names it: an action's engine/run/actions/<name>.py."""
    return type(obj).__module__.replace(".", "/") + ".py"


# The lines autograph adds to an error raised inside a traced function, naming the user's code it ran through.
_TRACED_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
# What TensorFlow's error of an op that failed as it ran says before the lines the op was defined at.
_DEFINED_AT = "defined at (most recent call last):"
_STYLE = re.compile(r"\x1b\[[0-9;]*m")  # the bold Keras puts around the cause of an error in a layer
# Engine code a plugin's own line reads through: a setting no file declares is the line that reads it.
_TRANSPARENT = (os.path.join("engine", "settings", "sections.py"),)
# TensorFlow's errors of the machine, not of what a plugin was given: out of memory, a device or a peer lost.
_MACHINE_ERRORS = (
    "ResourceExhaustedError",
    "InternalError",
    "UnavailableError",
    "DeadlineExceededError",
    "AbortedError",
)


def failure(error):
    """The one line for an error a plugin's code raised (`tasks/mine.py:7 in loss: ValueError: oops`): where the
    innermost line of this checkout it came out of is a plugin file's (its own raise, or a library it called
    raising, TensorFlow too: a file its load could not read); None for an error of the engine's own code, of
    TensorFlow's runtime as the engine ran a step (a file that cannot be read), or of the machine wherever it came
    from (a device out of memory, a peer lost), which keep their traceback. A step's function is traced: its lines
    are those autograph writes into the message, or, for an op of it that failed as it ran, those TensorFlow names it
    defined at (_ran)."""
    # TensorFlow's own errors are its runtime's, read by their Python frames alone (a source's load reading a file
    # that is not there is its line; a step's op, the engine's that ran it), but for autograph's: the wrappers of
    # what a traced function's user code raised (StagingError, MultilineMessageKeyError: a KeyError of a feature the
    # batch lacks), its lines in their message; and an op's InvalidArgumentError (a plugin's tf.debugging.assert_*
    # that failed at a step).
    module = type(error).__module__
    ran = _ran(error)
    runtime = module.startswith("tensorflow") and not module.startswith("tensorflow.python.autograph") and ran is None
    if runtime and type(error).__name__ in _MACHINE_ERRORS:  # a traceback and exit 1, from a plugin's line too
        return None
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(error.__traceback__)]
    message = str(error)
    traced = list(_TRACED_LINE.finditer(message)) if message.startswith("in user code:") and not runtime else []
    frames += _innermost_mapped([(m.group(1), int(m.group(2)), m.group(3)) for m in ran or traced])
    ours = [f for f in frames if _relative(f[0]) and _relative(f[0]) not in _TRANSPARENT]
    if not ours or not _is_plugin(ours[-1][0]):
        return None
    path, line, name = ours[-1]
    if ran:  # after the last line the op was defined at: what it said as it ran, then the node it names ("[[...")
        told = [t.strip() for t in message[ran[-1].end() :].splitlines()[1:] if t.strip()[:2] not in ("", "[[")]
        text = f"{type(error).__name__}: {told[0] if told else ''}"
    elif traced:  # after the last frame and its line of code: the error as it was raised, "Type: message"
        text = textwrap.dedent("\n".join(message[traced[-1].end() :].split("\n")[2:]))
    else:
        text = f"{type(error).__name__}: {message}"
    lines = [_STYLE.sub("", line).strip() for line in text.splitlines() if line.strip()]
    said = lines[0] if lines else type(error).__name__
    if len(lines) > 1 and (said.endswith(":") or "Exception encountered when calling" in said):
        said = f"{said} {lines[1]}"  # Keras's first line names the layer; its second, what went wrong
    return f"{_relative(path)}:{line} in {name}: {said}"


def _innermost_mapped(frames):
    """`frames` as autograph lists them, with its innermost one mapped where autograph could not: a function defined
    inside a converted one (a loss written inside replica_step) runs from its parent's generated file, which autograph
    lists unmapped, innermost, and maps to the function's own line among the outer frames instead."""
    if not frames or not os.path.basename(frames[-1][0]).startswith("__autograph_generated_file"):
        return frames
    named = [f for f in frames[:-1] if f[2] == frames[-1][2] and _relative(f[0])]
    return [*frames, named[-1]] if named else frames


def _ran(error):
    """The lines (_TRACED_LINE matches) TensorFlow names where an op that failed as it ran was defined, for an
    InvalidArgumentError: what the code asked of its tensors (an assertion, an index, a shape) that did not hold.
    None for another error: TensorFlow's runtime's own (a device out of memory, a file that cannot be read)."""
    message = str(error)
    defined = message.find(_DEFINED_AT)
    if type(error).__name__ != "InvalidArgumentError" or defined < 0:
        return None
    return list(_TRACED_LINE.finditer(message, defined)) or None


def _relative(path):
    """`path` relative to the checkout, where it is inside it; else None."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else None


def _is_plugin(path):
    """Whether `path` is a plugin file of this checkout: a model, a task (not the protocol, tasks/base.py), a
    source or an action (not the interface or the engine's own)."""
    folder, name = os.path.split(_relative(path) or "")
    return name != "__init__.py" and any(
        folder == FOLDERS[kind][0] and name[:-3] not in FOLDERS[kind][1] for kind in MEMBERS
    )


def file(kind, name):
    """A plugin's file as a message names it, from the checkout: file("task", "gan") -> "tasks/gan.py"."""
    return f"{FOLDERS[kind][0]}/{name}.py".replace(os.sep, "/")


def read_constant(file, name, default):
    """The literal value a module assigns to `name` at its top level, read from its file without importing it
    (no TensorFlow starts), or `default`; ValueError naming the text of one that is no literal."""
    for node in _parsed(file, os.stat(file).st_mtime_ns).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            _refuse_repeated_keys(node.value)
            try:
                return ast.literal_eval(node.value)
            except ValueError:  # Python's message names the node's object, not the text
                raise ValueError(f"{ast.unparse(node.value):.60} (line {node.lineno})") from None
    return default


class RepeatedKey(ValueError):
    """A dict literal that names one key twice: Python keeps the last silently."""


def _refuse_repeated_keys(node):
    """RepeatedKey naming the first key a dict literal (at any depth of `node`) names twice, and both its lines."""
    for found in ast.walk(node):
        if isinstance(found, ast.Dict):
            seen = {}
            for key in found.keys:
                if isinstance(key, ast.Constant) and key.value in seen:
                    raise RepeatedKey(
                        f"names {key.value!r} twice (lines {seen[key.value]} and {key.lineno}): Python keeps the "
                        "second, silently; keep one"
                    )
                if isinstance(key, ast.Constant):
                    seen[key.value] = key.lineno


def file_sources():
    """{source: (its argument, what the argument names)} of the sources that read a user's files, named
    --dataset=<source>:<argument> (folder:PATH): those whose file declares its `ARGUMENT` (one that is not a pair of
    strings, or not a literal, is left out here, and refused by engine/settings/declared.py)."""
    found = {name: _argument(name) for name in names("dataset")}
    return {name: argument for name, argument in found.items() if is_argument(argument)}


def _argument(source):
    """A source's `ARGUMENT`, or None where its file does not parse or writes it as no literal: every command stops
    on that in one line naming the file (engine/settings/declared.py), not in a traceback as the settings load."""
    try:
        return constant("dataset", source, "ARGUMENT", None)
    except (SyntaxError, ValueError, TypeError):
        return None


def is_argument(argument):
    """Whether a source's `ARGUMENT` is what --help reads: ("PATH", "what it names")."""
    return isinstance(argument, tuple) and len(argument) == 2 and all(isinstance(s, str) and s for s in argument)


@functools.cache
def _parsed(file, mtime):
    """A plugin file's syntax tree, parsed once for the several literals read of it (a file changed since: again)."""
    with open(file) as f:
        return ast.parse(f.read(), file)


def constant(kind, name, literal, default):
    """`literal` of the plugin `name` of `kind`, read from its file (read_constant)."""
    return read_constant(path(kind, name), literal, default)


def default_model(task):
    """The model --task=task trains when --model is empty: its file's `MODEL`, else mlp."""
    return constant("task", task, "MODEL", "mlp")


def default_dataset(task):
    """The dataset --task=task trains on when --dataset is empty: its file's `DATASET`, else digits."""
    return constant("task", task, "DATASET", "digits")


def task_actions(task):
    """The actions tasks/<task>.py asks for beside the engine's own: its `ACTIONS`."""
    return tuple(constant("task", task, "ACTIONS", ()))


def named_actions(config):
    """The actions a run of `config` adds to the engine's own, in order: --actions, then its task's file's
    `ACTIONS` (each once)."""
    given = [name for name in config.actions.split(",") if name]
    own = task_actions(config.task) if config.task in names("task") else ()
    return list(dict.fromkeys([*given, *own]))
