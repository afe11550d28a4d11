"""The errors a run ends with, in a leaf module: a task, a model, a source or a research workflow imports them
from here without importing the engine's settings, checkpoints or loop. launch.py turns each into its exit code
(docs/exit-codes.md)."""

import contextlib
import inspect


class ConfigError(ValueError):
    """Bad user input: the message names the flag (or file) and the value."""


class CheckpointError(RuntimeError):
    """A file of the run (a checkpoint, a log, the summary) could not be written; the message names the path."""


class TaskError(ConfigError):
    """A task's code that cannot run (a custom step's misuse of the primitives, an update's bad setting): the
    message names the task's file, the update or primitive, and what was wrong. A ConfigError: nothing was written."""


class Undefined(TaskError, NotImplementedError):
    """What a run needs of the task protocol (tasks/base.py) and the task does not define: its loss, its model's
    outputs. A NotImplementedError too, as a protocol's missing method is in Python."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss in float32 or bfloat16; float16 steps skipped with the loss scale at
    its floor); the message says where."""


class Preempted(Exception):
    """A signal stopped the run after a checkpoint; `exit_code` tells a scheduler to restart it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def task_error(error):
    """The ConfigError behind `error` (a TaskError: the task's code cannot run; another: bad input it found), or
    None: tracing wraps what a task's code raises in errors of its own (autograph's StagingError), which keep it as
    their cause."""
    while error is not None:
        if isinstance(error, ConfigError):
            return error
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def raising_task_errors():
    """Raises a ConfigError found behind an error inside (task_error) as itself: one line, naming the task's file
    or the input."""
    try:
        yield
    except Exception as e:
        found = task_error(e)
        if found is None:
            raise
        raise found from None


def counted(count, noun, nouns=None):
    """`count` of `noun` as a line says it: "1 worker", "4 workers" (`nouns` where the plural is not noun + s)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def described(value):
    """What a value a fork's code returned is, as a message names it: None, a tuple, a function."""
    return "None" if value is None else f"a {type(value).__name__}"


def check_call(function, arguments, where, name, called_as):
    """TaskError `<where>: <name><its signature> is called as <called_as>` unless `function` takes `arguments`
    positionally; one whose signature cannot be read is called as it is."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*arguments)
    except TypeError:
        raise TaskError(f"{where}: {name}{signature} is called as {called_as}") from None
