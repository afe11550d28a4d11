"""The checks of --mode=tune's and --mode=ensemble's settings (declared in research/tune.py and research/ensemble.py)
that their declarations cannot say: each raises ConfigError naming the flag and its value. No TensorFlow here:
launch.py runs them before TensorFlow starts, and tune() and ensemble() again before they write anything."""

import importlib.util
import os
import re

from engine.settings.checks import fail
from engine.settings.fields import FIELD_BY_NAME
from engine.settings.identity import IDENTITY_SETTINGS
from engine.settings.plugins import RESEARCH_MODES
from engine.settings.strategy import strategy_plan

# What --mode=ensemble reads of the command line besides its own settings: the splits it fits on and reports on, the
# seed of --ensemble_search=random, where the data and its own files are. A member's model, data and training are its
# config.json's, and it predicts in this process on one device.
ENSEMBLE_READS = ("validation_split", "eval_split", "seed", "data_dir", "workdir", "mode")


def check(config):
    """The mode's own checks, for --mode=tune or --mode=ensemble; nothing for another mode. tune() and ensemble()
    set their own mode first, so a Config handed to them at another --mode (a notebook's) is checked alike."""
    mode = config.mode
    if mode not in RESEARCH_MODES:
        return
    if config.validation_split.split("[")[0] == "test":
        fail("validation_split", config.validation_split, "tuning and ensemble fitting never look at the test split")
    if mode == "tune":
        _check_tune(config)
    if mode == "ensemble":
        _check_ensemble(config)


def _check_tune(config):
    name, said = strategy_plan(config.cluster)
    if name in ("multi_worker", "parameter_server"):  # else each process would run a tuner of its own
        fail(
            "strategy",
            config.strategy,
            f"--mode=tune runs its trials in one process (one_device, mirrored or tpu), not with {said}: on "
            "several machines start one tuner on each, sharing a study through --tune_storage",
        )
    if not config.tune_space:
        fail("tune_space", "", "--mode=tune needs a search-space file, e.g. experiments/digits_mlp.space")
    if not config.tune_study.strip():
        fail("tune_study", config.tune_study, "names the study: give it a name (the default is tune)")
    if config.tune_objective and not re.fullmatch(r"[\w.\-/]+", config.tune_objective):
        fail("tune_objective", config.tune_objective, "must name a metric the task reports (e.g. accuracy, loss)")
    if config.tune_pruner != "none" and not 0 < config.eval_every < config.train_steps:
        fail(
            "eval_every",
            config.eval_every,
            f"--tune_pruner={config.tune_pruner} judges trials by evaluations "
            f"before the end: must be in [1, --train_steps={config.train_steps})",
        )
    if config.tune_sampler == "gp" and importlib.util.find_spec("torch") is None:
        fail("tune_sampler", "gp", "Optuna's Gaussian-process sampler needs PyTorch (pip install torch); or use tpe")


def _check_ensemble(config):
    if len(members(config)) < 2:
        fail("members", config.members, "--mode=ensemble needs at least two comma-separated members")
    seen = {}
    for member in members(config):  # the same workdir or file however it is spelled: m, m/, ./m, a link to it
        first = seen.setdefault(_where(member), member)
        if first != member or members(config).count(member) > 1:
            said = member if first == member else f"{first} (as {member} too)"
            fail("members", config.members, f"names {said} twice: an ensemble of one model with itself")
    if config.validation_split == config.eval_split:
        fail("validation_split", config.validation_split, "must differ from --eval_split, the split it reports on")


def check_given(config, given):
    """For --mode=ensemble: refuses a setting the command line gave (`given`: the names it gave, as launch.py knows
    them) that the ensemble does not read, which would change nothing: each member is rebuilt from its workdir's
    config.json and predicts on one device. A Config handed over as it is (a notebook's, often a train run's) is not
    judged."""
    if config.mode != "ensemble":
        return
    for name in sorted(given):
        if name in ENSEMBLE_READS or FIELD_BY_NAME[name].metadata.get("owner") == ("mode", "ensemble"):
            continue
        if name in IDENTITY_SETTINGS:
            why = "--mode=ensemble rebuilds each member as it trained, from the config.json in its workdir"
        else:
            why = "--mode=ensemble predicts each member in this process, on one device, with the member's own settings"
        fail(name, getattr(config, name), f"{why}, which no flag changes; drop the flag")


def check_searched(config, params, typed):
    """For --mode=tune: refuses a flag typed on the command line (`typed`: the names) that the space (`params`)
    searches: each trial draws its own value, so the typed one changed nothing, silently. A flagfile's value (a
    recipe's, as experiments/digits_resnet.flags under experiments/digits_resnet.space) yields to the space."""
    for param in params:
        if param.name in typed:
            fail(
                param.name,
                getattr(config, param.name),
                f"--tune_space={config.tune_space} searches it: every trial draws its own, which this value would not "
                "change; drop the flag, or its line in the space",
            )


def _where(member):
    """What a --members entry names: a local path resolved (links, '.', a trailing '/'); a URL as it is written."""
    return member.rstrip("/") if "://" in member else os.path.realpath(member)


def members(config):
    """--members as a list of workdirs."""
    return [m for m in config.members.split(",") if m]
