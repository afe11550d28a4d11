"""Contrastive learning, SimCLR-style, with a linear probe of the frozen encoder.

Contrastive learning, SimCLR-style: two random views of each image; an encoder and a projection head learn
to tell an image's other view from every other view of the GLOBAL batch (NT-Xent). Reports the loss and the
linear-probe accuracy of the frozen encoder (a logistic regression on its embeddings, fitted on the training
split, scored on the evaluation split). The evaluation's loss takes its negatives from each evaluation batch, so it
depends on --eval_batch_size (a larger batch holds more negatives: a higher loss for the same encoder): compare
losses at one batch size; the probe's accuracy does not depend on it.

A batch holds `image` (any fixed height x width x channels; uint8 is scaled to [0, 1]) and `label`, which only
the probe reads. Each view is a function of (--seed, the example's `index`, the view) alone: the same example
gets the same views on one device, on several replicas or workers, and in a resumed run.
"""

import numpy as np
import tensorflow as tf

from engine.api import ConfigError
from tasks import base

DATASET = "digits"  # the default --dataset
SETTINGS = {
    "contrastive_temperature": (
        0.2,
        "divides the projections' cosine similarities in the NT-Xent loss (lower is sharper)",
    ),
    "contrastive_dim": (64, "width of the encoder's embedding and of the projection head"),
}

# The views: a zoom and a shift resampled bilinearly, a contrast and brightness change, pixel noise. Sized for
# small images like the 8x8 digits: a shift of a pixel or a zoom of 20% changes a digit's pixels a lot already.
MAX_SHIFT = 1.0  # pixels, each axis
ZOOM = (0.8, 1.2)  # the view spans this times the image's side
CONTRAST = (0.5, 1.5)  # multiplies each pixel's difference from the image's mean
BRIGHTNESS = 0.2  # added, +-
NOISE = 0.05  # standard deviation of the gaussian noise added to each pixel

MASKED = -1e9  # a logit no softmax picks: the anchor itself and padding (finite: padding weighs 0 x this)

# The linear probe: L2-regularized multinomial logistic regression on standardized embeddings, fitted by
# accelerated full-batch gradient descent with a step of 1/(the loss's smoothness): deterministic, no tuning.
PROBE_L2 = 1e-3
PROBE_STEPS = 500


