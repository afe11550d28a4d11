"""Evaluation: the task's metrics as sums over the evaluation split (every example once, padding weighted 0),
summed over replicas and workers, then reported as the task says; with --ema_decay, of the moving averages of the
weights, beside the trained weights' own. The forward pass and metrics compile with XLA where the train step does;
metrics XLA cannot compile are evaluated without it, saying so."""

import functools

import numpy as np
import tensorflow as tf

from engine.numerics import replica
from engine.run import inputs
from engine.run.program import unsupported_ops, warn_retraced
from engine.settings import plugins
from engine.settings.errors import TaskError, raising_task_errors

# How far a float32 sum of an evaluation's weights may lie from their sum, in units of its last place: each batch's
# pairwise sum and the compensated sum of the batches round a few times.
SUM_SLACK = 8


class Evaluator:
    """Evaluates the run's models on its evaluation split. `placement`: the run's engine/cluster/distribute.py
    Placement; `weights`: its trained variables with their moving averages (--ema_decay); `jit`: its
    engine/run/xla.py Choice, whether the train step compiles with XLA (the evaluation follows it until it first
    runs); `examples(split)`: a split's batches for the task's probe; `coordinator`: a parameter server's (the chief
    evaluates, reading the servers)."""

    def __init__(self, config, placement, task, models, data, weights, jit, examples, coordinator=None):
        self.config, self.placement, self.strategy = config, placement, placement.strategy
        self.task, self.models, self.data = task, models, data
        self.weights, self.coordinator = weights, coordinator
        # examples(split): the prepared batches of a split, each example once, for Task.probe (inputs.examples).
        self.examples = examples
        self.step_jit = jit  # what the step chose; `self.jit`: what the evaluation was built with
        self.followed = jit.compile  # the step's choice the evaluation was last built for
        self.ran = False  # an evaluation has run to its end (a later failure is not XLA's compile)
        self.retraced = set()
        self._reset()

    def _follow_step(self):
        """The train step fell back from XLA (engine/run/program.py): an evaluation that has not run yet follows it."""
        if self.step_jit.compile != self.followed and not self.ran:
            self.followed = self.step_jit.compile
            self._reset()

    def _reset(self, jit=None):
        """The evaluation built afresh at its next use: with XLA where the step has it (`jit` None), or not."""
        self.jit = jit
        for built in ("sums", "eval_step"):
            self.__dict__.pop(built, None)
        self.eval_loop = tf.function(self._eval_loop)

    @functools.cached_property
    def sums(self):
        """One replica's evaluation sums (engine/numerics/replica.py make_eval_sums), compiled with XLA where the
        train step is when first built (`jit` records it), and without after XLA could not compile them: a metric
        that synchronizes replicas, an op without an XLA kernel."""
        if self.jit is None:  # not on a parameter server's chief: XLA reads no remote variable
            self.jit = bool(self.step_jit.compile) and self.coordinator is None
        return replica.make_eval_sums(self.task, self.models, plugins.file("task", self.config.task), self.jit)

    @functools.cached_property
    def metric_names(self):
        """The task's metric names, in the order of the evaluation sums: found by tracing them for a replica's
        batch (compiled with XLA on one device per process, the trace the evaluation then calls)."""
        replicas = self.placement.replicas
        spec = self.data.eval_fn(tf.distribute.InputContext(num_replicas_in_sync=replicas)).element_spec
        sums = self.sums  # built first: it decides jit
        traced = sums if self.jit else tf.function(sums)
        return sorted(traced.get_concrete_function(spec).structured_outputs[0])

    @functools.cached_property
    def eval_step(self):
        return replica.make_eval_step(self.sums, self.metric_names)

    @functools.cached_property
    def dataset(self):
        """Built at the first evaluation: a parameter-server chief never needs it."""
        return self.strategy.distribute_datasets_from_function(self.data.eval_fn)

    def iterator(self):
        """An iterator over the evaluation batches: the dataset's own on one CPU device, else the strategy's."""
        if inputs.one_cpu_device(self.strategy):
            return iter(self.data.eval_fn(tf.distribute.InputContext()))
        return iter(self.dataset)

    def _eval_loop(self, iterator, steps):
        total = carried = tf.zeros([len(self.metric_names) + 1])
        for _ in tf.range(steps):
            batch = inputs.first_replica(self.strategy, self.strategy.run(self.eval_step, args=(next(iterator),)))
            total, carried = added(total, carried, batch)
        return total + carried

    def trace(self):
        """Traces the evaluation now (engine/run/loop.py trace: before a checkpoint is restored, so that XLA's
        persistent cache names it as the first run did)."""
        self._follow_step()
        try:
            with raising_task_errors(), inputs.releasing([self.iterator()]) as iterators:
                self.eval_loop.get_concrete_function(iterators[0], tf.TensorSpec([], tf.int32))
        except RuntimeError as e:  # metrics XLA cannot compile: the evaluation is rebuilt without it (no entry)
            if not self._without_xla(e):
                raise

    def evaluate(self):
        """The task's reported metrics over the evaluation split. With --ema_decay, of the averaged weights (what
        export serves), and beside them, as raw_<metric>, of the trained weights themselves."""
        with raising_task_errors():  # a task's metrics, report or probe that cannot run: one line
            if not self.weights.averages:
                return self._evaluate()
            raw = self._evaluate()
            with self.weights.averaged():
                averaged = self._evaluate()
        examples = averaged.pop("examples")
        return {**averaged, **{f"raw_{k}": v for k, v in raw.items() if k != "examples"}, "examples": examples}

    def pictures(self):
        """The task's pictures (Task.pictures), drawn with the weights evaluation reads (the averages, --ema_decay)."""
        with self.weights.averaged():
            return self.task.pictures(self.models)

    def _evaluate(self):
        self._follow_step()
        if self.coordinator is not None:  # on the chief, reading the variables from the parameter servers
            return self._results(self._on_chief(self.data.eval_fn(tf.distribute.InputContext())))
        # The iterator's only reference: deleted off this thread (inputs.release).
        with inputs.releasing([self.iterator()]) as iterators:
            try:
                totals = self.eval_loop(iterators[0], tf.constant(self.data.eval_steps))
                warn_retraced("eval_loop", self.eval_loop, self.retraced)
            except (tf.errors.OpError, RuntimeError) as e:
                if self._without_xla(e):
                    return self._evaluate()
                if isinstance(e, RuntimeError):
                    raise
                pipelines = 1  # the evaluation's stream is read whole on every worker
                raise inputs.explain(e, self.config, self.strategy, self.data, False, pipelines) from None
        self.ran = True
        return self._results(totals)

    def _without_xla(self, error):
        """Rebuilds the evaluation without XLA, saying why in one line, when `error` is XLA's failing to compile it
        (the task's metrics, which training never ran, whatever --jit_compile says); False for any other error."""
        why = self._uncompilable(error)
        if not why:
            return False
        print(f"evaluation without XLA ({why}): traced again", flush=True)
        self._reset(jit=False)
        return True

    def _uncompilable(self, error):
        """Why XLA could not compile the evaluation sums, from the first evaluation's failure (training never runs
        the task's metrics); "" for sums not compiled, a later failure, or one that names the data."""
        if not self.jit or self.ran:
            return ""
        if isinstance(error, RuntimeError):
            return "the task's metrics synchronize replicas" if "merge_call" in str(error) else ""
        ops = unsupported_ops(error)
        if ops:
            return f"the task's forward pass or metrics use {ops}, which XLA cannot compile"
        if "xla" in (error.message or "").lower():  # its compile's own failure (tf2xla, an XLA pass)
            return f"XLA could not compile the task's forward pass or metrics: {error.message.splitlines()[0]}"
        return ""

    @tf.function
    def _on_chief(self, dataset):
        total = carried = tf.zeros([len(self.metric_names) + 1])
        for batch in dataset:
            total, carried = added(total, carried, self.eval_step(batch))
        return total + carried

    def _results(self, totals):
        *sums, examples = totals.numpy()
        where = plugins.file("task", self.config.task)
        results = self.task.report({name: float(total / examples) for name, total in zip(self.metric_names, sums)})
        results = reported(results, f"{where}: report")
        results.update(reported(self.task.probe(self.models, self.examples), f"{where}: probe"))
        headline = self.task.headline
        if headline not in results:  # the run's last line and --mode=tune read it: found now, not after the run
            raise TaskError(
                f"{where}: headline = {headline!r} names no number its evaluation reports ({', '.join(results)})"
            )
        return {**results, "examples": weighed(examples)}


