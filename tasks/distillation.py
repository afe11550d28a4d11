"""Distillation: a classification student learns from a frozen teacher's soft targets (Hinton et al. 2015).

--teacher names the workdir of a trained classification run on the same dataset and classes: its config.json rebuilds
the teacher's model, its newest checkpoint restores the weights (the moving average, where that run kept one), and the
teacher is frozen. The student is --model. Per example, with T = --distill_temperature and w = --distill_weight:

    loss = w * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - w) * cross-entropy(label, student)

The soft term's gradients shrink as 1/T^2; the T^2 keeps the two terms' balance whatever T. Evaluation, export and
ensembles see the student alone, a classifier: its accuracy and cross-entropy, with the teacher's accuracy on the
same split beside them. The run's checkpoints hold the teacher too; training, resuming and evaluating rebuild it
from --teacher's config.json (keep that workdir), export serves the student alone and needs no teacher.
"""

import tensorflow as tf

from tasks import classification

DATASET = "digits"  # the default --dataset
SETTINGS = {
    "teacher": (
        "",
        "workdir of a trained classification run; its model, frozen, supplies the soft targets",
        "required",
    ),
    "distill_temperature": (4.0, "divides teacher and student logits in the soft-target term (higher is softer)"),
    "distill_weight": (
        0.9,
        "weight of the soft-target KL term (times T^2); the label cross-entropy gets 1 - it",
        (0.0, 1.0),
    ),
}


class Task(classification.Task):
    def __init__(self, config, spec, info):
        super().__init__(config, spec, info)
        self.teacher_accuracy = None  # measured at the first evaluation: the teacher never changes

    def models(self, create):
        student = super().models(create)
        if self.config.mode == "export":  # the SavedModel serves the student: it holds no teacher
            return student
        # Checked against this run, rebuilt from --teacher's config.json, restored and frozen by the engine.
        where, spec = self.config.teacher, self.spec[self.input]
        teacher = create.trained(where, spec, self.outputs, flag="teacher", task="classification")
        return {**student, "teacher": teacher}

    def forward(self, models, batch, training):
        student = models["model"](batch["image"], training=training)
        if not training:  # evaluation, export, ensembles: the student alone
            return student
        # The teacher in inference mode: its batch-norm statistics as trained, no dropout.
        teacher = models["teacher"](batch["image"], training=False)
        return {"student": student, "teacher": tf.stop_gradient(teacher)}

    def loss(self, outputs, batch):
        if not isinstance(outputs, dict):  # the student's evaluation loss: its cross-entropy, as classification's
            return super().loss(outputs, batch)
        temperature, weight = self.config.distill_temperature, self.config.distill_weight
        student = tf.cast(outputs["student"], tf.float32)
        teacher = tf.cast(outputs["teacher"], tf.float32) / temperature
        soft = tf.reduce_sum(
            tf.nn.softmax(teacher) * (tf.nn.log_softmax(teacher) - tf.nn.log_softmax(student / temperature)), axis=-1
        )
        return weight * temperature**2 * soft + (1.0 - weight) * super().loss(student, batch)

    def probe(self, models, examples):
        if self.teacher_accuracy is None and "teacher" in models:
            predict = tf.function(lambda x: tf.argmax(models["teacher"](x, training=False), -1, output_type=tf.int64))
            correct = weights = 0.0
            for batch in examples(self.config.eval_split):
                hit = tf.cast(predict(batch["image"]) == batch["label"], tf.float32)
                correct += float(tf.reduce_sum(batch["weight"] * hit))
                weights += float(tf.reduce_sum(batch["weight"]))
            self.teacher_accuracy = correct / weights
        return {} if self.teacher_accuracy is None else {"teacher_accuracy": self.teacher_accuracy}
