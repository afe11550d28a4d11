"""What a study leaves in its workdir (research/tune.py): summary.json with every trial, best.flags that trains the best
trial again, and tune_report.png (research/tune_report.py)."""

import dataclasses
import os
import warnings

import optuna

from engine.settings.fields import Config, show
from engine.state.files import write_json, write_text
from research import tune_report
from research.tune_study import FINISHED, RESUMES, best_trial, masked, storage_url, trial_config, trial_workdir


def results(config, study, space, objective, direction, wall_seconds):
    """Writes summary.json, best.flags (once a trial is complete) and tune_report.png; returns the summary."""
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state in FINISHED]
    resumed = interrupted(trials)
    best = best_trial(study)
    importances = param_importances(study)
    summary = {
        "study": config.tune_study,
        "storage": masked(storage_url(config)),
        "task": config.task,
        "objective": objective,
        "direction": direction,
        "split": config.validation_split,
        "sampler": config.tune_sampler,
        "pruner": config.tune_pruner,
        "trials": len(finished),
        "complete": sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials),
        "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in trials),
        "failed": sum(t.state == optuna.trial.TrialState.FAIL and t.number not in resumed for t in trials),
        "interrupted": len(resumed),
        "wall_seconds": wall_seconds,
        "trial_seconds": sum(t.duration.total_seconds() for t in finished if t.duration),
        "importances": importances,
        "best": None,
        "all": [
            {
                "number": t.number,
                "state": "interrupted" if t.number in resumed else t.state.name.lower(),
                "value": t.value,
                "params": t.params,
                "steps": t.user_attrs.get("steps"),
                "workdir": trial_workdir(config, t),
                "seconds": t.duration.total_seconds() if t.duration else None,
                # Why a pruned trial that diverged stopped (its loss, the steps, the last good checkpoint); None else.
                "diverged": t.user_attrs.get("diverged"),
            }
            for t in trials
        ],
    }
    if best is not None:
        flagfile = os.path.join(config.workdir, "best.flags")
        write_flagfile(flagfile, config, best, space, objective)
        summary["best"] = {
            "trial": best.number,
            "value": best.value,
            "params": best.params,
            "steps": best.user_attrs.get("steps"),
            "workdir": trial_workdir(config, best),
            "flagfile": flagfile,
        }
    write_json(os.path.join(config.workdir, "summary.json"), summary)
    tune_report.plot(
        os.path.join(config.workdir, "tune_report.png"), config, trials, space, best, importances, objective, direction
    )
    return summary


def interrupted(trials):
    """The numbers of the failed trials that a later trial resumed from their checkpoints (a tuner preempted or
    killed inside them; research/tune_study.py requeue): they failed no draw."""

    def origin(trial):
        return trial.user_attrs.get(RESUMES, trial.number)

    return {
        t.number
        for t in trials
        if t.state == optuna.trial.TrialState.FAIL
        and any(r.number > t.number and r.user_attrs.get(RESUMES) == origin(t) for r in trials)
    }


def param_importances(study):
    """PED-ANOVA (Optuna's default; fANOVA would need scikit-learn): how much each parameter separates the
    best trials from the rest."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():  # that the quantiles select the same trials: the zero sum below says it
            warnings.simplefilter("ignore")
            raw = optuna.importance.get_param_importances(study, normalize=False)
    except (ValueError, RuntimeError):  # e.g. every complete trial drew the same values
        return {}
    total = sum(raw.values())
    # All zero when no parameter tells the best trials from the rest (say, all tied): Optuna would then call
    # every parameter equally important.
    return {name: value / total for name, value in sorted(raw.items(), key=lambda kv: -kv[1])} if total > 0 else {}


def write_flagfile(path, config, best, space, objective):
    """best.flags: every flag of the best trial that differs from the defaults, plus its seed and determinism,
    so `launch.py --flagfile=best.flags` trains it again and reaches the same number."""
    run_config = trial_config(config, best.params, best.number)
    default = Config()
    searched = {p.name for p in space}
    tuner_only = {"mode", "workdir", "eval_split", "validation_split", "members", "checkpoint", "export_dir"}
    lines = []
    for field in dataclasses.fields(Config):
        name, value = field.name, getattr(run_config, field.name)
        if name in tuner_only or name.startswith(("tune_", "ensemble_")) or name in ("seed", "deterministic"):
            continue
        if name in searched or value != getattr(default, name):
            lines.append(f"--{name}={show(value)}")
    lines += [
        f"--eval_split={config.validation_split}",
        f"--workdir={os.path.join(config.workdir, 'best')}",
        f"--seed={run_config.seed}",
        f"--deterministic={show(run_config.deterministic)}",
    ]
    exact = (
        "the same numbers"
        if run_config.deterministic
        else "numbers within run-to-run noise (the trials ran without --deterministic)"
    )
    header = [
        f"# Best trial {best.number} of study '{config.tune_study}' ({config.workdir}): "
        f"{config.validation_split} {objective} {best.value:.6g} at step {best.user_attrs.get('steps')}.",
        f"#   python launch.py --flagfile={path}",
        f"# reruns it with {exact}; add --eval_split=test (after the flagfile) for its held-out {objective}.",
    ]
    write_text(path, "\n".join(header + lines) + "\n")  # never through a link planted at the name
