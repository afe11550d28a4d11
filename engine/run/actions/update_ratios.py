"""Each variable's ||update|| / ||weights|| in TensorBoard every --update_ratio_every steps; the largest printed.

How far each update moves each trained variable, relative to the variable as it stood before the update, as
TensorBoard scalars (update_ratio/<model>/<path>) and one console line naming the largest.

    python launch.py --actions=update_ratios --update_ratio_every=100

A rough health check of a learning rate: with Adam-like rules a ratio near 1e-3 is the usual sight, far above it the
weights churn, far below they barely move. It needs the step's "updates" (`needs`): the change the round's last step
applied to each variable, identical on every replica (zero where that step was skipped or its update not due). The
weights after the step are read from the variables, those before it are the weights less the change. Only the chief
writes.
"""

import numpy as np

from engine.run.actions import base

SETTINGS = {"update_ratio_every": (100, "log each variable's ||update|| / ||weights|| every this many steps")}


def ratios(weights, updates):
    """{name: ||update|| / ||weights before it||} from {name: weights after the update} and {name: the update}; a
    variable that was all zeros before (a fresh bias) has no ratio: NaN."""
    found = {}
    for name, after in weights.items():
        change = np.asarray(updates[name], np.float64)
        before = np.linalg.norm(np.asarray(after, np.float64) - change)
        found[name] = float(np.linalg.norm(change) / before) if before > 0 else float("nan")
    return found


class Action(base.Action):
    needs = frozenset({"updates"})

    def __init__(self, config):
        self.every = config.update_ratio_every  # due at its multiples (Action.due), where rounds end

    def __call__(self, round, context):
        found = ratios(context.run.weights.arrays(), round.extras["updates"])
        context.report.scalars(round.end, {f"update_ratio/{name}": value for name, value in found.items()})
        largest = max((name for name in found if np.isfinite(found[name])), key=found.get, default=None)
        if largest is not None:
            context.report.line(f"update_ratios step={round.end} largest={found[largest]:.3g} ({largest})")
