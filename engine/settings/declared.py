"""The settings a model family, task, data source, action or research mode declares in its own file (SETTINGS),
and the settings it reads that another file declares (READS), read from the plugins' files without importing them
(engine/settings/plugins.py).
"""

import dataclasses
import keyword
import math
import os

from engine.settings import plugins
from engine.settings.plugins import RepeatedKey, read_constant

_TYPES = {bool: bool, int: int, float: float, str: str, tuple: tuple}


def declared_settings(packages, root, engine_names, reserved=None):
    """The settings each model family, task and bundled source declares in its own file, and who else reads them.

    A file declares its own settings as `SETTINGS = {"name": (default, "help")}`, `(default, "help", (low, high))`
    for a number's range, or `(default, "help", "required")` for a string that must be given: --resnet_depth is
    resnet's, read by runs of --model=resnet. A file that reads a setting another file declares (shakespeare
    reads language_model's --sequence_length, folder the engine's --image_size) names it in its own
    `READS = ("name", ...)`, so a run that selects it depends on that setting too. `packages` is
    ((selecting setting, directory, module names), ...); `engine_names` the engine's own settings; `reserved` the
    names no setting may have, each with what it is (Config's sections: config.loop).

    Returns (fields for the Config, {setting: {(selecting setting, module) of each READS}}, errors): a name two
    files declare, or that a READS names and nobody declares, is a fork's mistake, one line naming the files,
    which validate() refuses, so every command fails with it instead of importing a broken Config."""
    owners = dict.fromkeys(engine_names, "engine/settings/fields.py")
    owners.update({name: f"engine/settings/sections.py ({what})" for name, what in (reserved or {}).items()})
    fields, errors = [], []
    files = [
        (flag, module, os.path.join(directory, f"{module}.py"))
        for flag, directory, names in packages
        for module in names
    ]
    for flag, module, path in files:
        where = os.path.relpath(path, root)
        _check_defaults(flag, path, where, errors)
        declared = _literal(path, where, "SETTINGS", {}, errors)
        if not isinstance(declared, dict):
            errors.append(f"{where}: SETTINGS must be a dict of name: (default, help), not {type(declared).__name__}")
            continue
        for name, declaration in declared.items():
            if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)):
                errors.append(f"{where}: SETTINGS names {name!r}: a setting's name is a flag's, as resnet_depth")
                continue
            if name in owners:
                errors.append(
                    f"{where}: declares the setting {name}, which {owners[name]} declares already: rename one of them"
                )
                continue
            wrong = _malformed(declaration)
            if wrong:
                errors.append(
                    f'{where}: SETTINGS[{name!r}] must be (default, "help"[, range, choices or "required"]) with '
                    f"a bool, int, float, str or tuple default: {wrong}"
                )
                continue
            owners[name] = where
            default, help_text, *bounds = declaration
            metadata = {"help": f"{module}: {help_text}", "bounds": bounds[0] if bounds else None}
            metadata.update(owner=(flag, module), readers=frozenset({(flag, module)}))
            fields.append((name, _TYPES[type(default)], dataclasses.field(default=default, metadata=metadata)))
    return fields, _readers(files, root, owners, errors), errors


def _check_defaults(flag, path, where, errors):
    """Adds to `errors` what a plugin file says of itself that the engine reads from its text before it imports it
    (engine/settings/plugins.py) and cannot use: a source's ARGUMENT that is not ("NAME", "what it names"); a task's
    DATASET or MODEL that is not a name, or ACTIONS that is not a tuple of files of engine/run/actions/. Read
    unchecked, each ended the run that chose the file in a traceback."""
    if flag == "dataset":
        argument = _literal(path, where, "ARGUMENT", None, errors)
        if argument is not None and not plugins.is_argument(argument):
            errors.append(
                f'{where}: ARGUMENT must be ("NAME", "what it names"), as ("PATH", "a folder"), not {argument!r}'
            )
    if flag != "task":
        return
    for name in ("DATASET", "MODEL"):
        value = _literal(path, where, name, None, errors)
        if value is not None and not (isinstance(value, str) and value):
            errors.append(f'{where}: {name} must be a name, as "digits" or "mlp", not {value!r:.60}')
    actions = _literal(path, where, "ACTIONS", (), errors)
    if not (isinstance(actions, (tuple, list)) and all(isinstance(name, str) for name in actions)):
        errors.append(f'{where}: ACTIONS must be a tuple of action names, as ("histograms",), not {actions!r:.60}')
        return
    for name in (name for name in actions if name not in plugins.names("actions")):
        errors.append(
            f"{where}: ACTIONS names {name}, which is not a file of engine/run/actions/ "
            f"({', '.join(plugins.names('actions'))})"
        )


