"""Histograms of the trained weights and their gradients in TensorBoard, every --histogram_every steps.

A worked example of an action a fork adds in one file: histograms of every trained variable and of its
gradient, every --histogram_every steps, in TensorBoard (the train run's Histograms and Distributions tabs).

    python launch.py --actions=histograms --histogram_every=100

A round ends at every multiple of --histogram_every (`every`), whatever --steps_per_loop, and the action is due
there. It needs the step's gradients (`needs`), which the step returns only on the rounds it is due at: that step's
all-reduced, unscaled and clipped gradients, identical on every replica. The weights are read from the variables
after that step. A gradient that is not finite (a skipped float16 step's: nothing trained on it) has no histogram
there, as a histogram cannot bucket it: no point is written for it, and a line says so. Only the chief writes.
"""

import numpy as np

from engine.run.actions import base

SETTINGS = {"histogram_every": (100, "write the weights' and gradients' histograms every this many steps")}


class Action(base.Action):
    needs = frozenset({"gradients"})

    def __init__(self, config):
        self.every = config.histogram_every  # due at its multiples (Action.due), where rounds end

    def __call__(self, round, context):
        values = {f"weights/{name}": value for name, value in context.run.weights.arrays().items()}
        gradients = round.extras["gradients"]
        lost = [name for name, g in gradients.items() if not np.isfinite(g).all()]
        values.update({f"gradients/{name}": g for name, g in gradients.items() if name not in lost})
        context.report.histograms(round.end, values)
        if lost and context.report.chief:  # said: the round a user would look at
            more = f" and {len(lost) - 1} more" if lost[1:] else ""
            context.report.line(
                f"histograms: step {round.end}: the gradient of {lost[0]}{more} is not finite: no histogram of it"
            )
