"""A run's checked Config: validate() for one built from flags, from_json() and load_run_config() for the one a
run saved, for_evaluation() for the one that evaluates a trained run; and the checks that need this machine.

Every setting is declared in engine/settings/fields.py (the engine's) or in the file of the model, task, source or
action that owns it (engine/settings/declared.py finds them); the checks that need neither TensorFlow nor this
machine are engine/settings/checks.py's, by section; engine/settings/identity.py says which saved settings are a
run's identity. Whether a run fits its device's memory is judged once its data is known (engine/run/memory.py).
No TensorFlow on this module's import path: launch.py reads it before TensorFlow starts.
"""

import dataclasses
import json
import os

from engine.settings import checks, plugins
from engine.settings.checks import fail
from engine.settings.errors import ConfigError, counted
from engine.settings.fields import (
    DECLARATION_ERRORS,
    LOCAL_TASK_BYTES,
    MAX_LOCAL_TASKS,
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
from engine.settings.machine import host_memory_bytes, human_bytes


def validate(config):
    """Raises ConfigError naming the first bad setting; returns the config, an empty --dataset and --model made
    the task's own. The checks run in this order, so a config with two bad settings is refused for the first."""
    if DECLARATION_ERRORS:  # two files declare one setting: every command stops on it, naming both
        raise ConfigError(DECLARATION_ERRORS[0])
    checks.check_choices(config)
    config = checks.check_types(config)
    checks.check_signs(config)
    checks.check_limits(config)
    checks.check_training(config)
    if config.local_workers:
        _check_local_workers(config)
    checks.check_strategy(config)
    config = checks.resolve_task(config)
    checks.check_data(config)
    return config


def first_line(error):
    """The first line of an error's message (a TensorFlow error's own message, without its context)."""
    text = getattr(error, "message", None) or str(error)
    return (text.strip().splitlines() or [type(error).__name__])[0]


# ---- --local_workers: a cluster on this machine, in what it holds ------------------------------------------


def _check_local_workers(config):
    """--local_workers starts a cluster's workers here, whose TF_CONFIG it writes: only to train, with a strategy that
    has workers and no other source of the cluster; every task of its cluster, no more than MAX_LOCAL_TASKS, nor
    than fit in memory."""
    if config.strategy not in ("multi_worker", "parameter_server"):
        fail("local_workers", config.local_workers, "needs --strategy=multi_worker or --strategy=parameter_server")
    if config.mode != "train":  # each task would run the mode alone, and say so alone
        fail("local_workers", config.local_workers, f"starts the workers of a train run, not --mode={config.mode}")
    if config.cluster_resolver not in ("", "tf_config"):
        fail(
            "local_workers",
            config.local_workers,
            f"writes the cluster's TF_CONFIG, which --cluster_resolver={config.cluster_resolver} would not read",
        )
    total = host_memory_bytes()
    limit = max(1, min(MAX_LOCAL_TASKS, total // LOCAL_TASK_BYTES))
    why = (
        f"at most {limit} fit (each is a TensorFlow process of about {human_bytes(LOCAL_TASK_BYTES)}, this machine has "
        f"{human_bytes(total)}; the launcher's cap is {MAX_LOCAL_TASKS})"
    )
    if config.local_workers > limit:
        fail("local_workers", config.local_workers, f"starts {config.local_workers} TensorFlow processes here; {why}")
    if config.strategy == "parameter_server" and 1 + config.local_workers + config.num_ps > limit:
        count = 1 + config.local_workers + config.num_ps
        fail(
            "num_ps",
            config.num_ps,
            f"with --local_workers={config.local_workers} starts {count} TensorFlow processes here (a chief, "
            f"{counted(config.local_workers, 'worker')}, {counted(config.num_ps, 'parameter server')}); {why}",
        )


# ---- A run's saved settings (workdir/config.json) ----------------------------------------------------------------


def from_json(saved, where):
    """A Config from the JSON a run saved, checked like flags; ConfigError `<where>: ...` for anything a flag could
    not hold. Settings this engine no longer has are dropped (a model they changed fails to restore, loudly);
    settings the file lacks take their defaults."""
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
        return validate(Config(**values))
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


def for_evaluation(config, saved, where, given=None):
    """The Config that evaluates or exports the run `saved`: its settings; the command line's execution settings,
    split and eval batch; the command line's EVALUATION_SETTINGS where given. An identity setting given that
    differs from the run's (and matters to its model) is refused: it would rebuild another model than the one
    trained. `given`: the names the command line gave (launch.py knows them); None for a Config handed over as it
    is (a notebook's), whose settings other than their defaults count as given."""
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
            if was_given(name) and value != theirs and applies(name, saved):
                raise ConfigError(
                    f"--{name}={show(value)}: {where} was trained with --{name}={show(theirs)}; drop the flag "
                    "(the run is rebuilt from its config.json)"
                )
            values[name] = theirs
        else:
            values[name] = value
    return validate(Config(**values))
