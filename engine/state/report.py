"""What a run tells: console lines, metrics.jsonl, eval.jsonl, TensorBoard events, summary.json.

Only the chief writes files; every task may print. The files stay consistent through a kill at any moment:
records logged after the checkpoint a run resumes from are dropped (so none is written twice), a file is
replaced atomically, and a write that fails (a full disk) raises CheckpointError naming the path (exit 4).
"""

import json
import math
import os
import sys
import time
import uuid

import tensorflow as tf
from tensorflow.core.util import event_pb2

from engine.state.files import append_text, json_text, make_workdir, replace_text, write_json, write_text, writing


def _updates(metrics):
    """The prefixes under which `metrics` holds each update's numbers: [""] in a run of one update, ["critic/",
    "generator/"] in a run of several (their summed loss, under "loss", means nothing: each one's is shown)."""
    return list(dict.fromkeys(k[: -len("grad_norm")] for k in metrics if k.endswith("grad_norm")))


def _shown(value, spec):
    return "-" if value is None else format(value, spec)


def _train_fields(metrics):
    """The console line's numbers as name=value: each update's loss, rates, gradient norm and loss scale (float16
    alone has one). metrics.jsonl keeps every key, null where there is no number."""
    fields = []
    for prefix in _updates(metrics):
        fields.append(f"{prefix}loss={_shown(metrics[prefix + 'loss'], '.5g')}")
        rates = [k for k in metrics if k.startswith(prefix) and k[len(prefix) :].split("/")[0] == "learning_rate"]
        fields += [f"{k}={_shown(metrics[k], '.4g')}" for k in rates]
        fields.append(f"{prefix}grad_norm={_shown(metrics[prefix + 'grad_norm'], '.4g')}")
        if metrics[prefix + "loss_scale"] is not None:
            fields.append(f"{prefix}loss_scale={metrics[prefix + 'loss_scale']:g}")
    return " ".join(fields)


def _live_loss(metrics):
    """The progress line's loss: each update's in a run of several."""
    return " ".join(f"{prefix}loss {_shown(metrics[prefix + 'loss'], '.4f')}" for prefix in _updates(metrics))


def _number(value):
    """JSON has no inf or NaN: write them as null."""
    value = float(value)
    return value if math.isfinite(value) else None


def _step_of(line):
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a torn last line from a crash: dropped


def _read_lines(path):
    if not tf.io.gfile.exists(path):
        return []
    with writing(path), tf.io.gfile.GFile(path) as f:  # a log the run cannot read (a folder in its place) is one
        return f.read().splitlines(keepends=True)  # it cannot write either: exit 4, naming it


def _rewind_events(path, last):
    """Drops a TensorBoard events file's summaries after step `last`, as rewind does for the jsonl files:
    TensorBoard would draw both the killed process's values and the redone ones."""
    kept, dropped = [], False
    try:
        for record in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(record.numpy())
            if event.HasField("summary") and event.step > last:
                dropped = True
            else:
                kept.append(record.numpy())
    except tf.errors.DataLossError:
        dropped = True  # a record torn by the kill
    if dropped:
        tmp = os.path.join(os.path.dirname(path), f".rewind-{uuid.uuid4().hex}.tmp")  # a name no link waits at
        with writing(path):
            with tf.io.TFRecordWriter(tmp) as writer:
                for record in kept:
                    writer.write(record)
            tf.io.gfile.rename(tmp, path, overwrite=True)


def format_metrics(results):
    """name=value pairs of a task's results, for one line of output: each metric to 5 significant digits, the count of
    examples as eval.jsonl records it (a sum of weights of 0.5, 123456.5, read 1.2346e+05)."""
    return " ".join(
        f"{k}={v:.5g}" if isinstance(v, float) and k != "examples" else f"{k}={v}" for k, v in results.items()
    )


