"""Whether a run fits the memory of the device it trains on, judged before its models are built and refused in one
line naming the setting to change: on a GPU, each GPU holds a replica's model, gradients and optimizer slots and its
share of the batch; on a CPU, this machine (or its container) holds every local replica's model and the batches.

Each part comes from the file that knows it: a model family's `size(config, input_shape, outputs)` (models/), a data
source's `memory(config)` (the data it generates, sources/synthetic.py, or reads into memory, sources/npz.py). A family
without `size` is not estimated, and the run says so. A run that does not train (eval, export, sample) is judged on its
model's weights and an evaluation batch alone (export and sample: the weights). A TPU's memory is not known before its
system starts: its runs are not judged here.
"""

import dataclasses
import importlib
import math

import numpy as np

from engine.settings import plugins
from engine.settings.checks import fail
from engine.settings.errors import TaskError
from engine.settings.fields import MEMORY_SETTINGS, ONE_DEVICE_MODES, Config, applies, dataset_kind
from engine.settings.machine import gpu_memory_bytes, host_memory_bytes, human_bytes


def model_size(config, input_shape, outputs):
    """(parameters, activation floats per example kept for the backward pass, floats per example a forward pass
    holds at once) of models/<config.model>.py's `size` (a family may leave out the third: then the second), or None
    without one. TaskError naming the file for anything else."""
    size = getattr(importlib.import_module(f"models.{config.model}"), "size", None)
    if size is None:
        return None
    sized = size(config.plugin("model", config.model), input_shape, outputs)
    if not isinstance(sized, (tuple, list)) or len(sized) not in (2, 3) or not all(_count(n) for n in sized):
        raise TaskError(
            f"{plugins.file('model', config.model)}: size(config, input_shape, outputs) returned {sized!r:.80}, not "
            "(parameters, activation floats per example[, floats a forward pass holds at once]): finite numbers of at "
            "least 0"
        )
    parameters, activations, *forward = sized
    return parameters, activations, forward[0] if forward else activations


def check_estimate(config, input_shape, outputs, model):
    """Warns where models/<config.model>.py's `size` says fewer parameters than `model`, which it built, holds by over
    a tenth: the memory check went by the estimate, and a run it let through may not fit."""
    sized = model_size(config, input_shape, outputs)
    held = sum(math.prod(v.shape) for v in model.weights)
    if sized is not None and held > 1.1 * sized[0]:
        print(
            f"warning: {plugins.file('model', config.model)}: size(config, input_shape, outputs) says "
            f"{sized[0]:,} parameters, and the model it built holds {held:,}: the memory check went by the estimate",
            flush=True,
        )


def source_memory(config):
    """Bytes the data source says its data takes (its `memory(config)`: data it generates), or 0. TaskError naming
    the file for anything but a number of at least 0."""
    kind = dataset_kind(config.dataset)
    module = importlib.import_module(f"sources.{kind}") if kind != "tensorflow-datasets" else None
    memory = getattr(module, "memory", None)
    if memory is None:
        return 0
    needed = memory(config.plugin("dataset", kind))
    if not _count(needed):
        raise TaskError(
            f"{plugins.file('dataset', kind)}: memory(config) returned {needed!r:.80}, not the bytes its data takes "
            "(a finite number of at least 0)"
        )
    return needed


def _count(value):
    """Whether `value` is a finite number of at least 0 (an estimate's part): infinity, or an integer past any
    float, would end the check in an OverflowError's traceback."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        return False
    try:
        return value >= 0 and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def estimate(config, input_shape, outputs, copies=1, shares=1, data=True, training=True):
    """{part: bytes} a device needs at least: `copies` of the model with its gradients and optimizer slots (the replicas
    it holds), the activations of its share (1/`shares`) of a training and of an evaluation batch, and the source's own
    data (`data`: on the host). A run that does not train (`training` False: eval, continuous_eval, export, sample)
    holds the model's weights alone and no training batch; export and sample no evaluation batch. Without a family's
    size, its parts are left out."""
    features = math.prod(input_shape)
    parameters, activations, forward = model_size(config, input_shape, outputs) or (0, 0, 0)
    slots = {"sgd": 1 if config.momentum else 0, "adamw": 2, "lamb": 2}[config.optimizer]
    if config.optimizer != "sgd" and config.first_moment_dtype == "bfloat16":
        slots -= 0.5  # its first moment in half the bytes
    batch = config.global_batch_size
    evaluation = 4 * config.per_eval_batch_size * (features + forward) // shares
    if config.mode in ONE_DEVICE_MODES:  # export and sample hold no batch
        evaluation = 0
    if not training:
        return _with_data(
            config, {"model": copies * 4 * parameters, "training batch": 0, "evaluation batch": evaluation}, data
        )
    parts = {
        # Accumulating (--grad_accum_steps) holds the microbatches' summed gradients beside each one's own.
        "model, gradients and optimizer slots": copies
        * int(4 * parameters * (2 + slots + (config.grad_accum_steps > 1))),
        # The forward pass's activations are kept for the backward pass, which adds their gradients, for one
        # microbatch at a time (--grad_accum_steps); an evaluation's forward pass keeps none, and holds a layer's at a
        # time.
        "training batch": 4
        * (batch * features + math.ceil(2 * batch * activations / config.grad_accum_steps))
        // shares,
        "evaluation batch": evaluation,
    }
    return _with_data(config, parts, data)


def _with_data(config, parts, data):
    """`parts` and, where `data`, the source's own data."""
    if data and source_memory(config):
        parts[f"{config.dataset} data"] = source_memory(config)
    return parts


