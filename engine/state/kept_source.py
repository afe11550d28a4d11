"""What a run's config.json keeps of its source, under "source": the spec of one example as the source gives it and
the source's info (a classification's num_classes and class_names, a text's vocabulary, a regression's training
statistics). --mode=export and --mode=sample build the task from them and read no data: a run trained on a cluster's
data exports where that data is not (engine/run/build.py).

Kept exactly or not at all: numpy arrays with their dtype and shape, tuples as tuples, numbers as they are. An info
that holds what JSON cannot say exactly (a fork's own object, bytes, NaN), or more than MAX_BYTES of it, is not
kept, and those modes read the data as evaluation does.
"""

import json
import math

import numpy as np
import tensorflow as tf

MAX_BYTES = 1 << 20  # a vocabulary of 100,000 words fits; a fork's info that carries arrays of data does not


class _Unkept(ValueError):
    """A value JSON cannot hold exactly."""


def record(spec, info):
    """{"spec": ..., "info": ...} for config.json, or None where the info cannot be kept exactly (module doc), or
    there is no spec to keep."""
    if not spec:
        return None
    try:
        kept = {
            "spec": {name: {"shape": s.shape.as_list(), "dtype": s.dtype.name} for name, s in spec.items()},
            "info": _encoded(info),
        }
    except _Unkept:
        return None
    return kept if len(json.dumps(kept)) <= MAX_BYTES else None


def source(kept):
    """(spec, info) from what config.json keeps (`record`); None where it keeps none, or none that reads back (a
    config.json from before it kept one, or one edited by hand): the data is read then."""
    try:
        spec = {name: tf.TensorSpec(s["shape"], tf.as_dtype(s["dtype"])) for name, s in kept["spec"].items()}
        return spec, _decoded(kept["info"])
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def _encoded(value):
    """`value` as JSON: what JSON holds as it is, and {kind: ...} for the rest ("dict", "tuple", "array", "number")."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):
        if isinstance(value, float) and not math.isfinite(value):
            raise _Unkept(value)
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind not in "biuf" or (array.dtype.kind == "f" and not np.isfinite(array).all()):
            raise _Unkept(value)
        kind = "array" if isinstance(value, np.ndarray) else "number"
        return {kind: array.ravel().tolist(), "dtype": array.dtype.name, "shape": list(array.shape)}
    if isinstance(value, (list, tuple)):
        items = [_encoded(v) for v in value]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encoded(v) for k, v in value.items()}}
    raise _Unkept(value)


def _decoded(value):
    """The value `_encoded` wrote."""
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "dict" in value:
        return {k: _decoded(v) for k, v in value["dict"].items()}
    if "tuple" in value:
        return tuple(_decoded(v) for v in value["tuple"])
    kind = "array" if "array" in value else "number"
    array = np.asarray(value[kind], dtype=value["dtype"]).reshape(value["shape"])
    return array if kind == "array" else array[()]
