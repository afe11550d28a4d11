"""What a checkpoint holds of a run (`State`): its models' variables by path, its updates' optimizers and loss scales,
its counters, the moving averages of its weights and its actions' own state. Saved, restored and rotated by
engine/state/checkpoint.py."""

import dataclasses

import tensorflow as tf

from engine.numerics import updates
from engine.settings.errors import ConfigError


def model_state(models):
    """{model name: {variable path: variable}} of every model: weights, batch-norm statistics and dropout
    seed-generator states, keyed by their Keras paths (mlp/dense_1/kernel), never by position: a fork that
    reorders its layers gets a clear mismatch, not another layer's weights. (Keras 3 layers held in Python lists
    are invisible to tf.train.Checkpoint's object graph, so the engine checkpoints the variables themselves.)"""
    state = {}
    for name, model in models.items():
        variables = {v.path: v.value for v in model.variables}
        if len(variables) != len(model.variables):
            raise ConfigError(f"--model={model.name}: two of its variables have one path; name its layers apart")
        state[name] = variables
    return state


@dataclasses.dataclass(frozen=True)
class State:
    """What a run checkpoints, one field per key of the checkpoint: the keys every checkpoint of this engine has
    (tests/data/before_updates, from older code, restores into it)."""

    models: dict  # {name: Keras model}: weights, batch-norm statistics, seed-generator states (model_state)
    plans: (
        list  # each update's optimizer (slots, update count) and loss scale (engine/numerics/updates.py checkpointed)
    )
    step: tf.Variable  # steps run, skipped ones too
    batches: tf.Variable  # the data position: global batches consumed
    skipped: tf.Variable  # steps skipped for a non-finite loss or gradient
    input_pipelines: tf.Variable  # the input pipelines that read the training stream up to the data position
    ema: dict  # --ema_decay: {model name: {variable path: moving average}}; {} without it
    # A train run's actions' own state (engine/run/actions/base.py hold), a JSON string; None where the run only
    # evaluates. A checkpoint from before it lacks it: restored without it.
    actions: tf.Variable = None

    def tracked(self):
        """{checkpoint key: what is saved under it}."""
        return dict(
            models=model_state(self.models),
            **(updates.checkpointed(self.plans) if self.plans else {}),  # none where a run only evaluates
            step=self.step,
            batches=self.batches,
            skipped=self.skipped,
            input_pipelines=self.input_pipelines,
            **({"ema": self.ema} if self.ema else {}),
            **({"actions": self.actions} if self.actions is not None else {}),
        )

    def evaluated(self):
        """What evaluation, export and ensembles restore (partial=True): the models, their averages and the step."""
        return tf.train.Checkpoint(**{k: v for k, v in self.tracked().items() if k in ("models", "step", "ema")})


# Every key at the top of a checkpoint this engine saves, whatever the settings (State.tracked's; the updates' names,
# engine/numerics/updates.py checkpointed): a checkpoint that holds another was saved by another version of it.
UPDATE_KEYS = ("optimizer", "loss_scale", "optimizers", "loss_scales")
KEYS = frozenset([*(f.name for f in dataclasses.fields(State) if f.name != "plans"), *UPDATE_KEYS])
