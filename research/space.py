"""The search space of --mode=tune: a text file, one searched flag per line (`#` starts a comment):

    learning_rate   log     1e-4  1e-1      # log-uniform float in [low, high]
    weight_decay    float   0     1e-3      # uniform float
    warmup_steps    int     0     100       # integer in [low, high]
    hidden_sizes    choice  64 128,128      # one of these values, written as after --flag=

No TensorFlow here: engine/settings/config.py's validate reads the file before anything starts, so a bad space fails
before the tuner writes its study.
"""

import dataclasses
import math

from engine.settings.config import validate
from engine.settings.errors import ConfigError
from engine.settings.fields import SELECTORS, Config
from engine.settings.identity import CLUSTER_SETTINGS
from engine.settings.unread import unread

KINDS = ("int", "float", "log", "choice")
# One strategy (and cluster) serves every trial of the process; where trials are scored and written is the tuner's.
NOT_SEARCHABLE = CLUSTER_SETTINGS | {"mode", "workdir", "eval_split", "validation_split", "members"}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS
    low: float = None
    high: float = None
    choices: tuple = ()

    def suggest(self, trial):
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high)
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, self.choices)
        return trial.suggest_float(self.name, self.low, self.high, log=self.kind == "log")


def _lines(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"--tune_space={path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--tune_space={path}: not a text file (byte {e.start} is not UTF-8)") from None


def parse_space(path, config=None):
    """The search space in `path` as a list of Param; raises ConfigError naming the file, line and why. With
    `config`, every choice and both ends of every range must also make a valid trial of it."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    params, lines = {}, {}
    for number, line in enumerate(_lines(path), 1):
        words = line.split("#")[0].split()
        if not words:
            continue

        def bad(why):
            raise ConfigError(f"--tune_space={path}: line {number} ({line.strip()!r}): {why}")

        name, kind, args = words[0], (words[1] if len(words) > 1 else ""), words[2:]
        field = fields.get(name)
        if field is None:
            bad(f"no flag --{name}")
        if name in NOT_SEARCHABLE or name.startswith(("tune_", "ensemble_")):
            bad(f"--{name} belongs to the tuner and cannot be searched")
        if name in params:
            bad(f"--{name} appears twice")
        if kind not in KINDS:
            bad(f"the type must be one of {', '.join(KINDS)}")
        if kind == "choice":
            param = _choice(name, field, args, bad)
        else:
            wanted = int if kind == "int" else float
            if field.type is not wanted:
                bad(f"--{name} takes a {field.type.__name__}: use {'int' if field.type is int else 'choice'}")
            try:
                low, high = (wanted(a) for a in args)
            except ValueError:
                bad(f"{kind} needs LOW HIGH, two {wanted.__name__}s")
            if not (math.isfinite(low) and math.isfinite(high)):
                bad("LOW and HIGH must be finite")
            if not low < high or (kind == "log" and low <= 0):
                bad("needs LOW < HIGH" + (" and LOW > 0 (log-uniform)" if kind == "log" else ""))
            param = Param(name, kind, low, high)
        for value in (param.choices or (param.low, param.high)) if config is not None else ():
            try:
                with_values(config, {name: value})
            except ConfigError as e:  # a draw of it would stop the study mid-way
                bad(str(e))
        params[name], lines[name] = param, f"line {number} ({line.strip()!r})"
    # A flag no trial reads (--momentum under adamw) searches nothing: a whole study on a setting without effect. Where
    # the space searches what selects the readers (--model, --optimizer), some trials read it.
    selected = any(name in SELECTORS for name in params)
    for name, read_by in unread(config, params) if config is not None and not selected else ():
        raise ConfigError(f"--tune_space={path}: {lines[name]}: no part of these trials reads --{name} ({read_by})")
    if not params:
        raise ConfigError(
            f"--tune_space={path}: no searched flag in it (lines look like 'learning_rate log 1e-4 1e-1')"
        )
    return list(params.values())


def _choice(name, field, args, bad):
    """The Param of a choice line's values `args` for the flag `field`; `bad(why)` refuses the line."""
    if len(args) < 2:  # every trial the same run: a study that searches nothing
        bad(f"choice needs two values or more (one searches nothing: give --{name}={(args or ['VALUE'])[0]} as a flag)")
    try:
        param = Param(name, "choice", choices=tuple(_choice_value(field.type, a) for a in args))
    except ValueError:
        bad(f"every value must be a {field.type.__name__} as --{name} takes it")
    for i, value in enumerate(param.choices):
        if value in param.choices[:i]:  # Optuna would draw it twice as often as the others
            first = args[param.choices.index(value)]
            bad(f"--{name}={args[i]} is given twice" + (f" (as {first} too)" if first != args[i] else ""))
    return param


def with_values(config, values, workdir=None):
    """The validated config of a trial that draws `values` (as Optuna stores them), scored on
    --validation_split, written to `workdir`."""
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    overrides = {
        name: tuple(int(v) for v in value.split(",")) if fields[name] is tuple else value
        for name, value in values.items()
    }
    return validate(
        dataclasses.replace(
            config,
            mode="train",
            workdir=workdir or config.workdir,
            eval_split=config.validation_split,  # the tuner never looks at the test split
            # A trial never opens the study, and its config.json must not carry the database's password.
            tune_storage="",
            **overrides,
        )
    )


def _choice_value(kind, text):
    """A choice as Optuna stores it: bool, int, float, str; a list flag as its normalized text ("64,64")."""
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if kind is tuple:
        return ",".join(str(int(v)) for v in text.split(","))
    return kind(text)