class Task(base.Task):
    features = ("image", "label")
    input = "image"
    objective = ("probe_accuracy", "max")
    headline = "probe_accuracy"

    def __init__(self, config, spec, info):
        super().__init__(config, spec, info)
        if config.grad_accum_steps > 1:  # one device and several replicas would split the batch differently
            raise ConfigError(
                f"--grad_accum_steps={config.grad_accum_steps}: --task=contrastive draws its negatives from the "
                "whole global batch, which microbatches would split; use 1"
            )
        shape = tuple(spec["image"].shape)
        if len(shape) != 3:  # the views zoom, shift and resample rows and columns of each channel
            raise ConfigError(
                f"--dataset={config.dataset}: its image has shape {shape}; --task=contrastive draws its views from "
                "images of shape (height, width, channels)"
            )

    def prepare(self, batch):
        base.read_as_numbers(self, batch, ("label",))
        return {"image": base.float_image(self, batch), "label": tf.cast(batch["label"], tf.int64)}

    def models(self, create):
        dim = self.config.contrastive_dim
        encoder = create(self.config.model, self.spec["image"], dim)
        base.one_tensor(self, encoder, self.spec["image"])  # the head reads the embeddings as one tensor
        # Named layers: checkpoints key variables by path, which must not depend on what this process built before.
        head = tf.keras.Sequential(
            [
                tf.keras.layers.Dense(dim, activation="relu", name="hidden"),
                tf.keras.layers.Dense(dim, dtype="float32", name="projection"),
            ],
            name="head",
        )
        head(tf.zeros((1, dim)))  # variables exist before the first trace
        return {"encoder": encoder, "head": head}

    def forward(self, models, batch, training):
        images, index = batch["image"], batch["index"]
        views = [augment(images, base.example_keys(self.config.seed, index, view)) for view in (1, 2)]
        # Both views in one pass: batch-norm statistics see them together, as SimCLR's do.
        projections = models["head"](models["encoder"](tf.concat(views, 0), training=training), training=training)
        view1, view2 = tf.split(tf.math.l2_normalize(tf.cast(projections, tf.float32), axis=1), 2)
        return {"view1": view1, "view2": view2}

    def gather(self, rows):
        """(every replica's `rows`, stacked in replica order; the first row of this replica's own)."""
        ctx = tf.distribute.get_replica_context()
        local = tf.shape(rows)[0]
        own = tf.cast(ctx.replica_id_in_sync_group, tf.int32) * local
        if tf.executing_eagerly() and ctx.num_replicas_in_sync > 1:
            # --run_eagerly: MirroredStrategy refuses all_gather in eager mode. A SUM of every replica's rows,
            # each zero-padded to its own place, gathers the same values bit for bit, with the same gradient.
            others = (ctx.num_replicas_in_sync - 1) * local
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.pad(rows, [[own, others - own], [0, 0]])), own
        # The gradient of all_gather sums the upstream gradient over replicas and keeps this replica's rows: each
        # replica's projections learn from every anchor that used them as a negative or a positive.
        return ctx.all_gather(rows, axis=0), own

    def loss(self, outputs, batch):
        """NT-Xent of each local example: the mean over its two views of the cross-entropy of picking its other
        view among the 2G - 1 other views of the global batch (padding, weight 0, is no candidate)."""
        view1, view2 = outputs["view1"], outputs["view2"]
        local, dim = tf.shape(view1)[0], view1.shape[1]
        valid = tf.cast(batch["weight"] > 0, tf.float32) if "weight" in batch else tf.ones([local])
        # One collective for both views and the padding flags.
        every, first = self.gather(tf.concat([view1, view2, valid[:, None]], axis=1))
        total = tf.shape(every)[0]
        candidates = tf.concat([every[:, :dim], every[:, dim : 2 * dim]], axis=0)  # [2G, dim]: views 1, then 2
        usable = tf.tile(every[:, 2 * dim] > 0, [2])
        own = first + tf.range(local)  # this replica's examples' rows among the view-1 candidates

        def cross_entropy(anchors, itself, positive):
            logits = tf.matmul(anchors, candidates, transpose_b=True) / self.config.contrastive_temperature
            keep = usable[None, :] & (tf.range(2 * total)[None, :] != itself[:, None])
            return tf.nn.sparse_softmax_cross_entropy_with_logits(positive, tf.where(keep, logits, MASKED))

        per_example = 0.5 * (cross_entropy(view1, own, total + own) + cross_entropy(view2, total + own, own))
        return tf.where(valid > 0, per_example, 0.0)

    def probe(self, models, examples):
        embed = tf.function(lambda images: models["encoder"](images, training=False))

        def embedded(split):
            """(features, labels, weights) of the split's examples that count (padding weighs 0)."""
            features, labels, weights = [], [], []
            for batch in examples(split):
                weight = batch["weight"].numpy()
                real = weight > 0
                features.append(np.asarray(embed(batch["image"]), np.float64)[real])
                labels.append(batch["label"].numpy()[real])
                weights.append(weight[real].astype(np.float64))
            return tuple(np.concatenate(parts) for parts in (features, labels, weights))

        train, evals = embedded(self.config.train_split), embedded(self.config.eval_split)
        accuracy = linear_probe(*train[:2], *evals[:2], self.info["num_classes"], train[2], eval_weights=evals[2])
        return {"probe_accuracy": accuracy}

    def serve(self, models):
        spec = self.spec["image"]

        @tf.function(input_signature=[tf.TensorSpec([None, *spec.shape], tf.float32, name="images")])
        def serve(images):
            return {"embeddings": tf.cast(models["encoder"](images, training=False), tf.float32)}

        return serve