def weighed(examples):
    """The examples an evaluation counted (float32 `examples`, the sum of their weights): an int where it is whole,
    as where every weight is 1 or 0; else the shortest decimal within SUM_SLACK units of float32's last place of it
    (weights of 0.3 on 64 examples count 19.2, which an int cut to 19; on 606, 181.8, which float32's roundings
    showed as 181.80006)."""
    value = float(examples)
    if value.is_integer():
        return int(value)
    slack = SUM_SLACK * float(np.spacing(np.float32(abs(value))))
    shortest = (round(value, digits) for digits in range(16))
    return next((number for number in shortest if abs(number - value) <= slack), float(str(np.float32(value))))


def added(total, carried, value):
    """(total, carried) after adding `value`: a sum of float32 batches kept to float32's precision however many there
    are (Neumaier's compensated sum; the sum is total + carried). Added plainly, each batch's sum was rounded to the
    total's precision: an evaluation's mean drifted with its number of batches (one 2**24 times smaller than the
    total added nothing), and a count of examples past 2**24 lost each odd batch's last one."""
    summed = total + value
    lost = tf.where(tf.abs(total) >= tf.abs(value), (total - summed) + value, (value - summed) + total)
    return summed, carried + lost


def reported(numbers, where):
    """{name: number} a task's report or probe gave, as plain Python numbers (a numpy or tensor scalar's value), for
    eval.jsonl and summary.json; TaskError naming `where` for anything that is not one number, or a name the engine
    keeps for its own ("examples")."""
    if not isinstance(numbers, dict):
        raise TaskError(f"{where}: returned a {type(numbers).__name__}, not a dict of numbers by name")
    plain = {}
    for name, value in numbers.items():
        if name == "examples":
            raise TaskError(
                f"{where}: a number named 'examples' would replace the engine's count of the examples evaluated; name "
                "it otherwise"
            )
        if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.ndim:
                raise TaskError(f"{where}: {name!r} is an array of shape {list(array.shape)}, not one number")
            value = array.item()
        if not (value is None or isinstance(value, (int, float))):
            raise TaskError(f"{where}: {name!r} is a {type(value).__name__}, not a number")
        plain[name] = value
    return plain
