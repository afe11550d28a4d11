"""The controller's actions, one file each: base.py (the interface), builtin.py (the engine's own duties), and any
action a fork adds as engine/run/actions/<name>.py, named by --actions=<name>,... or by its task's file
(`ACTIONS = ("<name>",)`), like histograms.py (engine/settings/declared.py finds them by path, before TensorFlow
starts)."""

import inspect
import numbers

from engine.numerics.replica import EXTRAS
from engine.run.actions import base
from engine.settings import plugins
from engine.settings.errors import TaskError, check_call
from engine.settings.plugins import named_actions


def load(config):
    """The actions a run of `config` adds (engine/settings/plugins.py named_actions), each built as
    engine/run/actions/<name>.py's Action(config)."""
    return [
        checked(built(plugins.member("actions", name), config.plugin("actions", name), name), name)
        for name in named_actions(config)
    ]


def built(cls, config, name):
    """`cls(config)`; TaskError naming the file where the class takes other arguments."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # none to read: built as it is
        return cls(config)
    try:
        signature.bind(config)
    except TypeError:
        raise TaskError(
            f"{plugins.file('actions', name)}: Action{signature}: the engine builds it as Action(config)"
        ) from None
    return cls(config)


def checked(action, name):
    """`action` (of engine/run/actions/<name>.py), once what it needs is what a step can return (EXTRAS) and its
    schedule is steps; else TaskError, one line naming the file, before the run writes anything."""
    where = plugins.file("actions", name)
    if not isinstance(action, base.Action):  # it would lack the interface's defaults: needs, due, around, close
        raise TaskError(f"{where}: its Action is no engine.run.actions.base.Action: define class Action(base.Action)")
    for method, called_as in (("due", "due(step, stopping)"), ("__call__", "__call__(round, context)")):
        check_call(getattr(action, method), (None, None), where, method, called_as)
    needs, every, steps = action.needs, action.every, action.steps
    if not isinstance(needs, (set, frozenset, list, tuple)) or not all(isinstance(need, str) for need in needs):
        raise TaskError(f"{where}: needs={needs!r}: must be a set of names, as needs = {{'gradients'}}")
    unknown = sorted(set(needs) - set(EXTRAS))
    if unknown:
        raise TaskError(f"{where}: needs {', '.join(map(repr, unknown))}: a step returns only {' and '.join(EXTRAS)}")
    whole = [every, *steps] if isinstance(steps, (list, tuple)) else None
    if whole is None or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in whole):
        raise TaskError(f"{where}: every={every!r}, steps={steps!r}: must be a number of steps and a tuple of steps")
    return action
