"""An ensemble's arithmetic (research/ensemble.py): the members' predictions combined with weights, scored as an
evaluation scores them, and the weights on the simplex fitted on validation. SciPy is imported where Nelder-Mead
runs: it takes a second."""

import numpy as np

from engine.run.evaluator import reported, weighed
from engine.settings import plugins

_TINY = np.finfo(np.float64).tiny  # keeps log() finite for a probability that underflowed to 0


def combine(predictions, weights, mean="arithmetic"):
    """The weighted mean of the members' predictions: arithmetic, or (probabilities) geometric, renormalized so
    each example's probabilities sum to 1."""
    weights, stacked = np.asarray(weights, np.float64), np.stack(predictions)
    if mean == "arithmetic":
        return np.tensordot(weights, stacked, axes=1)
    logs = np.tensordot(weights, np.log(np.maximum(stacked, _TINY)), axes=1)
    logs -= logs.max(axis=-1, keepdims=True)  # the largest becomes exp(0) = 1: nothing overflows or all underflows
    combined = np.exp(logs)
    return combined / combined.sum(axis=-1, keepdims=True)


def scores(task, predictions, examples):
    """The task's reported numbers for `predictions` of `examples`, like an evaluation: the means of its
    per-example scores, each example counted by its `weight` (1 each where `examples` carry none), through its
    report; with the examples counted, as an evaluation counts them (the weights' sum: an int where it is whole).
    A member scored each example as 1, unlike its own run's evaluation of fractional weights."""
    given = examples.get("weight") if examples else None
    counts = np.ones(len(predictions)) if given is None else np.asarray(given, np.float64)
    scored = task.score(predictions, examples).items()
    means = {name: float(np.average(values, weights=counts)) for name, values in scored}
    where = f"{plugins.file_of(task)}: report"
    return {**reported(task.report(means), where), "examples": weighed(np.float32(counts.sum()))}


def fit_weights(predictions, examples, task, config):
    """Weights on the simplex (non-negative, summing to 1) fitted on validation only.

    The search minimizes the validation loss (the task's score `loss`: cross-entropy for probabilities), which is
    smooth, where accuracy on a few hundred examples is a staircase. The answer is then chosen by the task's
    objective on validation (ties: the loss) among the fitted weights, the plain average and every member alone,
    so it is never worse on validation than the best member. Returns (weights, which candidate they are, the
    search's own weights).
    """
    count = len(predictions)
    objective, direction = task.objective
    memo = {}

    def result(weights):
        key = tuple(np.asarray(weights, np.float64))
        if key not in memo:
            memo[key] = scores(task, combine(predictions, weights, config.ensemble_mean), examples)
        return memo[key]

    def loss(weights):
        return result(weights)["loss"]

    if config.ensemble_search == "random":
        rng = np.random.default_rng(config.seed)
        draws = rng.dirichlet(np.ones(count), size=config.ensemble_samples)  # uniform on the simplex
        # With its center and corners, so the search is never worse than the average or a member alone.
        fitted = min([np.full(count, 1.0 / count), *np.eye(count), *draws], key=loss)
    else:
        fitted = _nelder_mead(loss, count)
    candidates = [(fitted, config.ensemble_search), (np.full(count, 1.0 / count), "plain average")]
    candidates += [(np.eye(count)[i], f"member {i} alone") for i in range(count)]

    def rank(candidate):
        numbers = result(candidate[0])
        value = numbers.get(objective, numbers["loss"])
        return (-value if direction == "max" else value, numbers["loss"])

    weights, chosen = min(candidates, key=rank)
    return weights, chosen, fitted


def _nelder_mead(loss, count):
    """scipy's Nelder-Mead over |z| / sum |z|, which maps every point to the simplex; started from the plain
    average and from each member alone, the best end wins."""
    from scipy.optimize import minimize  # deferred: scipy takes a second to import

    def on_simplex(z):
        z = np.abs(z)
        return z / z.sum() if z.sum() > 0 else np.full(count, 1.0 / count)

    best = None
    for start in [np.full(count, 1.0 / count), *np.eye(count)]:
        simplex = np.vstack([start, start + 0.5 * np.eye(count)])  # steps large enough to leave a corner
        result = minimize(
            lambda z: loss(on_simplex(z)),
            start,
            method="Nelder-Mead",
            options={"initial_simplex": simplex, "xatol": 1e-4, "fatol": 1e-7, "maxiter": 400 * count},
        )
        if best is None or result.fun < best.fun:
            best = result
    return on_simplex(best.x)
