"""Tasks, one file each: `--task=NAME` loads `tasks/NAME.py` and builds its `Task(config, spec, info)`.

A task says what a batch holds, the per-example loss from the models' outputs, its evaluation metrics
as per-example values (the engine sums them over replicas and workers, with padding weighted 0), how
the means become the reported numbers, the tuning objective and the export signature. `tasks/base.py`
holds the protocol with its defaults; `tasks/classification.py` is the smallest complete task to copy.

Tasks never import the loop and never read flags; the engine knows a task only through this protocol.
A task's own settings are declared in its file as `SETTINGS = {"name": (default, "help")}`, like a model's
(models/__init__.py). This file imports no TensorFlow: flags are checked against it before TensorFlow starts.
"""

import os


def available():
    """The task names `--task` accepts: the files in this directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(
        name[:-3]
        for name in os.listdir(here)
        if name.endswith(".py") and name[:-3].isidentifier() and name[0] != "_" and name != "base.py"
    )


def _declared(name, constant, fallback):
    """The module-level `constant = "..."` of tasks/<name>.py, read from the file (not imported: no TensorFlow
    starts), else `fallback`."""
    import models

    return models.read_constant(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"), constant, fallback
    )


def default_model(name):
    """The model `--task=name` trains when --model is empty: its file's `MODEL`, else mlp."""
    return _declared(name, "MODEL", "mlp")


def default_dataset(name):
    """The dataset `--task=name` trains on when --dataset is empty: its file's `DATASET`, else digits."""
    return _declared(name, "DATASET", "digits")


def declared_actions(name):
    """The actions (engine/run/actions/<name>.py) tasks/<name>.py asks for beside the engine's own: its `ACTIONS`."""
    return tuple(_declared(name, "ACTIONS", ()))