def _resampling(size, zoom, shift):
    """[n, size, size] matrices that resample one axis bilinearly: output pixel i reads the input at
    center + (i - center) * zoom + shift; outside the image reads 0."""
    center = (size - 1) / 2
    pixels = tf.range(size, dtype=tf.float32)
    source = center + (pixels[None, :] - center) * zoom[:, None] + shift[:, None]
    return tf.nn.relu(1.0 - tf.abs(source[:, :, None] - pixels[None, None, :]))


def augment(images, keys):
    """A random view of each image ([n, height, width, channels] in [0, 1]), a function of its row of `keys`."""
    height, width = images.shape[1], images.shape[2]
    u = base.example_uniforms(keys, 5 + images.shape[1:].num_elements())
    between = lambda low, high, column: low + (high - low) * u[:, column]  # noqa: E731
    zoom = between(*ZOOM, 0)
    rows = _resampling(height, zoom, between(-MAX_SHIFT, MAX_SHIFT, 1))
    columns = _resampling(width, zoom, between(-MAX_SHIFT, MAX_SHIFT, 2))
    views = tf.einsum("nij,njkc,nlk->nilc", rows, images, columns)
    mean = tf.reduce_mean(views, axis=[1, 2, 3], keepdims=True)
    contrast = tf.reshape(between(*CONTRAST, 3), [-1, 1, 1, 1])
    brightness = tf.reshape(between(-BRIGHTNESS, BRIGHTNESS, 4), [-1, 1, 1, 1])
    noise = NOISE * tf.reshape(tf.math.ndtri(u[:, 5:]), tf.shape(images))
    return tf.clip_by_value((views - mean) * contrast + mean + brightness + noise, 0.0, 1.0)


def linear_probe(
    train_features, train_labels, eval_features, eval_labels, classes, train_weights=None, eval_weights=None
):
    """Accuracy on the evaluation examples of a multinomial logistic regression fitted on the training ones
    (numpy arrays [n, d] and [n]), deterministically: features standardized by the training statistics, an
    L2-regularized cross-entropy minimized by Nesterov-accelerated gradient descent with a step of 1/L. Each example
    counts by its weight ([n], a source's `weight`; None: 1 each), in the fit as in the accuracy, as the engine's
    means count it (one of weight 0.01 counted as much as one of weight 1)."""
    counts = np.ones(len(train_features)) if train_weights is None else np.asarray(train_weights, np.float64)
    counted = counts[:, None]
    mean = (counted * train_features).sum(0) / counts.sum()
    std = np.sqrt((counted * (train_features - mean) ** 2).sum(0) / counts.sum())
    std[std == 0] = 1.0  # a constant feature (a border pixel) carries nothing

    def design(features):
        return np.concatenate([(features - mean) / std, np.ones((len(features), 1))], axis=1)

    x, targets = design(train_features), np.eye(classes)[train_labels]
    # The softmax cross-entropy's Hessian in the logits is at most 1/2: L bounds the loss's curvature.
    smoothness = 0.5 * np.linalg.eigvalsh((counted * x).T @ x / counts.sum())[-1] + PROBE_L2
    weights = previous = np.zeros((x.shape[1], classes))
    for t in range(PROBE_STEPS):
        ahead = weights + t / (t + 3) * (weights - previous)
        logits = x @ ahead
        probabilities = np.exp(logits - logits.max(1, keepdims=True))
        probabilities /= probabilities.sum(1, keepdims=True)
        gradient = x.T @ (counted * (probabilities - targets)) / counts.sum() + PROBE_L2 * ahead
        previous, weights = weights, ahead - gradient / smoothness
    predicted = np.argmax(design(eval_features) @ weights, axis=1)
    return float(np.average(predicted == eval_labels, weights=eval_weights))
