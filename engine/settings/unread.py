"""Who reads a setting, in words, and the settings given that no part of a run reads: refused when typed on the
command line, a warning when a flagfile brings them (launch.py)."""

from engine.settings.fields import (
    CLUSTER,
    EVALUATING_MODES,
    ONE_DEVICE_MODES,
    SAMPLING,
    TFDS_NAMES,
    TRAINING_MODES,
    applies,
    read_in_mode,
    readers,
)


def unread(config, given):
    """[(name, its readers in words)] of the settings in `given` (names set by the user) that no part of a run of
    `config` reads: another task's, model's, source's or optimizer's (--gan_critic_steps on a classification run,
    --momentum with --optimizer=adamw)."""
    return [(name, read_by(name, config.mode)) for name in given if not applies(name, config)]


# The selectors an evaluation, an export or a sample takes from its own command line (the others from the trained
# run's config.json): whether a setting only they select is read is known before the run's settings are.
COMMAND_LINE_SELECTORS = ("mode", "strategy", "cluster_resolver")


def unread_by_the_mode(config, given):
    """unread() of the settings in `given` that only the command line selects in a mode that rebuilds a trained run
    (--export_dir, --eval_timeout, --tpu; the sample_* settings outside --mode=sample): those of another mode, or of
    a strategy this command does not run on."""
    selected = [
        name
        for name in given
        if not read_in_mode(name, config.mode)
        or (readers(name) and all(selector in COMMAND_LINE_SELECTORS for selector, _ in readers(name)))
    ]
    return unread(config, selected)


def read_by(name, mode=None):
    """A setting's readers in words: read by --dataset=folder, ... and tensorflow-datasets names. `mode`: the run's
    --mode, named first where no run of it reads the setting (--num_cpu_devices to an export, --histogram_every to
    an evaluation)."""
    if name in CLUSTER and mode in ONE_DEVICE_MODES:
        return f"read by {_in_words(f'--mode={each}' for each in EVALUATING_MODES)}"
    said = _in_words(
        f"--{selector}={value}" if value else f"an empty --{selector}" for selector, value in readers(name)
    )
    if name in SAMPLING:
        return f"read by --mode=sample of {said}"
    if mode is not None and not read_in_mode(name, mode):  # an action's own
        return f"read by {_in_words(f'--mode={each}' for each in TRAINING_MODES)} of {said}"
    return f"read by {said}"


def _in_words(names):
    """Readers as a sentence lists them, sorted: '--a=1, --a=2 and tensorflow-datasets names'."""
    names = sorted(names)
    if f"--dataset={TFDS_NAMES}" in names:
        names = [said for said in names if said != f"--dataset={TFDS_NAMES}"] + ["tensorflow-datasets names"]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
