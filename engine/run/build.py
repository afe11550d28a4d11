"""One place builds a run, top to bottom (`run`): the source and its task, the task's data, the seed, the
models, the variables they train with their moving averages, the updates with their optimizers and loss scales,
the state a checkpoint holds, the train program (the step and its loop), the evaluator and the actions. Every mode
takes what it needs from it (PURPOSES): training all of it; evaluation and research the models, the state to
restore and the evaluator, without optimizers or a train program; export and sampling the models and their state
alone. Nothing here builds what is upstream of it:
the data receives its task, a model factory receives its input's spec and the source's info."""

import collections
import contextlib
import dataclasses
import re

import keras
import tensorflow as tf

from engine.cluster import distribute, resolvers
from engine.data import datasets, source_checks
from engine.numerics import precision, updates
from engine.numerics.forward import owners
from engine.run import actions, memory, xla
from engine.run.actions.builtin import engine_actions
from engine.run.create import Create
from engine.run.evaluator import Evaluator
from engine.run.inputs import examples, source_and_task, task_of
from engine.run.program import TrainProgram
from engine.settings import plugins
from engine.settings.checks import check_batch
from engine.settings.errors import ConfigError, TaskError, described
from engine.settings.fields import applies
from engine.state import held


@dataclasses.dataclass(frozen=True)
class Weights:
    """The variables the step trains (every model's trainable ones that --freeze does not match), each one's
    <model name>/<path>, and their moving averages (--ema_decay; [] without it). `frozen`: the <model name>/<path>
    of the trainable variables --freeze keeps fixed; `freeze`: that --freeze, as given (its messages name it)."""

    variables: list
    names: list
    averages: list
    frozen: tuple = ()
    freeze: str = ""

    @contextlib.contextmanager
    def averaged(self):
        """With --ema_decay: the variables hold their moving averages inside the block (what evaluation reads and
        export serves)."""
        if not self.averages:
            yield
            return
        saved = [tf.identity(v.value) for v in self.variables]
        for v, average in zip(self.variables, self.averages):
            v.assign(average)
        try:
            yield
        finally:
            for v, value in zip(self.variables, saved):
                v.assign(value)

    def arrays(self):
        """{<model>/<path>: numpy array} of the trained variables as they stand (what an action reads of them)."""
        return {name: v.numpy() for name, v in zip(self.names, self.variables)}

    def restart_averages(self):
        """Starts the moving averages at the current weights (after a warm start)."""
        for v, average in zip(self.variables, self.averages):
            average.assign(v.value)


@dataclasses.dataclass(frozen=True)
class Run:
    """A run as `run` built it. `plans`: the updates as built (engine/numerics/updates.py; [] outside training);
    `state`: what a checkpoint holds (engine/state/held.py State); `program`: the step and its loop (None
    outside training); `evaluator`: None for export and sample; `actions`: what the controller does after each
    round, in order; `placement`: where its steps execute (engine/cluster/distribute.py), worked out once from its
    strategy; `data`: None for its weights built from what config.json keeps of the source (run's `source`)."""

    config: object
    placement: distribute.Placement
    task: object
    data: object
    models: dict
    weights: Weights
    plans: list
    state: held.State
    program: TrainProgram | None
    evaluator: Evaluator | None
    actions: list

    @property
    def strategy(self):
        return self.placement.strategy

    @property
    def model(self):
        """The run's model (a task with several: the first)."""
        return next(iter(self.models.values()))


# What a run is built for: training builds all of it; evaluation (eval, continuous_eval, research) no updates, train
# program or actions; "weights" (export, sample) the models and what a checkpoint restores into them, no evaluator.
PURPOSES = ("train", "evaluate", "weights")


