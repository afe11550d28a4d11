"""The interface of the controller's actions: what the outer loop does after a round of steps.

The controller (engine/run/controller.py) runs a round, then hands it to each action in turn. An action says when
rounds must end for it (`every`: a period, whose multiples end a round, as --eval_every's do; `steps`: steps that
end one, as --profile_steps' do), when it is due (`due`: a function of the step the round ended at, and whether the run
is stopping there), what it needs from the step besides its scalars (`needs`: "gradients" asks the round's last step
to return its all-reduced, clipped gradients, "updates" the change each update's last apply made to its variables;
the step returns them only on the rounds where an action that needs them is due), and what it does (`__call__`). The
engine's own duties (log, warnings, the NaN policy, evaluate, checkpoint, stop on a signal, profile) are actions
(engine/run/actions/builtin.py); a fork's is one file beside them, named by --actions or by its task's `ACTIONS`.
"""

import contextlib
import dataclasses
import json

from engine.settings import plugins
from engine.settings.errors import TaskError


class NotAsked(TaskError, KeyError):
    """An action read what the step did not return this round (a KeyError too, for an action that handles one)."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key

    def __str__(self):
        return f"round.extras[{self.key!r}]: not returned this round"


class Extras(dict):
    """A round's extras, {need: value}: reading one the step did not return this round is NotAsked."""

    def __missing__(self, key):
        raise NotAsked(key)


@dataclasses.dataclass(frozen=True)
class Round:
    """A round of steps that ran: steps start+1..end, in `seconds`. `out`: the inner loop's numbers (the mean loss,
    each update's last rates, gradient norm and loss scale, the skipped steps); `extras`: what the due actions
    needed from the round's last step ({"gradients": {<model>/<path>: numpy array}}, and alike "updates");
    `stopping`: a signal stops the run after this round (every worker alike); `traced`: the round traced (and
    compiled) a step it had not run before, the first round's or the one that returns an action's extras, so its
    seconds are not the steps' own; `planned`: the step it was to end at, past `end` where a signal cut it short
    (None: `end`)."""

    start: int
    end: int
    seconds: float
    out: dict
    extras: dict = dataclasses.field(default_factory=dict)
    stopping: bool = False
    traced: bool = False
    planned: int | None = None

    @property
    def steps(self):
        return self.end - self.start


ROLLED_BACK = "rolled back"  # an outcome: the round was undone; the controller reads on from the restored step


@dataclasses.dataclass(frozen=True)
class Stop:
    """An outcome: the run stops here (a tuner pruned it at an evaluation); `results` are the run's. `by`: what the
    summary's `stopped_by` says stopped it (the action's file when None)."""

    results: dict
    by: str = None


class Action:
    """One duty of the controller after a round. `context` (engine/run/controller.py Context): the run (its models,
    weights, evaluator, program), its report (console, metrics, TensorBoard), its checkpoints and the rounds'
    timing. A fork's action subclasses this as `class Action(base.Action)` in engine/run/actions/<name>.py, built as
    `Action(config)`; its settings are declared in its file (`SETTINGS`) like a model's."""

    needs = frozenset()  # what it reads from the step on the rounds it is due at: {"gradients"}, {"updates"}
    every = 0  # a period in steps: a round ends at each of its multiples, so the action can be due there (0: none)
    steps = ()  # steps a round ends at, for the same reason (--profile_steps: a trace of exactly those steps)

    def __init__(self, config=None):
        """A fork's is built as Action(config): one with no settings of its own needs no __init__ (the engine's own
        are built with theirs)."""

    def due(self, step, stopping):
        """Whether it acts after a round that ended at `step` (`stopping`: the run stops there on a signal; asked as
        False before the round runs, when the controller asks what the step must return): at each multiple of
        `every`, after every round without one."""
        return not self.every or step % self.every == 0

    def around(self, start, end, context):
        """A context manager around the round from `start` to `end` (a profiler's trace); none by default."""
        return contextlib.nullcontext()

    def __call__(self, round, context):
        """Acts on the round; returns None to go on, ROLLED_BACK or Stop(results)."""

    def close(self, context):
        """The run ends (an error or a signal included): finish what is open."""

    def checkpointed(self):
        """What of the action a checkpoint holds, so that a resumed run (and a rollback) goes on with it as an
        uninterrupted one does: JSON (numbers, strings, lists, dicts keyed by strings), read at every save; None:
        nothing (the default). An early stop's best value and patience count are such state: kept only in Python, a
        kill and resume would start them afresh and stop at another step."""
        return None

    def restored(self, value):
        """`value`, what checkpointed() returned when the checkpoint now restored was saved (a resume, a rollback)."""


def hold(actions, variable):
    """Puts the state each of `actions` says a checkpoint holds (Action.checkpointed) into `variable` (the run's
    State.actions), as JSON {action's file: value}, before a save. TaskError naming the file for a value JSON cannot
    hold."""
    held = {}
    for action in actions:
        value = action.checkpointed()
        if value is not None:
            held[plugins.file_of(action)] = _as_json(value, plugins.file_of(action))
    variable.assign(json.dumps(held, sort_keys=True))


def _as_json(value, where):
    """`value` as a checkpoint hands it back; TaskError naming `where` for one JSON cannot hold, or would hand back
    changed: a dict key that is no string comes back a string ({3: x} as {"3": x}), which a resumed action reads
    as another key."""
    try:
        back, problem = json.loads(json.dumps(value)), None
    except (TypeError, ValueError) as e:  # a circular one too, before its keys are walked
        back, problem = None, str(e)
    keys = [] if problem else _keys_not_strings(value)
    if keys:
        problem = f"its dict key {keys[0]!r} is no string, and would come back as one"
    if problem:
        raise TaskError(
            f"{where}: checkpointed() returned {value!r:.80}, which a checkpoint cannot hold ({problem}): return "
            "numbers, strings, lists and dicts keyed by strings"
        )
    return back


def _keys_not_strings(value):
    """The dict keys in `value`, nested in its dicts and lists too, that are no strings."""
    if isinstance(value, dict):
        inner = [key for v in value.values() for key in _keys_not_strings(v)]
        return [key for key in value if not isinstance(key, str)] + inner
    if isinstance(value, (list, tuple)):
        return [key for v in value for key in _keys_not_strings(v)]
    return []


def hand_back(actions, variable):
    """Hands each of `actions` the state `variable` holds for it (Action.restored), after a restore; nothing where
    the checkpoint held none for it (one from before checkpoints held the actions' state: "")."""
    held = json.loads(variable.numpy().decode() or "{}")
    for action in actions:
        if plugins.file_of(action) in held:
            action.restored(held[plugins.file_of(action)])
