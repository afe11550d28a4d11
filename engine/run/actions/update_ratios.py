"""Each variable's ||update|| / ||weights|| in TensorBoard every --update_ratio_every steps; the largest printed.

How far each update moves each trained variable, relative to the variable as it stood before the move, as
TensorBoard scalars (update_ratio/<model>/<path>) and one console line naming the largest.

    python launch.py --actions=update_ratios --update_ratio_every=100

A rough health check of a learning rate: with Adam-like rules a ratio near 1e-3 is the usual sight, far above it the
weights churn, far below they barely move. It needs the step's "updates" (`needs`): the change each update's last
apply of the round's last step made to its variables, identical on every replica; the ratio is per apply, against
the weights before that apply (the weights after it, read from the variables, less the change). A variable that
moved not at all there (its update not due at that step, Update.every; a skipped float16 step) or that was all zeros
before has no ratio: no point is written for it. A variable no update trains has none either. On parameter servers
the weights read after the round include other workers' updates since. Only the chief writes.
"""

import numpy as np

from engine.run.actions import base

SETTINGS = {"update_ratio_every": (100, "log each variable's ||update|| / ||weights|| every this many steps")}


def ratios(weights, updates):
    """{name: ||update|| / ||weights before it||} from {name: the weights after it} and {name: the update} of the
    variables an update moved; one that did not move (its update not applied) or was all zeros before (a fresh bias)
    has no ratio and is left out."""
    found = {}
    for name, update in updates.items():
        change = np.asarray(update, np.float64)
        before = np.linalg.norm(np.asarray(weights[name], np.float64) - change)
        moved = np.linalg.norm(change)
        if moved > 0 and before > 0:
            found[name] = float(moved / before)
    return found


class Action(base.Action):
    needs = frozenset({"updates"})

    def __init__(self, config):
        self.every = config.update_ratio_every  # due at its multiples (Action.due), where rounds end

    def __call__(self, round, context):
        found = ratios(context.run.weights.arrays(), round.extras["updates"])
        context.report.scalars(round.end, {f"update_ratio/{name}": value for name, value in found.items()})
        largest = max(found, key=found.get, default=None)
        if largest is not None:
            context.report.line(f"update_ratios step={round.end} largest={found[largest]:.3g} ({largest})")
