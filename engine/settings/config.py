"""A run's checked Config: validate() for one built from flags, from_json() and load_run_config() for the one a
run saved, for_evaluation() for the one that evaluates a trained run.

Every setting is declared in engine/settings/fields.py (the engine's) or in the file of the model, task, source or
action that owns it (engine/settings/declared.py finds them); the checks that need neither TensorFlow nor this
machine are engine/settings/checks.py's, by section, the strategy's (and --local_workers' against this machine's
memory) engine/settings/strategy.py's; engine/settings/identity.py says which saved settings are a
run's identity. Whether a run fits its device's memory is judged once its data is known (engine/run/memory.py).
No TensorFlow on this module's import path: launch.py reads it before TensorFlow starts.
"""

import dataclasses
import json
import os
import sys

from engine.settings import checks, plugins, strategy
from engine.settings.errors import ConfigError
from engine.settings.fields import (
    DECLARATION_ERRORS,
    REFUSED_UNLESS_READ,
    Config,
    applies,
    show,
)
from engine.settings.identity import (
    EVALUATION_SETTINGS,
    IDENTITY_SETTINGS,
    KINDS,
    holds,
)
from engine.settings.unread import read_by


def validate(config, here=True):
    """Raises ConfigError naming the first bad setting; returns the config, an empty --dataset and --model made
    the task's own. The checks run in this order, so a config with two bad settings is refused for the first.
    `here`: False for the settings a run saved, whose strategy and cluster are not judged against this process's
    TF_CONFIG and machine: they were where it ran, and a resume or an evaluation runs on the command line's
    (identity.EXECUTION_SETTINGS)."""
    if DECLARATION_ERRORS:  # two files declare one setting: every command stops on it, naming both
        raise ConfigError(DECLARATION_ERRORS[0])
    checks.check_choices(config)
    config = checks.check_types(config)
    checks.check_signs(config)
    checks.check_limits(config)
    checks.check_training(config)
    if here:
        strategy.check_strategy(config)
    config = checks.resolve_task(config)
    checks.check_data(config)
    return config


def first_line(error):
    """The first line of an error's message (a TensorFlow error's own message, without its context)."""
    text = getattr(error, "message", None) or str(error)
    return (text.strip().splitlines() or [type(error).__name__])[0]


# ---- A run's saved settings (workdir/config.json) ----------------------------------------------------------------


def from_json(saved, where):
    """A Config from the JSON a run saved, checked like flags; ConfigError `<where>: ...` for anything a flag could
    not hold. Settings this engine does not have are dropped (a resume and an evaluation name them:
    engine/state/workdir.py warn_of_unknown_settings); settings the file lacks take their defaults."""
    if not isinstance(saved, dict):
        raise ConfigError(f"{where}: must be a JSON object of settings, not {type(saved).__name__}")
    kinds = {f.name: f.type for f in dataclasses.fields(Config)}
    values = {}
    for name, value in saved.items():
        if name not in kinds:
            continue
        if not holds(value, kinds[name]):
            raise ConfigError(f"{where}: {name}={json.dumps(value)}: must be {KINDS[kinds[name]]}")
        values[name] = tuple(value) if kinds[name] is tuple else float(value) if kinds[name] is float else value
    run = Config(**values)
    if not run.dataset and run.task in plugins.names("task"):
        run = dataclasses.replace(run, dataset=plugins.default_dataset(run.task))
    for name in REFUSED_UNLESS_READ:  # an older engine ignored it there: the run is what it was without it
        if not applies(name, run):
            values.pop(name, None)
    try:
        return validate(Config(**values), here=False)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_run_config(workdir):
    """The Config a train run saved in workdir/config.json (checked like flags), or None when there is none."""
    import tensorflow as tf  # deferred: this module is read before TensorFlow starts

    path = os.path.join(workdir, "config.json")
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path) as f:
            saved = json.loads(f.read())
    except (tf.errors.OpError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({first_line(e)})") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return from_json(saved, path)


class Given(frozenset):
    """The names of the settings a command line gave, of which `typed` were typed; `flagfile`: the others, which a
    flagfile brought."""

    def __new__(cls, names, typed):
        given = super().__new__(cls, names)
        given.flagfile = given - frozenset(typed)
        return given


def for_evaluation(config, saved, where, given=None):
    """The Config that evaluates or exports the run `saved`: its settings; the command line's execution settings,
    split and eval batch; the command line's EVALUATION_SETTINGS where given. An identity setting given that
    differs from the run's (and matters to its model) is refused: it would rebuild another model than the one
    trained; so is one the command line gave that the run does not read (another model's or optimizer's), as
    launch.py refuses it in a train run, and warned of where a flagfile gave it (a recipe reused to evaluate its run).
    `given`: the names the command line gave (a Given: launch.py knows them); None for a Config handed over as it is
    (a notebook's), whose settings other than their defaults count as given."""
    # validate() gave an empty --dataset and --model the command line's task's own: that is none given either.
    default = dataclasses.replace(
        Config(), dataset=plugins.default_dataset(config.task), model=plugins.default_model(config.task)
    )

    def was_given(name):
        return name in given if given is not None else getattr(config, name) != getattr(default, name)

    values = {}
    for field in dataclasses.fields(Config):
        name = field.name
        value, theirs = getattr(config, name), getattr(saved, name)
        if name in ("eval_split", "eval_batch_size"):
            values[name] = value
        elif name == "seed" and config.mode == "sample":  # the draws' seed; the weights come from the checkpoint
            values[name] = value
        elif name in EVALUATION_SETTINGS:
            values[name] = value if was_given(name) else theirs
        elif name in IDENTITY_SETTINGS:
            if given is not None and name in given and not applies(name, saved):  # as launch.py refuses it in train
                said = f"--{name}={show(value)}"
                if name not in getattr(given, "flagfile", ()):
                    raise ConfigError(f"{said}: no part of {where}'s run reads it ({read_by(name)})")
                warning = f"warning: {said} (from a flagfile): no part of {where}'s run reads it ({read_by(name)})"
                print(warning, file=sys.stderr, flush=True)
            if was_given(name) and value != theirs and applies(name, saved):
                raise ConfigError(
                    f"--{name}={show(value)}: {where} was trained with --{name}={show(theirs)}; drop the flag "
                    "(the run is rebuilt from its config.json)"
                )
            values[name] = theirs
        else:
            values[name] = value
    return validate(Config(**values))
