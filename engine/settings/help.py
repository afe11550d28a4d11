"""The text of `launch.py --help`: what a newcomer asks first, the plugins of this checkout (each named by its file,
with its docstring's first line), then every flag in the group of what it is about. No TensorFlow here: the files
are read, not imported."""

import ast
import dataclasses
import re
import textwrap

from engine.settings import plugins
from engine.settings.fields import BUNDLED_DATASETS, CLUSTER, Config, Switch

USAGE = (
    "usage: python launch.py [--flag=value ...]",
    "Trains, evaluates, exports, tunes or ensembles a model (--mode). With no flags it trains an MLP on the bundled "
    "digits on one device (no network) and prints the test accuracy.",
    "Flag files: --flagfile=experiments/digits_resnet.flags reads flags from a file, one --flag=value a line (# "
    "starts a comment); flags after it override it: --flagfile=experiments/digits_resnet.flags --train_steps=200.",
    "Resuming: a run resumes from the latest checkpoint in its --workdir without being asked: after a crash, Ctrl-C "
    "or a preemption, run the same command again. A workdir holds one run: other model settings there are refused "
    "(start them in a new --workdir); a finished run says so and does nothing.",
    "Datasets (--dataset): {bundled} (bundled, no network; digits is the default), {files}, or any "
    "tensorflow-datasets name (mnist, cifar10, ...: downloaded into --data_dir on first use).",
    "GPUs: with no --strategy a run mirrors over every visible GPU (else one device); choose them with "
    "CUDA_VISIBLE_DEVICES=0,1 python launch.py ..., or one with --strategy=one_device. Several workers, TPUs: "
    "BUILD.md.",
    "--helpfull also lists absl's own flags.",
)
# The plugins a fork adds, one file each: what --help lists of each kind, by the flag that names one.
PLUGINS = (
    ("Models (--model=NAME: models/NAME.py)", "model"),
    ("Tasks (--task=NAME: tasks/NAME.py)", "task"),
    (
        "Data sources (--dataset=NAME: sources/NAME.py; any other name: tensorflow-datasets)",
        "dataset",
    ),
    ("Actions after each round (--actions=NAME: engine/run/actions/NAME.py)", "actions"),
)

# Every engine setting by what it is about; the settings a model, task or data source declares in its own file
# join the group of what declares them (_group). tests/test_newcomer.py checks each flag is shown exactly once.
HELP_GROUPS = {
    "The run": (
        "mode",
        "workdir",
        "task",
        "train_steps",
        "global_batch_size",
        "eval_batch_size",
        "steps_per_loop",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "grad_accum_steps",
        "init_checkpoint",
        "freeze",
        "on_nan",
        "seed",
        "deterministic",
        "run_eagerly",
        "profile_steps",
        "actions",
    ),
    "Data": (
        "dataset",
        "data_dir",
        "train_split",
        "eval_split",
        "shuffle_buffer",
        "interleave_files",
        "image_size",
        "tf_data_service",
    ),
    "Model": ("model", "dropout"),
    "Task": (),
    "Optimizer": (
        "optimizer",
        "learning_rate",
        "momentum",
        "nesterov",
        "beta_1",
        "beta_2",
        "epsilon",
        "first_moment_dtype",
        "weight_decay",
        "warmup_steps",
        "lr_schedule",
        "lr_scaling",
        "base_batch_size",
        "clip_norm",
        "clip_value",
        "ema_decay",
    ),
    "Precision and compilation": (
        "precision",
        "initial_loss_scale",
        "loss_scale_growth_interval",
        "jit_compile",
        "compile_cache",
    ),
    "Devices and clusters": CLUSTER,
    "Modes": (
        "checkpoint",
        "export_dir",
        "eval_timeout",
    ),  # and research's modes' own settings, declared in their files (_DECLARED_GROUP)
}
_DECLARED_GROUP = {
    "model": "Model",
    "task": "Task",
    "dataset": "Data",
    "actions": "The run",
    "mode": "Modes",
}  # by the setting that selects the file