def run(config, strategy, purpose="train", on_eval=None, source=None):
    """The run `config` describes on `strategy`, built in order, every variable under the strategy's scope before
    the first trace, with what `purpose` (PURPOSES) reads and nothing more. `on_eval`: the Evaluate action's
    callback (a tuner's pruning). `source`: (spec, info) as the trained run's config.json keeps them
    (engine/state/workdir.py saved_source), from which a run built for "weights" builds its task: it reads no data
    (its `data` is None)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r}: one of {', '.join(PURPOSES)}")
    training, evaluating = purpose == "train", purpose != "weights"
    where = distribute.placement(strategy, distribute.strategy_name(config.cluster))
    check_batch(config, where.replicas, training)
    tf.config.run_functions_eagerly(config.run_eagerly)
    task, data = task_and_data(config, source if purpose == "weights" else None)
    memory.check(config, where, *shape_and_outputs(task), training=training)
    # Seeded after the data: tensorflow-datasets draws from Python's `random` while preparing a dataset, and Keras
    # seeds its initializers from that generator, so seeding after it keeps the weights the same.
    seed(config)
    with strategy.scope():
        models = task.models(Create(config, task.info, task.class_names))
        if not isinstance(models, dict):  # a list of models would fail in the engine's code, with its traceback
            raise TaskError(
                f"{plugins.file('task', config.task)}: models(create) returned {described(models)}, not a dict of "
                "{name: model}"
            )
        weights = trained_weights(models, config.freeze, config.ema_decay)
        if training:
            check_freeze(models, config.freeze)
            _check_estimate(config, task, models)
        task_file = plugins.file("task", config.task)
        plans = updates.build_plans(task, weights, config.optimization, config.numerics, task_file) if training else []
        state = checkpointed_state(models, plans, weights)
    if training:  # the actions' own state (Action.checkpointed): one host variable, outside the strategy's scope
        state = dataclasses.replace(state, actions=tf.Variable("", dtype=tf.string, trainable=False, name="actions"))
    # Parameter servers: workers run scheduled rounds asynchronously; the chief coordinates and evaluates.
    coordinator = distribute.coordinator(strategy) if where.parameter_server else None
    jit = xla.Choice(*xla.resolve(config.numerics, where, models)) if evaluating else None
    program = TrainProgram(config, where, task, models, plans, data, state, jit, coordinator) if training else None
    evaluator = (
        Evaluator(config, where, task, models, data, weights, jit, examples(config), coordinator)
        if evaluating
        else None
    )
    run_actions = engine_actions(config.loop, actions.load(config), on_eval) if training else []
    return Run(config, where, task, data, models, weights, plans, state, program, evaluator, run_actions)


def task_and_data(config, kept=None):
    """The run's task and its Data: the task built from the source `config` names, and the source prepared for it;
    from `kept` instead, (spec, info) as a trained run's config.json keeps them, the task alone (Data None), no data
    read."""
    if kept is not None:
        spec, info = kept
        task = task_of(config, spec, source_checks.Info(config.dataset_name, info))  # a key it lacks: one line
        datasets.prepare_spec(task, spec)
        return task, None
    memory.check_data(config)
    service = config.tf_data_service if applies("tf_data_service", config) else ""  # training's batches alone
    if service:  # before anything is written: a dispatcher that never answers is refused
        resolvers.reach_data_service(config.cluster)
    source, task = source_and_task(config)
    return task, datasets.prepare(config.data, source, task, service=service)


def _check_estimate(config, task, models):
    """The memory check's estimate against the model it was of: the run's default model (a task that builds its own
    models defines no outputs, and its estimate was of one --model alone)."""
    input_shape, outputs = shape_and_outputs(task)
    if outputs is not None and isinstance(models.get("model"), keras.Model):
        memory.check_estimate(config, input_shape, outputs, models["model"])


def shape_and_outputs(task):
    """(the shape of one prepared example of the task's input, the width of its default model's outputs) for the
    memory check; (1,) for a task without an input feature, None for the width of one that builds its own models
    (it defines no outputs)."""
    spec = task.spec.get(task.input)
    try:
        outputs = task.outputs
    except NotImplementedError:  # a task that builds its own models
        outputs = None
    return (tuple(spec.shape) if spec else (1,)), outputs


def seed(config):
    """Seeds Keras's initializers and sets op determinism and the precision policy, before any model exists."""
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    precision.set_policy(config.precision)


def trained_variables(models, freeze):
    """The variables the step trains: every model's trainable ones whose <model name>/<path> (model/mlp/dense/kernel)
    --freeze does not match, each once (engine/numerics/forward.py owners)."""
    pattern, owner = re.compile(freeze) if freeze else None, owners(models)
    trained = {}
    for model in models.values():
        for v in model.trainable_variables:
            if not (pattern and pattern.search(f"{owner[id(v)]}/{v.path}")):
                trained.setdefault(id(v), v)
    return list(trained.values())


def trained_weights(models, freeze, ema_decay):
    """The Weights the step trains: their names are <model name>/<path> (two models of one family share their Keras
    paths, and must not share optimizer slots or moving averages); their averages start at their initial values."""
    variables = trained_variables(models, freeze)
    if not variables and not freeze:
        raise ConfigError(f"the run's models ({', '.join(models)}) have no trainable variables: nothing to train")
    if not variables:
        raise ConfigError(f"--freeze={freeze}: matches every trainable variable; nothing to train")
    owner = owners(models)
    averages = [tf.Variable(v.value, trainable=False, name="ema") for v in variables if ema_decay]
    kept = {id(v) for v in variables}
    frozen = [f"{owner[id(v)]}/{v.path}" for m in models.values() for v in m.trainable_variables if id(v) not in kept]
    names = [f"{owner[id(v)]}/{v.path}" for v in variables]
    return Weights(variables, names, averages, tuple(dict.fromkeys(frozen)), freeze)


def check_freeze(models, freeze):
    """Refuses a --freeze that matches no variable of the models the run trains (a frozen teacher's are not): a typo
    would train every weight it meant to keep. Checked as a run trains, not as a trained one is rebuilt."""
    owner = owners(models)
    names = [f"{owner[id(v)]}/{v.path}" for model in models.values() if model.trainable for v in model.variables]
    if freeze and not any(re.search(freeze, name) for name in names):
        raise ConfigError(
            f"--freeze={freeze}: matches no variable of the run's trained models; their names are <model name>/"
            f"<path>, such as {', '.join(names[:3])}"
        )


def checkpointed_state(models, plans, weights):
    """The run's held.State: its models, its updates' optimizers and loss scales, its counters (at 0 until a
    checkpoint is restored) and its moving averages keyed like the models."""

    def counter(name):
        return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)

    by_path = collections.defaultdict(dict)
    for name, average in zip(weights.names, weights.averages):
        model, path = name.split("/", 1)
        by_path[model][path] = average
    return held.State(
        models=models,
        plans=plans,
        step=counter("step"),  # steps run, skipped ones too
        batches=counter("batches"),  # the data position
        skipped=counter("skipped"),
        input_pipelines=counter("input_pipelines"),  # a streamed split's order depends on them
        ema=dict(by_path),
    )
