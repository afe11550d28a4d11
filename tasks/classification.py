"""Classification: an input and an integer label; softmax cross-entropy; accuracy.

A batch holds `image` (any fixed shape; uint8 is scaled to [0, 1]) and `label` (an integer class).
"""

import numpy as np
import tensorflow as tf

from tasks import base

DATASET = "digits"  # the default --dataset


class Task(base.Task):
    features = ("image", "label")
    input = "image"
    objective = ("accuracy", "max")
    headline = "accuracy"
    ensemble = "probabilities"

    @property
    def outputs(self):
        return self.info["num_classes"]

    @property
    def class_names(self):
        """Label i's name: the source's (a folder: run's class folders), else "i", as tensorflow-datasets names the
        classes of a label given only their number. The export returns them beside the indices."""
        return tuple(self.info.get("class_names") or (str(i) for i in range(self.info["num_classes"])))

    def models(self, create):
        models = super().models(create)
        base.one_tensor(self, models["model"], self.spec[self.input])
        return models

    def prepare(self, batch):
        base.read_as_numbers(self, batch, ("label",))
        return {"image": base.float_image(self, batch), "label": tf.cast(batch["label"], tf.int64)}

    def loss(self, outputs, batch):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(batch["label"], tf.cast(outputs, tf.float32))

    def metrics(self, outputs, batch):
        logits = tf.cast(outputs, tf.float32)
        correct = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int64), batch["label"])
        return {"loss": self.loss(logits, batch), "accuracy": tf.cast(correct, tf.float32)}

    def serve(self, models):
        spec = self.spec["image"]
        names = tf.constant(self.class_names)

        @tf.function(input_signature=[tf.TensorSpec([None, *spec.shape], tf.float32, name="images")])
        def serve(images):
            logits = tf.cast(self.forward(models, {"image": images}, False), tf.float32)
            classes = tf.argmax(logits, axis=-1, output_type=tf.int64)
            return {
                "logits": logits,
                "probabilities": tf.nn.softmax(logits),
                "classes": classes,
                "class_names": tf.gather(names, classes),
            }

        return serve

    def predictions(self, outputs):
        return tf.nn.softmax(tf.cast(outputs, tf.float64))

    def score(self, predictions, batch):
        labels = np.asarray(batch["label"])
        picked = predictions[np.arange(len(labels)), labels]
        return {
            "loss": -np.log(np.maximum(picked, np.finfo(predictions.dtype).tiny)),
            "accuracy": (np.argmax(predictions, axis=1) == labels).astype(np.float64),
        }
