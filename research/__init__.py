"""Research workflows: applications of the engine, not part of it.

`tune.py` (--mode=tune) searches hyperparameters with Optuna, each trial a real `engine.run.loop.train` run, over the
search space that `space.py` reads; `ensemble.py` (--mode=ensemble) combines trained runs (and files of other
models' predictions) as their task says. They use the engine and the task protocol like any other program would:
the engine never imports them (config validation reads a search space through `space.py`, which imports no
TensorFlow).
"""


def tools(config):
    """The modules of research's requirements (requirements-research.txt) that a run of `config` will import, late,
    where it uses them: launch.py imports them as the mode starts, so a missing one is one line then, not a traceback
    after the trials ran or the members predicted."""
    if config.mode == "tune":
        return ("optuna", "matplotlib.figure")
    return ("matplotlib.figure", *(("scipy.optimize",) if config.ensemble_search == "nelder_mead" else ()))
