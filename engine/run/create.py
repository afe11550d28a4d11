"""The models of a run: models/<family>.py's factory called for a task (`Create`, what `Task.models(create)`
receives), every variable built before the first trace, layers named afresh so that checkpoints key them by
path; and another run's trained model, frozen (a distillation teacher)."""

import collections
import inspect
import os
import weakref

import keras
import tensorflow as tf
from keras.src.backend.common import global_state

from engine.settings import plugins
from engine.settings.config import load_run_config
from engine.settings.errors import ConfigError, TaskError, check_call, described
from engine.state.checkpoint import list_checkpoints
from engine.state.warm_start import warm_start
from engine.state.workdir import other_classes

_BUILT = weakref.WeakKeyDictionary()  # {model: (its file, the ids of its variables as create_model built it)}


def create_model(config, family, spec, outputs, info=None):
    """models/<family>.py's model for examples like `spec` (a tf.TensorSpec), `info` what the source knows of them
    (a text's `vocabulary`, a label's `num_classes`), with every variable built (call under strategy.scope()). Its
    layers are named afresh (dense, dense_1, ...), whatever was built before in this process: checkpoints key
    variables by these paths."""
    factory, where = plugins.member("model", family), plugins.file("model", family)
    uids = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    try:
        try:
            handed = config.plugin("model", family)
            model = _factory_call(factory, where, handed, spec, outputs, {} if info is None else info)
        except TaskError:
            raise
        except ValueError as e:  # a setting, or data, the family cannot build from: its message says which
            raise ConfigError(str(e) if str(e).startswith("--") else f"--model={family}: {e}") from None
        if not isinstance(model, keras.layers.Layer):
            raise TaskError(f"{where}: create returned {described(model)}, not a keras.Model")
        out = model(tf.zeros((1, *spec.shape), spec.dtype), training=False)  # variables exist before the first trace
    finally:
        global_state.set_global_attribute("object_name_uids", uids)
    _check_output(out, where, outputs, config.precision)
    _check_untracked(model, where)
    _check_paths(model, where)
    _BUILT[model] = (where, {id(v) for v in model.variables})
    return model


def _check_paths(model, where):
    """TaskError naming a variable path two of `model`'s variables share (two layers given one name): checkpoints
    key variables by path, so one would be saved over the other."""
    counts = collections.Counter(v.path for v in model.variables)
    twice = next((path for path, count in counts.items() if count > 1), None)
    if twice is not None:
        raise TaskError(
            f"{where}: {counts[twice]} of its model's variables have the path {twice}; give its layers names of their "
            "own (checkpoints key variables by path)"
        )


def check_built(models):
    """TaskError naming the file of a model that made variables after create_model built it, as the step was
    traced: a layer it calls only when training (create_model calls a model with training=False), or makes in its
    call. They would be neither trained nor checkpointed, and drawn afresh by every process, silently."""
    for model in models.values():
        where, built = _BUILT.get(model, (None, ()))
        made = [v.path for v in model.variables if id(v) not in built]
        if where is not None and made:
            more = f" and {len(made) - 1} more" if made[1:] else ""
            raise TaskError(
                f"{where}: its model made variables as the step was traced ({made[0]}{more}): a layer called only "
                "when training, or made in call; the engine builds a model by calling it with training=False, so "
                "they would be neither trained nor checkpointed: make every layer in __init__ and call it in both "
                "modes, or build it in build()"
            )


def _check_untracked(model, where):
    """TaskError naming the attribute where a layer of `model` holds a tf.Variable: Keras 3 tracks only its own
    variables (add_weight), so the engine would neither train nor checkpoint it, silently."""
    for layer in model._flatten_layers(include_self=True):
        if type(layer).__module__.startswith("keras."):  # Keras's own (a lookup table's tf-idf weights are data)
            continue
        for attribute, value in vars(layer).items():
            if attribute.startswith("_self_"):  # TensorFlow's tracking of the object, not a fork's
                continue
            if any(isinstance(held, tf.Variable) for held in _held(value)):
                raise TaskError(
                    f"{where}: its layer {layer.name!r} holds a tf.Variable in self.{attribute}, which a Keras 3 model "
                    "does not track: it would be neither trained nor checkpointed; create it with "
                    "self.add_weight(...) in a layer"
                )


def _held(value, depth=3):
    """`value`, and what the lists, tuples and dicts it is hold, `depth` deep."""
    if depth and isinstance(value, (list, tuple)):
        return [x for item in value for x in _held(item, depth - 1)]
    if depth and isinstance(value, dict):
        return [x for item in value.values() for x in _held(item, depth - 1)]
    return [value]


