"""Research workflows: applications of the engine, not part of it.

`tune.py` (--mode=tune) searches hyperparameters with Optuna, each trial a real `engine.run.loop.train` run, over the
search space that `space.py` reads; `ensemble.py` (--mode=ensemble) combines trained runs (and files of other
models' predictions) as their task says. They use the engine and the task protocol like any other program would:
the engine never imports them (config validation reads a search space through `space.py`, which imports no
TensorFlow).
"""

# Each mode's own requirements (requirements-research.txt), imported as the mode starts (launch.py): a missing one is
# one line then, not a traceback after the trials ran or the members predicted (they are imported where used, late).
TOOLS = {"tune": ("optuna", "matplotlib"), "ensemble": ("scipy", "matplotlib")}
