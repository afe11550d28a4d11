"""A custom step: binary classification trained with mixup (Zhang et al., 2018). Each training example is mixed
with another of its batch, and so is its label, by a weight drawn from Beta(alpha, alpha) (--mixup_alpha).
Evaluation, metrics and export are binary's.

The step's math is the task's forward and loss: a different step (another loss, several models, augmentation
inside the step) is one task file; the engine still owns the global-batch loss, the one all-reduce, the finite
check, clipping and the update."""

import tensorflow as tf

from tasks import binary

DATASET = "spirals"  # the default --dataset (read from this file, not inherited)
SETTINGS = {"mixup_alpha": (0.2, "mixing weights are drawn from Beta(alpha, alpha): a small alpha mixes little")}


class Task(binary.Task):
    def forward(self, models, batch, training):
        if not training:
            return super().forward(models, batch, training)
        point, label = batch["point"], batch["label"]
        examples = tf.shape(label)[0]  # dynamic: a multi-worker or microbatched batch has no static size
        # Seeded by the batch's position in the training stream: a resumed run mixes as an uninterrupted one.
        seed = tf.stack([batch["index"][0], tf.constant(self.config.seed, tf.int64)])
        gammas = tf.random.stateless_gamma(tf.stack([2, examples]), seed, alpha=self.config.mixup_alpha)
        weight = gammas[0] / (gammas[0] + gammas[1])
        partner = tf.reverse(tf.range(examples), [0])  # each example's partner in the batch

        def mix(x):
            w = tf.reshape(weight, [-1] + [1] * (x.shape.rank - 1))
            return w * x + (1.0 - w) * tf.gather(x, partner)

        return {"logits": models["model"](mix(point), training=True), "label": mix(label)}

    def loss(self, outputs, batch):
        if isinstance(outputs, dict):  # training: the mixed labels
            return super().loss(outputs["logits"], {"label": outputs["label"]})
        return super().loss(outputs, batch)
