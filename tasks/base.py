"""The task protocol: the questions the engine asks of a batch, with the defaults most tasks keep.

A task file, `tasks/<name>.py`, defines `class Task(base.Task)` and overrides what differs, and imports the engine
only through engine.api (Update, DEFAULT, ConfigError, ...). The engine builds a run in order (engine/run/build.py
`run`): the source, then the task, once per
run, as `Task(config, spec, info)`: `spec` is {feature: tf.TensorSpec} of one example as the data source gives
it, `info` what the source knows (`num_classes` of a label, a text's `vocabulary`). Then the task's data: the
engine receives the task, runs `prepare` in the input pipeline and sets `self.spec` to the prepared example's
spec (what `models` and `serve` read). Then `models(create)`, the updates and the step. `config` holds every
engine setting of the run, the settings the task's file declares and those its READS names (another file's setting,
unnamed, is an AttributeError naming the READS to add); its sections (`config.optimization`, `config.loop`, ...) and
a file's own settings (`config.own("task", "language_model")`) are read-only views of the run's Config
(engine/settings/sections.py).

The engine owns everything else: the step (the global-batch loss, loss scaling, one all-reduce, the finite
check, clipping, the update: a task says its updates, or writes its replica step from the engine's
primitives, and keeps every one of those guarantees), the loop, checkpoints, reports, evaluation and
export; research/ (tuning, ensembles) reads the task too.
"""

import math

import tensorflow as tf

from engine.api import ConfigError, TaskError, Undefined


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

    # What updates say: each its own loss (a penalty through the input too: a nested tf.GradientTape inside the loss,
    # as tasks/wgan_gp.py's gradient penalty), variables, optimizer, clipping, frequency, and a fresh batch per
    # repetition. A step they cannot say (SAM's ascent point, evaluated at the weights plus a shift) is written as
    # `replica_step(self, step, batch)` from the primitives of engine.api.ReplicaStep: step.gradients(name, batch,
    # loss=None, shift=None, repetition=0) -> Gradients (.loss, .grads, .norm, .finite: all-reduced once, unscaled,
    # checked, clipped), step.apply(name, gradients, when=None) (the masked optimizer update), step.variables(name),
    # step.batches. It runs on every replica inside the round's tf.function; no primitive all-reduces twice, skips
    # the finite check or clips before the all-reduce, and a misuse is one line naming this file (TaskError). None:
    # the engine's own step over updates().
    replica_step = None

    @property
    def outputs(self):
        """Width of the default model's last layer."""
        raise _undefined(self, "outputs (the width of its default model's last layer), nor models() of its own")

    def forward(self, models, batch, training):
        """The models' outputs for a batch (any structure `loss` and `metrics` read)."""
        return models["model"](batch[self.input], training=training)

    # ---- Loss and metrics ----------------------------------------------------------------------------------

    def loss(self, outputs, batch):
        """Per-example loss, float32, shape [batch]. The engine sums it and divides by the GLOBAL batch: never
        average it here. A loss that needs the whole global batch (contrastive negatives) gathers what it needs
        with tf.distribute.get_replica_context().all_gather; nothing else here may know about replicas."""
        raise _undefined(self, "loss(outputs, batch), the per-example loss its updates train on")

    def metrics(self, outputs, batch):
        """{name: per-example float32 values} on an evaluation batch. The engine sums weight x value and the
        weights over every replica and worker (padding weighs 0), so the means are exact."""
        return {"loss": self.loss(outputs, batch)}

    def report(self, means):
        """The reported numbers from the metrics' means over the evaluation split (e.g. RMSE from MSE)."""
        return dict(means)

    def probe(self, models, examples):
        """Numbers that need more than per-example sums (a linear probe on frozen features): {} by default.
        `examples(split)` iterates once over the prepared batches of a split, each example once with its `weight`
        (how much it counts, as in the means: a probe weighs what it reports by it; 0 marks padding): a generator of
        batches, not a tf.data.Dataset."""
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

        def serve(x):
            outputs = self.forward(models, {self.input: x}, False)
            if not tf.is_tensor(outputs):  # a dict's or a tuple's names are the task's to give
                file = type(self).__module__.replace(".", "/") + ".py"
                raise TaskError(
                    f"{file}: its forward returns a {type(outputs).__name__}, and the default serve(models) exports "
                    "one tensor: define serve(models) in it, naming what the SavedModel returns (tasks/base.py)"
                )
            return {"outputs": tf.cast(outputs, tf.float32)}

        return tf.function(serve, input_signature=signature)

    # What each class index means, for a task whose outputs are classes (classification: a tuple of names): written
    # to config.json and summary.json and served beside each predicted index by the export. None: no classes.
    class_names = None

    # A task that generates (language_model) defines sample(self, models, config) -> text, for --mode=sample.
    sample = None

    ensemble = None  # how members' predictions average: "probabilities", "values", or None (refused)

    def predictions(self, outputs):
        """What an ensemble averages, from one member's outputs (probabilities, predicted values)."""
        raise _undefined(self, "predictions(outputs), what an ensemble of its runs averages")

    def score(self, predictions, batch):
        """{name: per-example values} of averaged predictions, like `metrics` (numpy in, numpy out)."""
        raise _undefined(self, "score(predictions, batch), how an ensemble's averaged predictions are scored")


