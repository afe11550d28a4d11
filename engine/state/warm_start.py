"""A checkpoint's variables by the Keras paths the models give them (mlp/dense/kernel): a warm start from another
run's weights (--init_checkpoint, a distillation's teacher) and engine.api.weights, what a fork holds its step against.
Finding, saving and restoring a run's own checkpoints is engine/state/checkpoint.py's.
"""

import contextlib
import os

import tensorflow as tf

from engine.settings.config import first_line
from engine.settings.errors import ConfigError
from engine.state.checkpoint import describe_key, is_damage, list_checkpoints, storage_error


def _candidates(source, flag):
    """The checkpoints `source` may name, the one to read first first: [a checkpoint prefix], or a workdir's
    checkpoints newest first. ConfigError naming `flag` when there is none."""
    if tf.io.gfile.exists(source + ".index"):
        return [source]
    found = list_checkpoints(os.path.join(source, "checkpoints"))
    if found:
        return found
    raise ConfigError(f"--{flag}={source}: neither a checkpoint (no {source}.index) nor a workdir with checkpoints")


def warm_start(models, source, flag="init_checkpoint", log=print):
    """Assigns each variable of `models` the value saved under the same Keras path in the checkpoint `source` (a
    prefix or a workdir), under the same model name where the checkpoint has one, else another's: the moving average
    where the run kept one (what it evaluated), else the weights. Variables it lacks, or holds in another shape,
    keep their initial values and are named; in a warning where they are most of this run's (a run that starts
    from one bias of `source` trains from scratch, nearly). Returns {"matched", "missing", "reshaped", "unused"}
    (lists of paths). A workdir's newest checkpoint that cannot be read (damaged, or still being saved by a run
    training there: its index comes last) is named in a warning and the previous one read, as --mode=eval does;
    nothing is assigned from a checkpoint until every value it gives has been read."""
    prefix, (values, result) = _newest_readable(source, flag, lambda prefix: _read(models, source, prefix, flag))
    for v, value in values:
        v.assign(value)
    matched, kept = len(result["matched"]), len(result["missing"]) + len(result["reshaped"])
    line = f"{flag}: {matched} variables from {prefix}"
    if kept > matched:
        line = f"warning: {flag}: only {matched} of this run's {matched + kept} variables from {prefix}"
    for what, why in (
        ("missing", "not in it (kept as initialized)"),
        ("reshaped", "other shapes (kept as initialized)"),
        ("unused", "in it but not in this run"),
    ):
        if result[what]:
            line += f"; {why}: {', '.join(result[what])}"
    log(line)
    return result


def _newest_readable(source, flag, read):
    """(prefix, read(prefix)) of the newest checkpoint `source` names that `read` can read: one of a workdir that is
    damaged, or still being saved by a run training there (its index comes last), is named in a warning and the
    previous one read. Unreadable where none is left to read."""
    tried, untried = [], _candidates(source, flag)
    while True:
        prefix = untried[0]
        tried.append(prefix)
        try:
            return prefix, read(prefix)
        except Unreadable as e:
            # Listed again: a run training there may have saved, or rotated one away, meanwhile.
            untried = [p for p in _candidates(source, flag) if p not in tried]
            if not untried:
                raise
            print(f"warning: {e}; reading the previous checkpoint", flush=True)


