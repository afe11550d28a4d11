"""A run's saved settings (workdir/config.json): which settings are its identity, which only say where and how
it executes, and which values a flag could hold (what a config.json may say).
"""

import dataclasses

from engine.settings.fields import CLUSTER, SAMPLING, Config, Switch, applies

# (The sample_* settings are language_model's own, declared in its file: how a trained run is sampled.)
# Where and how a run executes, not what it computes: a run resumes under other values (another strategy or
# cluster size gives the same numbers, tests/test_parity.py), and evaluation takes them from its own command line.
CLUSTER_SETTINGS = frozenset(CLUSTER)
EXECUTION_SETTINGS = CLUSTER_SETTINGS | frozenset(
    {
        "mode",
        "workdir",
        "checkpoint",
        "export_dir",
        "eval_timeout",
        *SAMPLING,
        "tf_data_service",
        "data_dir",
        "jit_compile",
        "compile_cache",
        "deterministic",
        "run_eagerly",
    }
)
# When things happen and what is logged: never part of a run's identity.
CADENCE_SETTINGS = frozenset(
    {
        "steps_per_loop",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "profile_steps",
        "on_nan",
        "eval_batch_size",
        "save_initial",
        "actions",
    }
)
# Settings an evaluation of a trained run takes from its command line when given there (not the default), else
# from the run; --eval_split and --eval_batch_size always come from the command line (default: the test split).
EVALUATION_SETTINGS = ("data_dir", "global_batch_size", "train_steps")
# The settings that make a run's numbers what they are (model, data, optimizer, schedule, seed, batch,
# precision, the split it reports on): a workdir holds one run, so these never change within it. train_steps is
# handled apart: raising it continues a run.
IDENTITY_SETTINGS = tuple(
    f.name
    for f in dataclasses.fields(Config)
    if f.name not in EXECUTION_SETTINGS | CADENCE_SETTINGS | {"train_steps"}
    # Research's modes' own (--tune_trials: they drive trials) and actions' own (--histogram_every: what an action
    # does after a round, as --actions, which names them, is cadence).
    and f.metadata.get("owner", (None,))[0] not in ("mode", "actions")
)

KINDS = {  # what a config.json value must be, in words, by the type of its setting
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    tuple: "a list of integers",
    Switch: "auto, true or false",
}


def holds(value, kind):
    """Whether a JSON value can be a value of a setting of type `kind`."""
    if kind is Switch:  # an older run saved jit_compile as a JSON bool
        return isinstance(value, bool) or value in Switch.VALUES
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is tuple:
        return isinstance(value, list) and all(holds(v, int) for v in value)
    return isinstance(value, (int, float) if kind is float else kind)


# The training order's settings: identity only where the training split reads them, which its data says once
# loaded (engine/data/datasets.py Data.unread): a split held in memory reads neither, one stream no --interleave_files.
ORDER_SETTINGS = ("shuffle_buffer", "interleave_files")


def identity_changes(saved, config, unread=()):
    """The identity settings that matter to both runs and differ: [(name, value in `saved`, value in `config`)].
    `unread`: settings the run's data does not read (ORDER_SETTINGS), which differ freely."""
    return [
        (name, getattr(saved, name), getattr(config, name))
        for name in IDENTITY_SETTINGS
        if name not in unread
        and getattr(saved, name) != getattr(config, name)
        and applies(name, saved)
        and applies(name, config)
    ]
