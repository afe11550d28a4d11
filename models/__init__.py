"""Model families, one file each: `--model=NAME` loads `models/NAME.py` and calls its
`create(config, spec, num_outputs, info)`, which returns a `tf.keras.Model`: `spec` is the tf.TensorSpec of one
input example, `info` what the data source knows of it (a text's `vocabulary`, a label's `num_classes`; {} when
nothing), so a model that sizes itself from its data (a character tagger's embedding) is a model file. A factory
of the older form, `create(config, input_shape, num_outputs)` (three parameters, the shape a tuple), is still
called that way.

A family's own settings are declared in its file as a literal `SETTINGS = {"name": (default, "help")}`:
each becomes a flag and a field of the run's Config (engine/config.py), read by the runs that choose the
family; a file that reads a setting another file declares names it in `READS = ("name", ...)`. `create`
reads them from `config` and raises ValueError("--name=value: why") for a value it cannot build. Models
never import the engine. The last layer computes in float32 so the loss is float32
under any precision.

This file imports no TensorFlow: flags are checked against it before TensorFlow starts.
"""

import ast
import math
import os


def read_constant(path, name, default):
    """The literal value a module assigns to `name` at its top level, read from its file without importing it
    (no TensorFlow starts), or `default`."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    return default


def available():
    """The model names `--model` accepts: the families in this directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(
        name[:-3] for name in os.listdir(here) if name.endswith(".py") and name[:-3].isidentifier() and name[0] != "_"
    )


def size(config, input_shape, num_classes):
    """(parameters, activation floats per example) of the model `config` names, for estimating its memory
    before it exists; parameters are exact (Keras's count_params), activations what a forward pass keeps
    for the backward one, roughly. (0, 0) for a family without a formula here: a fork adds one beside these."""
    features = math.prod(input_shape)
    if config.model == "mlp":
        widths = [features, *config.hidden_sizes, num_classes]
        parameters = sum(a * b + b for a, b in zip(widths, widths[1:]))
        return parameters, sum(widths)
    if config.model == "resnet":
        return _resnet(config, input_shape, num_classes)
    if config.model == "transformer":
        return _transformer(config, input_shape, num_classes)
    if config.model == "gpt":
        return _gpt(config, input_shape, num_classes)
    return 0, 0


def _resnet(config, input_shape, num_classes):
    height, width, channels = (list(input_shape) + [1, 1, 1])[:3]
    norm = lambda c: 4 * c  # noqa: E731  (gamma, beta and the two moving statistics)
    stem = config.resnet_width
    parameters = 9 * channels * stem + norm(stem)
    activations = 2 * height * width * stem  # the stem's convolution and norm
    previous = stem
    for stage in range(3):
        filters = config.resnet_width * 2**stage
        if stage:
            height, width = math.ceil(height / 2), math.ceil(width / 2)
        for block in range((config.resnet_depth - 2) // 6):
            parameters += 9 * previous * filters + 9 * filters * filters + 2 * norm(filters)
            if previous != filters or (stage and block == 0):
                parameters += previous * filters + norm(filters)
            activations += 5 * height * width * filters  # two convolutions, two norms, the sum
            previous = filters
    return parameters + previous * num_classes + num_classes, activations + previous + num_classes


def _transformer(config, input_shape, num_classes):
    tokens, features = input_shape[0], math.prod(input_shape[1:])
    dim, heads, mlp = config.transformer_dim, config.transformer_heads, config.transformer_mlp_dim
    attention = 4 * dim * dim + 3 * dim + dim  # query, key, value, output kernels and their biases
    block = 2 * 2 * dim + attention + dim * mlp + mlp + mlp * dim + dim
    parameters = features * dim + dim + tokens * dim + config.transformer_layers * block
    parameters += 2 * dim + dim * num_classes + num_classes
    # Per block: the norms, query/key/value, attention output, residuals (about 8 x dim per token), the MLP's
    # hidden layer before and after its activation, and every head's token-by-token scores and softmax.
    activations = tokens * features + config.transformer_layers * (tokens * (8 * dim + 2 * mlp) + 2 * heads * tokens**2)
    return parameters, activations + num_classes


def _gpt(config, input_shape, vocabulary):
    tokens, dim, layers = input_shape[0], config.gpt_dim, config.gpt_layers
    # Per block: two norms (4 x dim), query/key/value (3 x dim wide), the output projection, the 4x MLP.
    block = 4 * dim + (dim * 3 * dim + 3 * dim) + (dim * dim + dim) + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim)
    parameters = vocabulary * dim + tokens * dim + layers * block + 2 * dim + dim * vocabulary + vocabulary
    # Per token and block: norms, query/key/value, attention output and projection, residuals, the MLP's hidden
    # layer before and after its activation (about 17 x dim); every head's scores and softmax; the logits.
    activations = tokens * (2 * dim + layers * 17 * dim + vocabulary) + layers * 2 * config.gpt_heads * tokens**2
    return parameters, activations