def _read(models, source, prefix, flag):
    """([(variable, value to assign)], result) of a warm start of `models` from the checkpoint `prefix`: warm_start's,
    read but not yet assigned. Unreadable where the checkpoint is damaged."""
    with _reading(source, prefix, flag):
        reader = tf.train.load_checkpoint(prefix)
        shapes = reader.get_variable_to_shape_map()
    saved, averaged = {}, {}  # (model name, Keras path) -> key of its weights (models/...), of its average (ema/...)
    for kind, name, path, key in _model_variables(shapes):
        if not _is_seed_state(path):  # a run's own random stream, seeded by its --seed: not a weight to start from
            (saved if kind == "models" else averaged)[name, path] = key
    paths = {path for _, path in saved}
    if not saved:
        raise ConfigError(
            f"--{flag}={source}: {prefix} holds no model variables keyed by path (a checkpoint of another engine, "
            "or of this one before variables were keyed by path)"
        )
    result = {"matched": [], "missing": [], "reshaped": [], "unused": []}
    used, values = set(), []
    for name, model in models.items():
        # This model's own variables first (a distillation run holds its student and its teacher under the same
        # paths), then another model's, in name order.
        owners = sorted({owner for owner, _ in saved}, key=lambda owner: (owner != name, owner))
        for v in model.variables:
            if _is_seed_state(v.path):  # dropout's seed: this run's --seed draws its masks, not the source's
                continue
            key = next((t[o, v.path] for o in owners for t in (averaged, saved) if (o, v.path) in t), None)
            if key is None:
                result["missing"].append(v.path)
            elif shapes[key] != list(v.shape):
                result["reshaped"].append(f"{v.path} {shapes[key]} -> {list(v.shape)}")
                used.add(v.path)
            else:
                with _reading(source, prefix, flag):
                    values.append((v, reader.get_tensor(key)))
                result["matched"].append(v.path)
                used.add(v.path)
    result["unused"] = sorted(paths - used)
    if not result["matched"]:
        if result["reshaped"]:  # every path it shares with this run holds another shape there
            absent = f"; not in it: {_listed(result['missing'])}" if result["missing"] else ""
            raise ConfigError(
                f"--{flag}={source}: no variable of this run has its shape in {prefix} (other shapes: "
                f"{_listed(result['reshaped'])}{absent})"
            )
        raise ConfigError(
            f"--{flag}={source}: no variable of this run is in {prefix} by path (it has {_listed(sorted(paths))}; "
            f"this run has {_listed(result['missing'])})"
        )
    return values, result


def _listed(items, shown=4):
    """The first `shown` of `items`, and ", ..." where there are more."""
    return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "")


def _is_seed_state(path):
    """Whether a variable is a Keras seed generator's state (dropout's): the stream a run's --seed starts, which the
    step folds with the step and replica (engine/numerics/forward.py), not a weight."""
    return path.endswith("seed_generator_state")


def weights(source, flag="checkpoint"):
    """{model name: {variable path: numpy array}} of the checkpoint `source` names (a checkpoint prefix, or a workdir:
    its newest readable one, as a warm start reads it): every model's weights and statistics by the Keras paths the
    models give them (mlp/dense/kernel), and their moving averages under "ema/<model>" where the run kept them. What a
    fork holds its step against."""
    return _newest_readable(source, flag, lambda prefix: _weights_in(source, prefix, flag))[1]


def _weights_in(source, prefix, flag):
    """weights() of the checkpoint `prefix`; Unreadable where it is damaged."""
    found = {}
    with _reading(source, prefix, flag):
        reader = tf.train.load_checkpoint(prefix)
        for kind, name, path, key in _model_variables(reader.get_variable_to_shape_map()):
            found.setdefault(name if kind == "models" else f"ema/{name}", {})[path] = reader.get_tensor(key)
    return found


class Unreadable(ConfigError):
    """A checkpoint to start from that is damaged (a truncated data file, a missing index)."""


@contextlib.contextmanager
def _reading(source, prefix, flag):
    """Reads the checkpoint `prefix` (of --`flag`=`source`) inside the block: a damaged file (a truncated data file
    fails only as a tensor is read) is ConfigError naming the flag, a storage failure CheckpointError."""
    try:
        yield
    except (tf.errors.OpError, IndexError) as e:
        if not is_damage(e):
            raise storage_error(prefix, e) from None
        raise Unreadable(f"--{flag}={source}: unreadable checkpoint {prefix} ({first_line(e)})") from None


def _model_variables(keys):
    """(kind, model name, Keras path, key) of each model variable among a checkpoint's keys: kind "models" for its
    weights and statistics, "ema" for their moving averages."""
    for key in keys:
        parts = key.split("/")
        if key.endswith("/.ATTRIBUTES/VARIABLE_VALUE") and parts[0] in ("models", "ema") and len(parts) == 5:
            yield parts[0], parts[1], describe_key(parts[2]), key