class Report:
    def __init__(self, workdir, chief, total_steps, resume_step=None, stream=None, redo_eval=False):
        """`resume_step`: the step this process resumed the run at from its checkpoint (0 too: a checkpoint of step
        0); None for a run that starts afresh. `redo_eval`: the run evaluates `resume_step` again (an evaluation step
        it may have stopped at unevaluated), so that step's evaluation is dropped too."""
        self.workdir, self.chief, self.total_steps = workdir, chief, total_steps
        self.resume_step = resume_step  # where this process began: its time and rate are of the steps after it
        self.stream = stream or sys.stdout
        self.live = chief and self.stream.isatty()
        self._progress_shown = False
        # (time, step) of this process's first train line: its round traced and compiled the step, so the ETA is
        # timed from there on, evaluations and checkpoints included.
        self._timed_from = None
        self._writers = {}
        # The lines of the last logging window (count_losses): the step the first of them counts from (its previous
        # line's), and (step, mean loss, skipped steps) of each line since.
        self._last_window, self._window_from, self._window = 0, 0, []
        self.evaluated = None  # the step of the last evaluation this process logged
        if chief:
            make_workdir(workdir)
            self.rewind(resume_step or 0, redo_eval)

    def rewind(self, step, redo_eval=False):
        """Drops records after `step` (logged before a crash or a rollback): no step is logged twice. A run at
        its last step evaluates it again, so that step's final evaluation goes too, and so does the evaluation of
        `step` with `redo_eval`. The ETA is timed afresh from the next line: the time of the steps undone (a
        rollback) is not the pace of the steps left."""
        self._window = [record for record in self._window if record["step"] <= step]
        self._timed_from = None
        if not self.chief:
            return
        evaluated = step - 1 if step >= self.total_steps or redo_eval else step
        for name, last in (("metrics.jsonl", step), ("eval.jsonl", evaluated)):
            path = os.path.join(self.workdir, name)
            lines = _read_lines(path)
            kept = [line for line in lines if line.strip() and line.endswith("\n") and _step_of(line) <= last]
            if len(kept) != len(lines):
                write_text(path, "".join(kept))
        for writer in self._writers.values():
            writer.close()  # its file is rewound too; a new one continues it
        for name, last in (("train", step), ("eval", evaluated)):
            for path in tf.io.gfile.glob(os.path.join(self.workdir, name, "events.out.tfevents.*")):
                _rewind_events(path, last)
            with writing(os.path.join(self.workdir, name)):
                self._writers[name] = tf.summary.create_file_writer(os.path.join(self.workdir, name))

    def line(self, text):
        """A plain console line, clearing the live progress line first."""
        self.clear()
        print(text, file=self.stream, flush=True)

    def clear(self):
        """Clears the live progress line, where one is shown: what follows (an error on stderr) starts a line."""
        if self._progress_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._progress_shown = False

    def train(self, step, metrics, traced=False):
        """metrics: loss (the mean over the finite steps since the last line; None in a run of several updates, whose
        summed losses mean nothing), learning_rate (or a task's optimizer groups' learning_rate/<regex>), grad_norm
        (its mean over those steps), loss_scale (None unless float16), examples_per_sec, skipped_steps (since the last
        line); a run of several updates: each one's under <update>/, with its loss. `traced`: the round's time
        includes tracing and compilation (this process's first round, the first that returned an action's extras),
        so the summary's throughput leaves it out."""
        record = {"step": step, **{k: None if v is None else _number(v) for k, v in metrics.items()}}
        record.update({k: int(v) for k, v in metrics.items() if k.endswith("skipped_steps")})  # each update's too
        record["traced"] = bool(traced)
        # A number that is none (the mean loss of a line whose every step float16 skipped): "-" on the console, no
        # TensorBoard point, null in metrics.jsonl alike; not NaN in two of them.
        metrics = {k: record[k] for k in metrics}
        self._count_loss(record)
        self.line(f"train step={step} {_train_fields(metrics)} examples_per_sec={metrics['examples_per_sec']:.1f}")
        if not self.chief:
            return
        self._append("metrics.jsonl", record)
        self._scalars("train", step, metrics)
        if self.live:
            self.stream.write(
                f"\r\033[K[{100 * step // self.total_steps:3d}%] step {step}/{self.total_steps} "
                f"{_live_loss(metrics)} "
                f"{metrics['examples_per_sec']:,.0f} ex/s "
                f"ETA {self._eta(step)}"
            )
            self.stream.flush()
            self._progress_shown = True

    def _eta(self, step):
        """The time left at `step`, at the pace since this process's first train line; --:--:-- at that line."""
        now = time.perf_counter()
        if self._timed_from is None or step <= self._timed_from[1]:
            self._timed_from = self._timed_from or (now, step)
            return "--:--:--"
        since, first = self._timed_from
        return time.strftime("%H:%M:%S", time.gmtime((now - since) / (step - first) * (self.total_steps - step)))

    def eval(self, step, results):
        """results: the task's reported metrics and the example count."""
        self.line(f"eval step={step} {format_metrics(results)}")
        self.evaluated = step
        if self.chief:
            self._append("eval.jsonl", {"step": step, **results})
            self._scalars("eval", step, {k: v for k, v in results.items() if k != "examples"})

    def pictures(self, step, images):
        """A task's pictures at an evaluation ({name: uint8 array [height, width, channels]}): each as
        workdir/<name>.png (the latest) and as a TensorBoard image of the eval run, on the chief."""
        if not self.chief:
            return
        for name, image in images.items():
            path = os.path.join(self.workdir, f"{name}.png")
            with writing(path):  # a picture that cannot be encoded fails as a write of it (exit 4)
                replace_text(path, tf.io.encode_png(tf.convert_to_tensor(image, tf.uint8)).numpy())
            with writing(os.path.join(self.workdir, "eval")), self._writers["eval"].as_default(step=step):
                tf.summary.image(name, tf.convert_to_tensor(image, tf.uint8)[None], step=step)

    def histograms(self, step, values):
        """{name: numpy array} as TensorBoard histograms of the train run at `step` (an action's: the weights and
        their gradients), on the chief; rewound with the run's other records."""
        if not self.chief:
            return
        with writing(os.path.join(self.workdir, "train")), self._writers["train"].as_default(step=step):
            for name, value in values.items():
                tf.summary.histogram(name, value)

    def scalars(self, step, values):
        """{name: number} as TensorBoard scalars of the train run at `step` (an action's), on the chief; rewound with
        the run's other records."""
        if self.chief:
            self._scalars("train", step, values)

    def summary(self, summary):
        """Writes summary.json."""
        if not self.chief:
            return
        write_json(os.path.join(self.workdir, "summary.json"), summary)  # NaN as null, its evaluation's too
        for name, writer in self._writers.items():
            with writing(os.path.join(self.workdir, name)):
                writer.flush()

    def count_losses(self, after, step):
        """From now on counts the lines after step `after` (where the last logging window of an uninterrupted run
        begins) toward train_loss, starting with those the run logged up to `step`, where this process starts: a run
        resumed inside the window counts the lines its earlier processes logged there. Every worker reads them."""
        self._last_window, self._window_from, self._window = after, 0, []
        for record in self._records(step):
            self._count_loss(record)

    def _count_loss(self, record):
        if record["step"] <= self._last_window:
            self._window_from, self._window = record["step"], []
        else:
            self._window.append(record)

    def train_loss(self):
        """The mean loss over the finite steps of the last logging window (count_losses, window_mean)."""
        return self.window_mean("loss")

    def window_mean(self, name):
        """The mean of `name` (a loss, a gradient norm: what a line holds as its mean over its finite steps) over the
        finite steps of the last logging window (count_losses): one number whether the run went through in one
        process or was stopped and resumed inside the window. The lines' sums add up in float64, as the rounds
        summed their steps. None before the window's first line."""
        total, finite, counted_from = 0.0, 0, self._window_from
        own = name.rpartition("/")[0] + "/skipped_steps"  # an update's own, where each skips alone (float16)
        for record in self._window:
            skipped = record.get(own, record.get("skipped_steps", 0))
            steps, counted_from = record["step"] - counted_from - skipped, record["step"]
            value = record.get(name)
            if steps and value is not None:
                total, finite = total + value * steps, finite + steps
        if len(self._window) == 1:  # the window in one line: its own mean, not the mean remade from its sum
            return self._window[0].get(name)
        return total / finite if finite else None

    def _records(self, step):
        """metrics.jsonl's records up to `step`, in order ([] when there is none yet; a torn last line is left out,
        as rewind drops it)."""
        lines = _read_lines(os.path.join(self.workdir, "metrics.jsonl"))
        return [json.loads(line) for line in lines if line.endswith("\n") and _step_of(line) <= step]

    def logged_at(self, step):
        """metrics.jsonl's record of `step`, or None: a round's numbers as the run logged them, for a process that
        resumed at the last step and ran no round itself."""
        records = self._records(step)
        return records[-1] if records and records[-1]["step"] == step else None

    def logged_throughput(self, step):
        """examples/s over the rounds metrics.jsonl logged up to `step` that traced nothing (`traced`; a record from
        before it was kept: every round after the first), for a process that resumed at the last step and timed no
        round itself; None where every round traced."""
        records = self._records(step)
        if not records or records[-1]["step"] != step:
            return None
        pairs = zip([{"step": 0}, *records], records)
        rounds = [
            (b["step"] - a["step"], b["examples_per_sec"]) for a, b in pairs if not b.get("traced", b is records[0])
        ]
        rounds = [(steps, rate) for steps, rate in rounds if rate]
        seconds = sum(steps / rate for steps, rate in rounds)
        return sum(steps for steps, _ in rounds) / seconds if seconds else None

    def _append(self, name, record):
        path = os.path.join(self.workdir, name)
        append_text(path, json_text(record) + "\n")  # an evaluation's NaN as null, as a train line's

    def _scalars(self, writer, step, values):
        with writing(os.path.join(self.workdir, writer)), self._writers[writer].as_default(step=step):
            for name, value in values.items():
                if value is not None:
                    tf.summary.scalar(name, value)
