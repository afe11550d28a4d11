"""The task protocol: the questions the engine asks of a batch, with the defaults most tasks keep.

A task file, `tasks/<name>.py`, defines `class Task(base.Task)` and overrides what differs. The engine
builds a run in order (engine/trainer.py Trainer, from engine/build.py): the source, then the task, once per
run, as `Task(config, spec, info)`: `spec` is {feature: tf.TensorSpec} of one example as the data source gives
it, `info` what the source knows (`num_classes` of a label, a text's `vocabulary`). Then the task's data: the
engine receives the task, runs `prepare` in the input pipeline and sets `self.spec` to the prepared example's
spec (what `models` and `serve` read). Then `models(create)`, the updates and the step. `config` holds every
setting of the run; its sections (`config.optimization`, `config.loop`, ...) and a file's own settings
(`config.own("task", "language_model")`) are read-only views of it (engine/sections.py).

The engine owns everything else: the step (the global-batch loss, loss scaling, one all-reduce, the finite
check, clipping, the update: a task says its updates, or writes its replica step from the engine's
primitives, and keeps every one of those guarantees), the loop, checkpoints, reports, evaluation and
export; research/ (tuning, ensembles) reads the task too.
"""

import math

import tensorflow as tf


class Task:
    features = ()  # the source features a batch needs, checked to exist; the others are dropped before batching
    input = ""  # the feature the default model reads (forward, export)
    objective = ("loss", "min")  # the default tuning objective: a reported metric, and "max" or "min"
    headline = "loss"  # the reported metric launch.py prints at the end of a run

    def __init__(self, config, spec, info):
        self.config, self.spec, self.info = config, spec, info

    # ---- Data ----------------------------------------------------------------------------------------------

    def prepare(self, batch):
        """A batch of source examples -> a batch the model reads (scaling, casting, decoding). Runs batched, in the
        input pipeline, or inside the training step where the step gathers its batch from a split held in memory
        (one CPU replica per worker); must keep the batch dimension first and every shape static."""
        return batch

    # ---- Models --------------------------------------------------------------------------------------------

    def models(self, create):
        """{name: model} of the run. `create(family, spec, outputs)` builds `models/<family>.py` for inputs like
        `spec` (a tf.TensorSpec of one example), handing the factory the source's `info` too; `create(...,
        config=c)` with another run's settings `c`. `create.trained(workdir, spec, outputs, flag, task)` is another
        run's trained model (a distillation teacher): checked to be a `task` run on this run's dataset, built from
        its config.json, restored from its newest checkpoint (its moving average where it kept one) and frozen;
        ConfigError naming --`flag` otherwise. Every model's trainable variables are trained, in one step; set
        `model.trainable = False` on one the task only reads."""
        return {"model": create(self.config.model, self.spec[self.input], self.outputs)}

    # Per-group optimizer settings: ((regex on <model name>/<variable path>, {setting: value}), ...), the first match
    # wins; e.g. ((r"^head/", {"learning_rate": 4e-4}),). The groups of the default update, applied together.
    optimizer_groups = ()

    # ---- The step ------------------------------------------------------------------------------------------

    def updates(self):
        """The step as a sequence of engine.api.Update, applied in order, each with its own loss, variables,
        optimizer, loss scale, clipping and frequency (a GAN: the discriminator's, then the generator's). () (the
        default): one update, engine.api.DEFAULT, of every trained variable with the run's optimizer, the task's
        optimizer_groups and its loss."""
        return ()

    # A step the updates cannot say (SAM's ascent point, a penalty through the input) is written as
    # `replica_step(self, step, batch)` from the primitives of engine/step.py's ReplicaStep: step.gradients(name,
    # batch, loss=None, shift=None) -> Gradients (.loss, .grads, .norm, .finite: all-reduced once, unscaled, checked,
    # clipped), step.apply(name, gradients, when=None) (the masked optimizer update), step.variables(name). It runs
    # on every replica inside the round's tf.function; no primitive all-reduces twice, skips the finite check or
    # clips before the all-reduce. None: the engine's own step over updates().
    replica_step = None

    @property
    def outputs(self):
        """Width of the default model's last layer."""
        raise NotImplementedError(f"{type(self).__module__}: say the model's outputs, or override models()")

    def forward(self, models, batch, training):
        """The models' outputs for a batch (any structure `loss` and `metrics` read)."""
        return models["model"](batch[self.input], training=training)

    # ---- Loss and metrics ----------------------------------------------------------------------------------

    def loss(self, outputs, batch):
        """Per-example loss, float32, shape [batch]. The engine sums it and divides by the GLOBAL batch: never
        average it here. A loss that needs the whole global batch (contrastive negatives) gathers what it needs
        with tf.distribute.get_replica_context().all_gather; nothing else here may know about replicas."""
        raise NotImplementedError

    def metrics(self, outputs, batch):
        """{name: per-example float32 values} on an evaluation batch. The engine sums weight x value and the
        weights over every replica and worker (padding weighs 0), so the means are exact."""
        return {"loss": self.loss(outputs, batch)}

    def report(self, means):
        """The reported numbers from the metrics' means over the evaluation split (e.g. RMSE from MSE)."""
        return dict(means)

    def probe(self, models, examples):
        """Numbers that need more than per-example sums (a linear probe on frozen features): {} by default.
        `examples(split)` iterates once over the prepared batches of a split, each example once (a `weight` of 0
        marks padding): a generator of batches, not a tf.data.Dataset."""
        return {}

    def pictures(self, models):
        """{name: uint8 array [height, width, channels]} drawn at each evaluation and at the end (a GAN's samples): the
        engine writes each to workdir/<name>.png and to TensorBoard. {} by default."""
        return {}

    # ---- Export and ensembles ------------------------------------------------------------------------------

    def serve(self, models):
        """The SavedModel's serving function: a tf.function with an input_signature, returning named outputs."""
        spec = self.spec[self.input]
        signature = [tf.TensorSpec([None, *spec.shape], spec.dtype, name=self.input)]
        return tf.function(
            lambda x: {"outputs": tf.cast(self.forward(models, {self.input: x}, False), tf.float32)},
            input_signature=signature,
        )

    # A task that generates (language_model) defines sample(self, models, config) -> text, for --mode=sample.
    sample = None

    ensemble = None  # how members' predictions average: "probabilities", "values", or None (refused)

    def predictions(self, outputs):
        """What an ensemble averages, from one member's outputs (probabilities, predicted values)."""
        raise NotImplementedError

    def score(self, predictions, batch):
        """{name: per-example values} of averaged predictions, like `metrics` (numpy in, numpy out)."""
        raise NotImplementedError


def bits(nats):
    """Nats to bits."""
    return nats / math.log(2.0)