def _undefined(task, what):
    """The error for a method of this protocol that a run needs and `task` does not define."""
    return Undefined(f"{type(task).__module__.replace('.', '/')}.py: defines no {what}")


def one_tensor(task, model, spec):
    """The output of `model` (of --model) for one example of zeros like `spec`, which `task` reads as one tensor
    (logits, predictions): TaskError naming the model's file where it returns another structure, which the task's
    loss would fail on in its own line (a model of several outputs is for a task of its own, which reads them)."""
    out = model(tf.zeros([1, *spec.shape], spec.dtype), training=False)
    if not tf.is_tensor(out):
        raise TaskError(
            f"models/{task.config.model}.py: its model returns a {type(out).__name__}; --task={task.config.task} "
            "reads one tensor of outputs per example: return it alone, or read the model's outputs in a task of "
            "your own (docs/forking.md)"
        )
    return out


def first_output(outputs):
    """A network's first output per example, in float32 (a discriminator's logit, a critic's score): [batch, 1+]
    outputs, in whatever precision the model computes, to [batch]."""
    return tf.cast(outputs[:, 0], tf.float32)


def read_as_numbers(task, batch, names):
    """Refuses (ConfigError naming --dataset) a feature of `names` that holds strings, which `task` reads as numbers:
    their cast is traced, and fails only as the first batch is read, after the run has started."""
    for name in names:
        if batch[name].dtype == tf.string:
            hint = " (encoded photos: image:jpeg or image:png)" if name == "image" else ""
            raise ConfigError(
                f"--dataset={task.config.dataset}: its {name} holds strings{hint}, which --task={task.config.task} "
                "reads as numbers"
            )


def float_image(task, batch):
    """The batch's image as float32, uint8 scaled to [0, 1]; strings refused (read_as_numbers)."""
    read_as_numbers(task, batch, ("image",))
    image = batch["image"]
    if image.dtype == tf.uint8:
        return tf.cast(image, tf.float32) / 255.0
    return tf.cast(image, tf.float32)


def bits(nats):
    """Nats to bits."""
    return nats / math.log(2.0)


# ---- Per-example random numbers ----------------------------------------------------------------------------------
# Noise a task draws for each example (a view's crop, a GAN's z, a penalty's interpolation) as a function of (the
# run's --seed, the example's `index` in the training stream, a role the task numbers, a repetition) alone: one
# device, several replicas or workers and a resumed run draw the same numbers for the same example. (The `seed` an
# update's loss is handed is its forward pass's: it differs by replica, like the dropout masks.)


def example_keys(seed, index, role, repetition=None):
    """[n, 3] int64 keys (seed, each example's index, role), or [n, 4] with the `repetition` (an int or a scalar
    tensor: an update's repetition within its step, Update.repeat): what each example's numbers are a function of."""
    fill = lambda value: tf.fill(tf.shape(index), tf.cast(value, tf.int64))  # noqa: E731
    columns = [fill(seed), tf.cast(index, tf.int64), fill(role)]
    return tf.stack(columns + ([] if repetition is None else [fill(repetition)]), axis=1)


def _mix(x):
    # lowbias32 (C. Wellons): a 32-bit integer hash in which every input bit flips each output bit about half
    # the time. uint32 arithmetic wraps, on CPU, GPU and in XLA alike.
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16)) * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15)) * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def example_uniforms(keys, count):
    """[n, count] float32 in (0, 1): `count` numbers drawn from each row of `keys` (int64 [n, k]) alone.

    A counter-based generator, vectorized over the batch: TensorFlow's stateless ops take one seed per call, and
    a loop over examples costs more than the step itself."""
    state = tf.zeros(tf.shape(keys)[:1], tf.uint32)
    for column in tf.unstack(tf.cast(keys, tf.int64), axis=1):
        for word in (column, tf.bitwise.right_shift(column, 32)):  # the low, then the high 32 bits
            state = _mix(tf.bitwise.bitwise_xor(state, tf.cast(word, tf.uint32)))
    counters = tf.cast(tf.range(count), tf.uint32) * tf.constant(0x9E3779B9, tf.uint32)  # a Weyl sequence
    bits = _mix(state[:, None] + counters[None, :])
    # 23 bits and a half: exact in float32, so never 0 or 1 (which ndtri would turn into an infinite value).
    return (tf.cast(tf.bitwise.right_shift(bits, 9), tf.float32) + 0.5) * 2.0**-23


def example_normals(keys, count):
    """[n, count] float32 standard normals, each row a function of its row of `keys` alone (example_uniforms)."""
    return tf.math.ndtri(example_uniforms(keys, count))