def _group(field):
    if "owner" in field.metadata:
        return _DECLARED_GROUP[field.metadata["owner"][0]]
    found = [title for title, names in HELP_GROUPS.items() if field.name in names]
    return found[0] if found else "The run"  # an engine setting added without a group still shows


def _flag_line(field):
    """The flag as it is typed, with its default; a bool as --[no]name."""
    if field.type is bool:
        return f"--[no]{field.name}", f"default: {str(field.default).lower()}"
    if field.type is Switch:
        return f"--{field.name}={'|'.join(Switch.VALUES)}", f"default: {field.default}"
    default = ",".join(str(v) for v in field.default) if field.type is tuple else str(field.default)
    if not default:
        return f"--{field.name}=", "default: empty"
    if default.strip() != default:  # a newline or a space: shown as Python writes it
        return f"--{field.name}", f"default: {default!r}"
    return f"--{field.name}={default}", ""


def accepted(field):
    """What a plugin's setting accepts beyond its type, as its file declares it (engine/settings/declared.py): a
    number's range, a string's choices, "required"; "" for none declared, and for the engine's own settings, whose
    help says it."""
    bounds = field.metadata.get("bounds")
    if bounds == "required":
        return "required where read"
    if not bounds:
        return ""
    if field.type is str and _names_each(field.metadata.get("help", ""), bounds):
        return ""  # its help says them already ("nelder_mead|random"): once is enough
    if field.type is str:
        return "one of " + "|".join(c or "(empty)" for c in bounds)
    low, high = bounds
    return f"at least {low:,}" if high is None else f"from {low:,} to {high:,}"


def _names_each(text, choices):
    """Whether help `text` names each of `choices` (but the empty one) as a word of its own, as "a|b" does: then
    --help does not say them twice."""
    return all(re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", text) for choice in choices if choice)


def summary(path):
    """The first line of a file's docstring (its summary line), read without importing it: what the plugin is, in
    its own words."""
    with open(path) as f:
        try:
            doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
        except SyntaxError:  # --help lists it without one, then ends on the line that names it (declared.py)
            doc = ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def plugin_lines(width=110, column=34):
    """Each kind of plugin with the files of this checkout and their summaries."""
    lines = []
    for title, kind in PLUGINS:
        lines.append(f"{title}:")
        for name in plugins.names(kind):
            wrapped = textwrap.wrap(summary(plugins.path(kind, name)), width - column) or [""]
            lines.append(f"  {name.ljust(column - 3)} {wrapped.pop(0)}".rstrip())
            lines.extend(" " * column + rest for rest in wrapped)
        lines.append("")
    return lines


def usage(width=110, column=34):
    """The text of --help: USAGE, the plugins, then each group's flags with their defaults and help."""
    files = plugins.file_sources()  # the sources that read your files, as their files say
    bundled = ", ".join(name for name in BUNDLED_DATASETS if name not in files)
    files = ", ".join(f"{name}:{argument} ({what})" for name, (argument, what) in files.items())
    lines = []
    for paragraph in USAGE:
        lines += [*textwrap.wrap(paragraph.format(bundled=bundled, files=files), width, subsequent_indent="  "), ""]
    lines += plugin_lines(width, column)
    fields = dataclasses.fields(Config)
    for title, names in HELP_GROUPS.items():
        lines.append(f"{title}:")
        grouped = [f for f in fields if _group(f) == title]
        for field in sorted(grouped, key=lambda f: names.index(f.name) if f.name in names else len(names)):
            flag, default = _flag_line(field)
            said = "; ".join(part for part in (accepted(field), default) if part)
            text = field.metadata["help"] + (f" ({said})" if said else "")
            wrapped = textwrap.wrap(text, width - column)
            if len(flag) + 2 >= column - 1:
                lines.append(f"  {flag}")
            else:
                lines.append(f"  {flag.ljust(column - 3)} {wrapped.pop(0)}")
            lines.extend(" " * column + rest for rest in wrapped)
        lines.append("")
    return "\n".join(lines)
