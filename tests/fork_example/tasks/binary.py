"""Binary classification: an input and a 0/1 label; one logit, sigmoid cross-entropy; accuracy and the Brier
score (the squared error of the predicted probability).

A task is one file, tasks/<name>.py, with `class Task(base.Task)`: --task=binary finds it."""

import tensorflow as tf

from tasks import base

DATASET = "spirals"  # the default --dataset


class Task(base.Task):
    features = ("point", "label")  # what a batch holds
    input = "point"  # what the model reads
    objective = ("accuracy", "max")  # what tuning optimizes
    headline = "accuracy"  # what launch.py prints at the end
    outputs = 1  # one logit

    def prepare(self, batch):
        return {"point": tf.cast(batch["point"], tf.float32), "label": tf.cast(batch["label"], tf.float32)}

    def loss(self, outputs, batch):
        # Per example: the engine sums it and divides by the global batch.
        return tf.nn.sigmoid_cross_entropy_with_logits(batch["label"], tf.cast(outputs[:, 0], tf.float32))

    def metrics(self, outputs, batch):
        logit = tf.cast(outputs[:, 0], tf.float32)
        correct = tf.equal(logit > 0, batch["label"] > 0.5)
        return {
            "loss": self.loss(outputs, batch),
            "accuracy": tf.cast(correct, tf.float32),
            "brier": tf.square(tf.sigmoid(logit) - batch["label"]),
        }
