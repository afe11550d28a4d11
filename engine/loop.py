"""The story of a run: strategy, data, model and optimizer, then rounds of steps.

Inner loop in graph: one tf.function runs `steps_per_loop` replica steps with
`tf.range(n)`, `n` a tensor, so it is traced once whatever the round's length.
Outer loop in Python: logging, evaluation and the summary between rounds.
"""

import importlib
import time

import keras
import tensorflow as tf

from engine import data as data_lib
from engine import distribute, optim, precision, step
from engine.config import ConfigError, check_batch
from engine.report import Report


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss in float32 or bfloat16); the message says where."""


def create_model(config, input_shape, num_classes):
    """models/<config.model>.py's model with every variable built (call under strategy.scope())."""
    model = importlib.import_module(f"models.{config.model}").create(config, input_shape, num_classes)
    model(tf.zeros((1, *input_shape)), training=False)  # variables exist before the first trace
    return model


class Trainer:
    """Everything a run holds: built once per run, eagerly, under the strategy's scope."""

    def __init__(self, config, strategy):
        self.config, self.strategy = config, strategy
        check_batch(config, strategy.num_replicas_in_sync)
        keras.utils.set_random_seed(config.seed)
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        precision.set_policy(config.precision)
        self.data = data_lib.load(config)
        with strategy.scope():
            self.model = create_model(config, self.data.input_shape, self.data.num_classes)
            self.optimizer = optim.Optimizer(config, [v.value for v in self.model.trainable_variables])
            self.loss_scale = (
                precision.LossScale(config.initial_loss_scale, config.loss_scale_growth_interval)
                if config.precision == "mixed_float16"
                else None
            )
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")  # steps run, skipped too
        self.train_step = step.make_train_step(
            self.model, self.optimizer, self.loss_scale, config, strategy.num_replicas_in_sync
        )
        self.eval_step = step.make_eval_step(self.model)
        self.train_dataset = strategy.distribute_datasets_from_function(self.data.train_fn)
        self.eval_dataset = strategy.distribute_datasets_from_function(self.data.eval_fn)
        self.train_loop = tf.function(self._train_loop)
        self.eval_loop = tf.function(self._eval_loop)

    def _first_replica(self, values):
        return tf.nest.map_structure(lambda v: self.strategy.experimental_local_results(v)[0], values)

    def _train_loop(self, iterator, steps):
        loss_sum, finite_steps = tf.constant(0.0), tf.constant(0.0)
        last = {"grad_norm": 0.0, "learning_rate": 0.0, "loss_scale": 0.0}
        for _ in tf.range(steps):
            out = self._first_replica(self.strategy.run(self.train_step, args=next(iterator)))
            loss_sum += tf.where(out["finite"], out["loss"], 0.0)
            finite_steps += tf.cast(out["finite"], tf.float32)
            last = {k: out[k] for k in last}
            self.step.assign_add(1)
        skipped = tf.cast(steps, tf.float32) - finite_steps
        return {"loss": loss_sum / finite_steps, "skipped": skipped, **last}  # loss: mean of finite steps

    def _eval_loop(self, iterator, steps):
        totals = tf.zeros([3])
        for _ in tf.range(steps):
            totals += self._first_replica(self.strategy.run(self.eval_step, args=next(iterator)))
        return totals

    def run_steps(self, iterator, steps):
        """Runs `steps` train steps in one call of the traced inner loop; returns host numbers."""
        try:
            out = self.train_loop(iterator, tf.constant(steps))
        except RuntimeError as e:
            if "merge_call" in str(e) and self.config.jit_compile:
                raise ConfigError(
                    f"--jit_compile=true: {self.config.model} synchronizes replicas inside its forward pass "
                    f"(synchronized batch norm), which XLA cannot compile with "
                    f"{self.strategy.num_replicas_in_sync} replicas here; drop --jit_compile or use one replica"
                ) from None
            raise
        return {k: float(v) for k, v in out.items()}

    def evaluate(self):
        loss, correct, examples = self.eval_loop(iter(self.eval_dataset), tf.constant(self.data.eval_steps)).numpy()
        return {"accuracy": float(correct / examples), "loss": float(loss / examples), "examples": int(examples)}


def train(config, strategy=None):
    """Trains and evaluates as `config` says; returns the summary, also written to workdir/summary.json."""
    started = time.time()
    strategy = strategy or distribute.create_strategy(config)
    trainer = Trainer(config, strategy)
    return run(trainer, Report(config.workdir, distribute.is_chief(strategy), config.train_steps), started)


def run(trainer, report, started):
    """The outer loop: rounds of steps, logging and evaluation between them, then the summary."""
    config, strategy = trainer.config, trainer.strategy
    params = sum(int(tf.size(v)) for v in trainer.model.trainable_variables)
    report.line(
        f"model={config.model} parameters={params} dataset={config.dataset} "
        f"strategy={distribute.strategy_name(config)} replicas={strategy.num_replicas_in_sync} "
        f"precision={config.precision} global_batch_size={config.global_batch_size}"
    )

    iterator = iter(trainer.train_dataset)
    current, skipped, loss = int(trainer.step.numpy()), 0, float("nan")
    timed_steps, timed_seconds, first_round = 0, 0.0, None
    while current < config.train_steps:
        steps = min(config.steps_per_loop, config.train_steps - current)
        if config.eval_every:
            steps = min(steps, config.eval_every - current % config.eval_every)
        tic = time.perf_counter()
        out = trainer.run_steps(iterator, steps)
        seconds = time.perf_counter() - tic
        if first_round is None:
            first_round = (steps, seconds)  # includes tracing and compilation: kept out of the throughput
        else:
            timed_steps, timed_seconds = timed_steps + steps, timed_seconds + seconds
        current += steps
        skipped += int(out["skipped"])
        loss = out["loss"]
        if out["skipped"] and config.precision != "mixed_float16":
            raise TrainingError(
                f"non-finite loss or gradient between steps {current - steps + 1} and {current} "
                f"({int(out['skipped'])} steps); in {config.precision} this is a bug or a "
                "divergence: lower --learning_rate or set --clip_norm"
            )
        report.train(
            current,
            {
                "loss": loss,
                "learning_rate": out["learning_rate"],
                "grad_norm": out["grad_norm"],
                "loss_scale": out["loss_scale"] if trainer.loss_scale else None,
                "examples_per_sec": steps * config.global_batch_size / seconds,
            },
        )
        if config.eval_every and current % config.eval_every == 0 and current < config.train_steps:
            report.eval(current, trainer.evaluate())

    results = trainer.evaluate()
    report.eval(current, results)
    if not timed_steps and first_round:
        timed_steps, timed_seconds = first_round
    summary = {
        "step": current,
        "train_loss": loss,
        "eval": results,
        "examples_per_sec": timed_steps * config.global_batch_size / timed_seconds if timed_steps else None,
        "skipped_steps": skipped,
        "loss_scale": float(trainer.loss_scale.scale.numpy()) if trainer.loss_scale else None,
        "wall_seconds": time.time() - started,
        "strategy": distribute.strategy_name(config),
        "num_replicas": strategy.num_replicas_in_sync,
        "precision": config.precision,
        "global_batch_size": config.global_batch_size,
    }
    report.summary(summary)
    return summary
