"""The errors a run ends with, in a leaf module: a task, a model, a source or a research workflow imports them
from here without importing the engine's settings, checkpoints or loop. launch.py turns each into its exit code
(README: "Exit codes")."""


class ConfigError(ValueError):
    """Bad user input: the message names the flag (or file) and the value."""


class CheckpointError(RuntimeError):
    """A file of the run (a checkpoint, a log, the summary) could not be written; the message names the path."""
