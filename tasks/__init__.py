"""Tasks, one file each: `--task=NAME` loads `tasks/NAME.py` and builds its `Task(config, spec, info)`.

A task says what a batch holds, the per-example loss from the models' outputs, its evaluation metrics
as per-example values (the engine sums them over replicas and workers, with padding weighted 0), how
the means become the reported numbers, the tuning objective and the export signature. `tasks/base.py`
holds the protocol with its defaults; `tasks/classification.py` is the smallest complete task to copy.

Tasks never import the loop and never read flags; the engine knows a task only through this protocol.
A task's own settings are declared in its file as `SETTINGS = {"name": (default, "help")}`, like a model's
(models/__init__.py). The engine finds these files by path (engine/settings/plugins.py) and imports one only
to run it.
"""