def check_data(config):
    """Refuses, before its source makes it, data that does not fit this machine's memory (a source's `memory`)."""
    need, total = source_memory(config), host_memory_bytes()
    if need > total:
        default = Config()
        smaller = [
            n for n in MEMORY_SETTINGS if source_memory(dataclasses.replace(config, **{n: getattr(default, n)})) < need
        ]
        culprit = smaller[0] if smaller else "dataset"
        fail(
            culprit,
            getattr(config, culprit),
            f"its data needs about {human_bytes(need)} of memory, more than this machine's {human_bytes(total)}",
        )


def check(config, placement, input_shape, outputs, training=True):
    """Refuses the run when its estimate exceeds the memory of the device it trains on (naming the setting whose
    default would shrink it most; where none would, --model or the input's shape, whichever takes more); says so
    where the model family gives no size. A GPU holds one replica and its share of the batch; this machine's memory,
    every local replica (mirrored logical devices) and this worker's share. `placement`: the run's
    engine/cluster/distribute.py Placement; `training`: whether the run trains (a run built to evaluate, export or
    sample holds no gradients, slots or training batch)."""
    if outputs is None:  # a task that builds its own models (no outputs): one of --model is all the estimate knows
        print(
            f"memory: tasks/{config.task}.py builds its own models: estimated as one models/{config.model}.py of 2 "
            "outputs, which its models may exceed",
            flush=True,
        )
        outputs = 2
    if model_size(config, input_shape, outputs) is None:
        print(f"memory: models/{config.model}.py has no size(config, input_shape, outputs): not estimated", flush=True)
    device, replicas = placement.device, placement.replicas
    if device == "TPU":
        return
    gpu = gpu_memory_bytes() if device == "GPU" else None
    if gpu:
        judge(config, input_shape, outputs, gpu, "a GPU's", copies=1, shares=replicas, data=False, training=training)
        return
    local = max(1, replicas // placement.workers)  # workers: 1 in one process
    judge(
        config,
        input_shape,
        outputs,
        host_memory_bytes(),
        "this machine's",
        copies=local,
        shares=placement.workers,
        training=training,
    )


def need(parts):
    """The bytes a run of these parts needs at its peak: a training and an evaluation batch never live at once."""
    batches = max(parts["training batch"], parts["evaluation batch"])
    return sum(size for part, size in parts.items() if not part.endswith(" batch")) + batches


def judge(config, input_shape, outputs, total, where, copies=1, shares=1, data=True, training=True):
    """ConfigError when estimate(...) exceeds `total` bytes (`where`: whose memory, in words)."""
    parts = estimate(config, input_shape, outputs, copies, shares, data, training)
    needed = need(parts)
    if needed <= total:
        return
    default = Config()

    def with_default(name):
        changed = dataclasses.replace(config, **{name: getattr(default, name)})
        return need(estimate(changed, input_shape, outputs, copies, shares, data, training))

    culprit = min(MEMORY_SETTINGS, key=with_default)
    if with_default(culprit) >= needed:
        culprit = _at_fault(config, input_shape, outputs, parts)
    details = ", ".join(f"{part} {human_bytes(size)}" for part, size in parts.items() if size)
    shape = f" for examples of shape {'x'.join(str(n) for n in input_shape)}" if culprit in INPUT_SETTINGS else ""
    fail(
        culprit,
        getattr(config, culprit),
        f"needs about {human_bytes(needed)} of memory{shape} ({details}), more than {where} {human_bytes(total)}",
    )


# What gives a run's input its shape, which the estimate takes as the data gives it: no setting's default changes it.
INPUT_SETTINGS = ("image_size", "dataset")


def _at_fault(config, input_shape, outputs, parts):
    """What to name where no setting's default would shrink the estimate: the input's shape (--image_size where the
    run crops images to it, else --dataset) where the batches take the most and one example holds more numbers than
    the model has parameters (a ResNet on 1024x1024 images); else --model."""
    parameters = (model_size(config, input_shape, outputs) or (0,))[0]
    model = parts.get("model, gradients and optimizer slots", parts.get("model"))
    if max(parts["training batch"], parts["evaluation batch"]) > model and math.prod(input_shape) > parameters:
        return "image_size" if config.image_size and applies("image_size", config) else "dataset"
    return "model"
