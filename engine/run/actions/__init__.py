"""The controller's actions, one file each: base.py (the interface), builtin.py (the engine's own duties), and any
action a fork adds as engine/run/actions/<name>.py, named by --actions=<name>,... or by its task's file
(`ACTIONS = ("<name>",)`), like histograms.py (engine/settings/declared.py finds them by path, before TensorFlow
starts)."""

import importlib

from engine.settings.fields import named_actions


def load(config):
    """The actions a run of `config` adds (engine/settings/fields.py named_actions), each built as
    engine/run/actions/<name>.py's Action(config)."""
    return [importlib.import_module(f"engine.run.actions.{name}").Action(config) for name in named_actions(config)]
