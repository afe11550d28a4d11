"""The benchmark's building blocks: configs, the candidates a window times (the engine, Keras `fit`, the matmuls
alone, the engine's step without input or in many short rounds) and the interleaved timer. bench/worker.py's
processes and bench/decode.py build their comparisons from these; TensorFlow is imported where it is first needed.
"""

import gc
import importlib
import itertools
import time


def make_config(spec, **overrides):
    from engine.settings.config import validate
    from engine.settings.fields import Config

    fields = {**spec, **overrides}
    for name in ("hidden_sizes", "synthetic_shape"):
        if name in fields:
            fields[name] = tuple(fields[name])
    # Long enough that no round ever reaches the end of training.
    return validate(Config(dataset="synthetic", train_steps=10**9, **fields))


def create_strategy(config, gpu_mirrored=False):
    import tensorflow as tf

    from engine.cluster import distribute

    if gpu_mirrored:
        # Two logical GPUs share one chip: NCCL refuses a GPU twice, so reduce through one device.
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=16_384)] * 2)
        return tf.distribute.MirroredStrategy(
            ["/gpu:0", "/gpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    return distribute.create_strategy(config.cluster)


class EngineRunner:
    """The engine as a user runs it: the train program's run_steps(iterator, n), one call per window."""

    def __init__(self, config, strategy):
        from engine.run import build

        self.config = config
        self.trainer = build.run(config, strategy)
        self.iterator = self.trainer.program.train_iterator()

    def window(self, steps):
        tic = time.perf_counter()
        self.trainer.program.run_steps(self.iterator, steps)  # returns Python floats: the device is done
        return time.perf_counter() - tic

    def parameters(self):
        return sum(int(v.shape.num_elements()) for v in self.trainer.model.trainable_variables)


class FitRunner:
    """Keras `model.fit` on the same model, data pipeline, batch and optimizer.

    A window is one fit() call over `steps` batches, timed from the first batch's start to the epoch's end (its
    last step done), so fit's per-call setup and teardown are left out (but for Keras opening the next epoch's
    iterator before the epoch's end, tens of milliseconds): deleting its iterator waits out its tf.data
    autotuner's sleep in some processes, which timed to fit's return read as a fraction of fit's speed
    (bench/RESULTS.md, "2026-12-04 (fourth session)"). fit itself dispatches as it does without callbacks: the
    timer's are async-safe, and the epoch's end waits for fit's steps (their callbacks flushed) anyway.
    """

    def __init__(self, config, steps_per_execution, jit_compile):
        import keras
        import tensorflow as tf

        from engine.run import inputs

        keras.mixed_precision.set_global_policy(config.precision)
        keras.utils.set_random_seed(config.seed)

        data = inputs.run_data(config)
        # The engine's own pipeline, one replica, as the (inputs, labels) pairs fit reads.
        self.dataset = data.train_fn(tf.distribute.InputContext()).map(lambda b: (b["image"], b["label"]))
        module = importlib.import_module(f"models.{config.model}")
        spec = data.spec["image"]
        self.model = module.create(config, spec, data.task.outputs, data.task.info)
        self.model(tf.zeros((1, *spec.shape)), training=False)
        self.model.compile(
            optimizer=keras.optimizers.AdamW(
                learning_rate=config.learning_rate,
                weight_decay=config.weight_decay,
                beta_1=config.beta_1,
                beta_2=config.beta_2,
                epsilon=config.epsilon,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
            jit_compile=jit_compile,
        )
        self.started = self.ended = None
        runner = self

        class Timer(keras.callbacks.Callback):
            async_safe = True

            def on_train_batch_begin(self, batch, logs=None):
                if runner.started is None:
                    runner.started = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                runner.ended = time.perf_counter()

        self.timer = Timer()

    def window(self, steps):
        self.started = self.ended = None
        self.model.fit(self.dataset.take(steps), epochs=1, verbose=0, callbacks=[self.timer])
        return self.ended - self.started


def time_side_by_side(runners, steps, rounds, budget_s=None):
    """{name: best seconds per step}: `rounds` interleaved windows of `steps[name]` steps each.

    After two rounds, stops early once `budget_s` seconds have gone by.
    """
    best = {name: float("inf") for name in runners}
    started = time.perf_counter()
    for r in range(rounds):
        for name, runner in runners.items():
            best[name] = min(best[name], runner.window(steps[name]) / steps[name])
        if budget_s and r >= 1 and time.perf_counter() - started > budget_s:
            break
    return best


def warm_up(runner, window_s, max_steps):
    """Traces and compiles, then returns how many steps make a window of about `window_s` seconds."""
    runner.window(1)  # tracing, compilation, the first batch
    per_step = runner.window(1)
    if per_step < window_s / 4:  # one step says little about a fast model: time a few more
        per_step = runner.window(4) / 4
    return max(1, min(max_steps, round(window_s / per_step)))


def collect():
    """Frees the runners nothing refers to any more (their models, optimizers, compiled functions)."""
    import keras

    keras.backend.clear_session()
    gc.collect()


class MatmulRunner:
    """An MLP's forward and backward matmuls alone, at its batch and shapes: the floor of its step."""

    def __init__(self, spec, dtype):
        import math

        import tensorflow as tf

        batch = spec["global_batch_size"]
        widths = [math.prod(spec["synthetic_shape"]), *spec["hidden_sizes"], spec.get("synthetic_classes", 10)]
        pairs = []
        for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
            pairs.append(((batch, n_in), (n_in, n_out)))  # forward
            pairs.append(((n_in, batch), (batch, n_out)))  # kernel gradient
            if i:
                pairs.append(((batch, n_out), (n_out, n_in)))  # input gradient (not needed for the first layer)
        operands = [(tf.random.normal(a, dtype=dtype), tf.random.normal(b, dtype=dtype)) for a, b in pairs]
        self.flops = sum(2 * a[0] * a[1] * b[1] for a, b in pairs)

        @tf.function
        def run(n):
            total = tf.constant(0.0)
            for _ in tf.range(n):
                for x, w in operands:  # every product is used, so none is pruned
                    total += tf.cast(tf.reduce_sum(tf.matmul(x, w)[:1]), tf.float32)
            return total

        self.run = run

    def window(self, steps):
        import tensorflow as tf

        tic = time.perf_counter()
        self.run(tf.constant(steps)).numpy()
        return time.perf_counter() - tic


class NoInput:
    """The runner's step without input: one batch, every step (the pipeline's first; the step gathers none)."""

    def __init__(self, runner):
        import tensorflow as tf

        self.runner = runner
        self.fixed = itertools.repeat(next(iter(runner.trainer.data.train_fn(tf.distribute.InputContext()))))

    def window(self, steps):
        tic = time.perf_counter()
        self.runner.trainer.program.run_steps(self.fixed, steps)
        return time.perf_counter() - tic


class Calls:
    """`calls` rounds of `steps_per_call` steps: windows of many short rounds."""

    def __init__(self, runner, calls, steps_per_call=1):
        self.runner, self.calls, self.steps_per_call = runner, calls, steps_per_call

    def window(self, steps):
        del steps
        tic = time.perf_counter()
        for _ in range(self.calls):
            self.runner.trainer.program.run_steps(self.runner.iterator, self.steps_per_call)
        return time.perf_counter() - tic
