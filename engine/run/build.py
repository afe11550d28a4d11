"""The pieces a run is built from, in the order engine/trainer.py's Trainer builds them: the source (its
examples' spec and what it knows of them), the task from those, the task's data, the seed, the models (a task
asks for them through `Create`), the variables they train and their moving averages, then the state a
checkpoint holds. Nothing here builds what is upstream of it: the data receives its task, a model factory
receives its input's spec and the source's info."""

import collections
import importlib
import inspect
import re

import keras
import tensorflow as tf
from keras.src.backend.common import global_state

from engine.data import datasets as data_lib
from engine.numerics import precision
from engine.settings.config import load_run_config
from engine.settings.errors import ConfigError
from engine.state import checkpoint


def source_and_task(config, split=None):
    """The source `config.dataset` names, keeping the features its task reads (its evaluation split `split`, else
    --eval_split), and the task built from what the source gives: its examples' spec and its info."""
    cls = data_lib.task_class(config)
    source = data_lib.load_source(config, cls.features, split)
    return source, cls(config, source.spec, source.info)


def inputs(config, split=None):
    """The Data of the run `config` describes, its source and task built as a run builds them: what evaluation,
    research and tests read without building a run. Its `task` is the task it was prepared for."""
    source, task = source_and_task(config, split)
    return data_lib.prepare(config, source, task, split)


def seed(config):
    """Seeds Keras's initializers and sets op determinism and the precision policy, before any model exists."""
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    precision.set_policy(config.precision)


def create_model(config, family, spec, outputs, info=None):
    """models/<family>.py's model for examples like `spec` (a tf.TensorSpec), `info` what the source knows of them
    (a text's `vocabulary`, a label's `num_classes`), with every variable built (call under strategy.scope()). Its
    layers are named afresh (dense, dense_1, ...), whatever was built before in this process: checkpoints key
    variables by these paths."""
    factory = importlib.import_module(f"models.{family}").create
    uids = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    try:
        try:
            model = _factory_call(factory, config, spec, outputs, {} if info is None else info)
        except ValueError as e:  # a setting, or data, the family cannot build from: its message says which
            raise ConfigError(str(e) if str(e).startswith("--") else f"--model={family}: {e}") from None
        model(tf.zeros((1, *spec.shape), spec.dtype), training=False)  # variables exist before the first trace
    finally:
        global_state.set_global_attribute("object_name_uids", uids)
    return model


def _factory_call(factory, config, spec, outputs, info):
    # A fork's factory written before factories received the spec and the source's info keeps working:
    # create(config, input_shape, outputs), the shape a tuple.
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = inspect.signature(factory).parameters.values()
    required = [p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(required) == 3:
        return factory(config, tuple(spec.shape), outputs)
    return factory(config, spec, outputs, info)


class Create:
    """The `create` a task's `models(create)` receives (tasks/base.py): `create(family, spec, outputs)` builds a
    model of this run's settings (`config=`: of another run's), and `create.trained(...)` another run's trained
    model, frozen (a distillation teacher). Every model it builds receives this run's source's info: another run's
    model reads the same dataset (trained() refuses one of another)."""

    def __init__(self, config, info):
        self.config, self.info = config, info

    def __call__(self, family, spec, outputs, config=None):
        return create_model(config or self.config, family, spec, outputs, self.info)

    def trained(self, workdir, spec, outputs, flag, task):
        """The model the run in `workdir` trained, for examples like `spec` with `outputs`: built from its
        config.json (its family and settings), restored from its newest checkpoint (the moving average where
        that run kept one) and frozen. ConfigError naming --`flag` when `workdir` holds no config.json, a run of
        another task than `task`, a run on another dataset than this run's, or a checkpoint that does not fit
        its model."""
        saved = load_run_config(workdir)
        if saved is None:
            raise ConfigError(f"--{flag}={workdir}: no config.json there; name the workdir of a trained run")
        if saved.task != task:
            raise ConfigError(f"--{flag}={workdir}: a --task={saved.task} run; the {flag} must be a {task} run")
        if saved.dataset != self.config.dataset:
            raise ConfigError(
                f"--{flag}={workdir}: trained on --dataset={saved.dataset}, not this run's {self.config.dataset}"
            )
        model = self(saved.model, spec, outputs, config=saved)
        found = checkpoint.warm_start({flag: model}, workdir, flag=flag)
        if found["missing"] or found["reshaped"]:  # a partly restored model would teach noise
            raise ConfigError(
                f"--{flag}={workdir}: its checkpoint does not fit its config.json's model "
                f"({', '.join(found['missing'] + found['reshaped'])})"
            )
        model.trainable = False
        return model


def trained_variables(models, freeze):
    """The variables the step trains: every model's trainable ones whose <model name>/<path> (model/mlp/dense/kernel)
    --freeze does not match."""
    pattern = re.compile(freeze) if freeze else None
    return [
        v
        for name, model in models.items()
        for v in model.trainable_variables
        if not (pattern and pattern.search(f"{name}/{v.path}"))
    ]


def trained(models, freeze):
    """(the trained variables, each one's name <model name>/<path>): two models of one family share their Keras
    paths, and must not share optimizer slots or moving averages."""
    params = trained_variables(models, freeze)
    if not params:
        raise ConfigError(f"--freeze={freeze}: matches every trainable variable; nothing to train")
    owner = {id(v): name for name, model in models.items() for v in model.trainable_variables}
    return params, [f"{owner[id(v)]}/{v.path}" for v in params]


def averages(params, ema_decay):
    """--ema_decay: the moving average of every trained variable, starting at its initial value; [] without it."""
    return [tf.Variable(v.value, trainable=False, name="ema") for v in params if ema_decay]


def state(models, plans, names, ema):
    """The run's checkpoint.State: its models, its updates' optimizers and loss scales, its counters (at 0 until a
    checkpoint is restored) and its moving averages keyed like the models."""

    def counter(name):
        return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)

    by_path = collections.defaultdict(dict)
    for name, average in zip(names, ema):
        model, path = name.split("/", 1)
        by_path[model][path] = average
    return checkpoint.State(
        models=models,
        plans=plans,
        step=counter("step"),  # steps run, skipped ones too
        batches=counter("batches"),  # the data position
        skipped=counter("skipped"),
        input_pipelines=counter("input_pipelines"),  # a streamed split's order depends on them
        ema=dict(by_path),
    )