def _factory_call(factory, where, config, spec, outputs, info):
    # A fork's factory written before factories received the spec and the source's info keeps working:
    # create(config, input_shape, outputs), the shape a tuple.
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = inspect.signature(factory).parameters.values()
    required = [p for p in parameters if p.kind in positional and p.default is p.empty]
    if len(required) == 3:
        return factory(config, tuple(spec.shape), outputs)
    called_as = "create(config, spec, outputs, info) (or, of the older form, create(config, input_shape, outputs))"
    check_call(factory, (config, spec, outputs, info), where, "create", called_as)
    return factory(config, spec, outputs, info)


def _check_output(out, where, outputs, precision):
    """A model's output, one tensor, is of `outputs` values per example (its last dimension: the task's classes, a
    vocabulary, an embedding's width); a model of several outputs is its task's to read. A mixed precision's last
    layer computing in the half type gets a warning: the loss should see float32."""
    if not tf.is_tensor(out) or not isinstance(outputs, int):
        return
    if out.shape.rank is None or out.shape.rank < 2 or out.shape[-1] != outputs:
        raise TaskError(
            f"{where}: its model's output for a batch of 1 is of shape {out.shape}; the task reads {outputs} values "
            f"per example, its last dimension (the classes, a vocabulary, an embedding's width: `outputs`)"
        )
    if precision.startswith("mixed_") and out.dtype != tf.float32:
        print(
            f"warning: {where}: its output is {out.dtype.name} under --precision={precision}: its last layer computes "
            'in the half type; dtype="float32" there keeps the logits and the loss in float32',
            flush=True,
        )


class Create:
    """The `create` a task's `models(create)` receives (tasks/base.py): `create(family, spec, outputs)` builds a
    model of this run's settings (`config=`: of another run's), and `create.trained(...)` another run's trained
    model, frozen (a distillation teacher). Every model it builds receives this run's source's info: another run's
    model reads the same dataset, its labels naming the same classes (trained() refuses one of others).
    `class_names`: what this run's labels mean (its task's class_names, None for a task that names none)."""

    def __init__(self, config, info, class_names=None):
        self.config, self.info, self.class_names = config, info, class_names

    def __call__(self, family, spec, outputs, config=None):
        return create_model(config or self.config, family, spec, outputs, self.info)

    def trained(self, workdir, spec, outputs, flag, task):
        """The model the run in `workdir` trained, for examples like `spec` with `outputs`: built from its
        config.json (its family and settings), restored from its newest checkpoint (the moving average where
        that run kept one) and frozen. ConfigError naming --`flag` when `workdir` holds no config.json, a run of
        another task than `task`, a run on another dataset than this run's or on classes named otherwise (a class
        folder renamed, added or removed since: its outputs would teach each label as another), or a checkpoint
        that does not fit its model."""
        try:
            saved = load_run_config(workdir)
        except ConfigError as e:  # its config.json cannot be read, or holds settings no run could have
            raise ConfigError(f"--{flag}={workdir}: {e}") from None
        if saved is None:
            raise ConfigError(f"--{flag}={workdir}: no config.json there; name the workdir of a trained run")
        if saved.task != task:
            raise ConfigError(f"--{flag}={workdir}: a --task={saved.task} run; the {flag} must be a {task} run")
        if saved.dataset != self.config.dataset:
            raise ConfigError(
                f"--{flag}={workdir}: trained on --dataset={saved.dataset}, not this run's {self.config.dataset}"
            )
        moved = other_classes(workdir, self.class_names)
        if moved:
            raise ConfigError(
                f"--{flag}={workdir}: {moved}: its outputs would mean other classes than this run's labels"
            )
        model = self(saved.model, spec, outputs, config=saved)
        found = warm_start({flag: model}, workdir, flag=flag, log=self._restored_later(flag, workdir))
        if found["missing"] or found["reshaped"]:  # a partly restored model would teach noise
            raise ConfigError(
                f"--{flag}={workdir}: its checkpoint does not fit its config.json's model "
                f"({', '.join(found['missing'] + found['reshaped'])})"
            )
        model.trainable = False
        return model

    def _restored_later(self, flag, workdir):
        """How a warm start from `workdir` is told: a run that restores its own checkpoint (resumed, evaluated) takes
        the frozen model that checkpoint holds, as it was when the run began, not `workdir`'s newest."""
        restores = self.config.mode != "train" or list_checkpoints(os.path.join(self.config.workdir, "checkpoints"))
        if not restores:
            return print
        return lambda line: print(f"{flag}: the model of {workdir}, its weights as this run's checkpoint holds them")
