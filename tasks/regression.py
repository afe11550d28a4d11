"""Regression: a float32 feature vector and a float32 target; squared error; RMSE and MAE in the target's units.

A source gives `features` and `target` in their own units and, in `info`, the mean and standard deviation of
each feature (`feature_mean`, `feature_std`) and of the target (`target_mean`, `target_std`) over its TRAINING
split. Batches are standardized with those, so the model sees inputs and a target of unit scale whatever the
units, and the loss is the mean squared error of the standardized target. Evaluation, export and ensembles
speak the target's own units: the served model takes raw features and returns predictions in those units.
"""

import math

import numpy as np
import tensorflow as tf

from tasks import base

DATASET = "penguins"  # the default --dataset


class Task(base.Task):
    features = ("features", "target")
    input = "features"
    objective = ("rmse", "min")
    headline = "rmse"
    ensemble = "values"
    outputs = 1

    def __init__(self, config, spec, info):
        super().__init__(config, spec, info)
        self.feature_mean = np.asarray(info["feature_mean"], np.float32)
        self.feature_std = np.asarray(info["feature_std"], np.float32)
        self.target_mean, self.target_std = float(info["target_mean"]), float(info["target_std"])

    def standardize(self, features):
        """Raw features -> what the model reads."""
        return (tf.cast(features, tf.float32) - self.feature_mean) / self.feature_std

    def unstandardize(self, target):
        """A standardized target -> the target's own units."""
        return target * self.target_std + self.target_mean

    def models(self, create):
        models = super().models(create)
        base.one_tensor(self, models["model"], self.spec[self.input])
        return models

    def prepare(self, batch):
        base.read_as_numbers(self, batch, ("features", "target"))
        target = (tf.cast(batch["target"], tf.float32) - self.target_mean) / self.target_std
        return {"features": self.standardize(batch["features"]), "target": target}

    def loss(self, outputs, batch):
        return tf.square(tf.cast(outputs, tf.float32)[:, 0] - batch["target"])

    def metrics(self, outputs, batch):
        # The error scaled back to the target's units (the mean cancels in a difference).
        error = (tf.cast(outputs, tf.float32)[:, 0] - batch["target"]) * self.target_std
        return {"loss": self.loss(outputs, batch), "mse": tf.square(error), "mae": tf.abs(error)}

    def report(self, means):
        return {**means, "rmse": math.sqrt(means["mse"])}

    def serve(self, models):
        spec = self.spec["features"]

        @tf.function(input_signature=[tf.TensorSpec([None, *spec.shape], tf.float32, name="features")])
        def serve(features):
            outputs = self.forward(models, {"features": self.standardize(features)}, False)
            return {"predictions": self.unstandardize(tf.cast(outputs, tf.float32)[:, 0])}

        return serve

    def predictions(self, outputs):
        return self.unstandardize(tf.cast(outputs, tf.float64)[:, 0])

    def score(self, predictions, batch):
        target = self.unstandardize(np.asarray(batch["target"], np.float64))
        error = np.asarray(predictions, np.float64) - target
        return {"loss": np.square(error / self.target_std), "mse": np.square(error), "mae": np.abs(error)}
