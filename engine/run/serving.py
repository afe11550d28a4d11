"""What --mode=export saves of a run: its models' variables, the task's serving function and its class names."""

import inspect

import tensorflow as tf

from engine.settings.errors import raising_task_errors


def module(run):
    """(the tf.Module --mode=export saves of `run`, the concrete function of its `serve`): `serve` is the task's serving
    function with its inputs' shapes checked (checking_shapes), `variables_by_path` the models' variables and, for a
    task with classes, `class_names` the names of its class indices."""
    saved = tf.Module()
    saved.variables_by_path = run.state.tracked()["models"]  # tracked: the SavedModel holds them
    saved.serve = checking_shapes(run.task.serve(run.models))
    with raising_task_errors():  # a task's serve that cannot be traced: one line, before anything is written
        signature = saved.serve.get_concrete_function()
    names = run.task.class_names
    if names is not None:  # what each class index means, readable without a prediction: loaded.class_names
        with tf.device("/cpu:0"):  # strings have no GPU kernels
            saved.class_names = tf.Variable(names, trainable=False, name="class_names")
    return saved, signature


def checking_shapes(served):
    """`served` (a tf.function with an input_signature) that first checks each input's shape against its signature.
    A SavedModel's signature checks only the dtype of what it is given: a tensor of another shape ran through the
    model, and an MLP flattened a channels-first [n, 3, h, w] batch as [n, h, w, 3] and answered other classes. Here it
    is refused: InvalidArgumentError "Shape of tensor images [n,3,h,w] is not compatible with expected shape
    [?,h,w,3]"."""
    specs = getattr(served, "input_signature", None)
    if specs is None:  # nothing to check against (exporting it fails as it did)
        return served
    specs = _named(specs, served)

    @tf.function(input_signature=specs)
    def serve(*inputs):
        return served(*tf.nest.map_structure(_checked, list(inputs), list(specs)))

    return serve


def _checked(tensor, spec):
    return tf.ensure_shape(tensor, spec.shape, name=spec.name)


def _named(specs, served):
    """`specs` with each unnamed TensorSpec named after `served`'s parameter: the SavedModel's signature calls an
    input by its spec's name, which the wrapper's own (`inputs_0`) would replace (a client calling serve(z=...))."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = inspect.signature(served.python_function).parameters.values()
    names = [p.name for p in parameters if p.kind in positional]
    names += [None] * (len(specs) - len(names))  # those a *args takes keep the wrapper's names
    return [
        tf.TensorSpec(spec.shape, spec.dtype, name=name) if isinstance(spec, tf.TensorSpec) and not spec.name else spec
        for spec, name in zip(specs, names)
    ]
