"""The controller's actions, one file each: base.py (the interface), builtin.py (the engine's own duties), and any
action a fork adds as engine/run/actions/<name>.py, named by --actions=<name>,... or by its task's file
(`ACTIONS = ("<name>",)`), like histograms.py (engine/settings/declared.py finds them by path, before TensorFlow
starts)."""

import importlib

from engine.numerics.replica import EXTRAS
from engine.settings.errors import TaskError
from engine.settings.fields import named_actions


def load(config):
    """The actions a run of `config` adds (engine/settings/fields.py named_actions), each built as
    engine/run/actions/<name>.py's Action(config)."""
    return [
        checked(importlib.import_module(f"engine.run.actions.{name}").Action(config), name)
        for name in named_actions(config)
    ]


def checked(action, name):
    """`action` (of engine/run/actions/<name>.py), once what it needs is what a step can return (EXTRAS) and its
    schedule is steps; else TaskError, one line naming the file, before the run writes anything."""
    where = f"engine/run/actions/{name}.py"
    if isinstance(action.needs, str) or not all(isinstance(need, str) for need in action.needs):
        raise TaskError(f"{where}: needs={action.needs!r}: must be a set of names, as needs = {{'gradients'}}")
    unknown = sorted(set(action.needs) - set(EXTRAS))
    if unknown:
        raise TaskError(f"{where}: needs {', '.join(map(repr, unknown))}: a step returns {', '.join(EXTRAS)} alone")
    for value in (action.every, *action.steps):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TaskError(f"{where}: every={action.every!r}, steps={action.steps!r}: must be steps, 0 or more")
    return action