def _literal(path, where, name, default, errors):
    """`name`'s literal value in the file at `path` (read_constant), or `default` with the error in `errors`."""
    try:
        return read_constant(path, name, default)
    except SyntaxError as e:  # the file itself, said once whatever is read of it
        said = f"{where}: not Python that parses: {e.msg} (line {e.lineno})"
        if said not in errors:
            errors.append(said)
        return default
    except RepeatedKey as e:
        errors.append(f"{where}: {name} {e}")
        return default
    except (ValueError, TypeError) as e:  # not a literal: an expression, a name
        errors.append(f"{where}: {name} must be written as a literal (numbers, strings, tuples, dicts), not {e}")
        return default


def _malformed(declaration):
    """What is wrong with a SETTINGS entry, in words, or "" for a good one."""
    if not (isinstance(declaration, tuple) and 2 <= len(declaration) <= 3):
        return f"not {declaration!r:.60}"
    default, help_text, *bounds = declaration
    kind = type(default)
    if kind not in _TYPES:
        return f"a {kind.__name__} default"
    if not isinstance(help_text, str) or not help_text:
        return f"its help is {help_text!r:.60}, not a string"
    if kind is tuple and not all(type(v) is int for v in default):
        return f"a tuple default is of integers (a flag's 64,64), not {default!r:.60}"
    # A default its own checks (engine/settings/checks.py _check_declared) refuse would refuse every run, of any
    # model or task, naming a flag nobody gave: said here, naming the file.
    if kind is tuple and not (default and min(default) > 0):
        return f"a tuple default is of positive integers, not {default!r:.60}"
    if kind in (int, float) and not bounds and not (default > 0 and math.isfinite(default)):
        return f"a number's default with no range is positive, not {default!r:.60}"
    if not bounds:
        return ""
    bound = bounds[0]
    if kind is str:
        good = bound == "required" or (isinstance(bound, tuple) and all(isinstance(c, str) for c in bound))
        if good and isinstance(bound, tuple) and default not in bound:
            return f"its default {default!r:.60} is none of its choices {bound!r:.60}"
        return "" if good else f'a string\'s choices are a tuple of strings or "required", not {bound!r:.60}'
    # (low, high), or (low, None) for no upper bound: a lower one is always given.
    number = lambda b: isinstance(b, (int, float)) and not isinstance(b, bool)  # noqa: E731
    numbers = (
        isinstance(bound, tuple) and len(bound) == 2 and number(bound[0]) and (bound[1] is None or number(bound[1]))
    )
    if not (kind in (int, float) and numbers):
        return f"a range (low, high) of numbers, not {bound!r:.60}"
    low, high = bound
    inside = low <= default <= high if high is not None else default >= low >= 0
    return "" if inside else f"its default {default!r:.60} is outside its range {bound!r:.60}"


def _readers(files, root, owners, errors):
    """{setting: {(selecting setting, module) of each file whose READS names it}}; a READS that is malformed or
    names a setting nobody declares (`owners`: {setting: the file that declares it}) is added to `errors`."""
    reads = {}
    for flag, module, path in files:
        where = os.path.relpath(path, root)
        named = _literal(path, where, "READS", (), errors)
        if not (isinstance(named, (tuple, list)) and all(isinstance(name, str) for name in named)):
            errors.append(f"{where}: READS must be a tuple of setting names, not {named!r}")
            continue
        for name in named:
            if name not in owners:
                errors.append(f"{where}: READS {name}, which no file declares")
                continue
            reads.setdefault(name, set()).add((flag, module))
    return reads


def packages():
    """((selecting setting, directory, module names), ...) of the plugins whose files declare settings: model
    families, tasks, data sources, actions and research's modes (engine/settings/plugins.py)."""
    return [(kind, plugins.directory(kind), plugins.names(kind)) for kind in plugins.FOLDERS]
