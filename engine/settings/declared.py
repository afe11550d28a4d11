"""The settings a model family, task or bundled source declares in its own file (SETTINGS), and the settings
it reads that another file declares (READS): found by convention in models/, tasks/ and sources/,
read without importing those files.
"""

import dataclasses
import os

import models
import sources
import tasks

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the checkout: error messages name files from it

_TYPES = {bool: bool, int: int, float: float, str: str, tuple: tuple}


def declared_settings(packages, root, engine_names, reserved=()):
    """The settings each model family, task and bundled source declares in its own file, and who else reads them.

    A file declares its own settings as `SETTINGS = {"name": (default, "help")}`, `(default, "help", (low, high))`
    for a number's range, or `(default, "help", "required")` for a string that must be given: --resnet_depth is
    resnet's, read by runs of --model=resnet. A file that reads a setting another file declares (shakespeare
    reads language_model's --sequence_length, folder the engine's --image_size) names it in its own
    `READS = ("name", ...)`, so a run that selects it depends on that setting too. `packages` is
    ((selecting setting, directory, module names), ...); `engine_names` the engine's own settings; `reserved` the
    names no setting may have (Config's sections: config.loop).

    Returns (fields for the Config, {setting: {(selecting setting, module) of each READS}}, errors): a name two
    files declare, or that a READS names and nobody declares, is a fork's mistake, one line naming the files,
    which validate() refuses, so every command fails with it instead of importing a broken Config."""
    owners = dict.fromkeys(engine_names, "engine/settings/fields.py")
    owners.update(dict.fromkeys(reserved, "engine/settings/sections.py (a section of Config)"))
    fields, reads, errors = [], {}, []
    files = [
        (flag, module, os.path.join(directory, f"{module}.py"))
        for flag, directory, names in packages
        for module in names
    ]
    for flag, module, path in files:
        where = os.path.relpath(path, root)
        declared = models.read_constant(path, "SETTINGS", {})
        if not isinstance(declared, dict):
            errors.append(f"{where}: SETTINGS must be a dict of name: (default, help), not {type(declared).__name__}")
            continue
        for name, declaration in declared.items():
            if name in owners:
                errors.append(
                    f"{where}: declares the setting {name}, which {owners[name]} declares already: rename one of them"
                )
                continue
            if not (isinstance(declaration, tuple) and 2 <= len(declaration) <= 3 and type(declaration[0]) in _TYPES):
                errors.append(
                    f'{where}: SETTINGS[{name!r}] must be (default, "help"[, range or "required"]) with a '
                    "bool, int, float, str or tuple default"
                )
                continue
            owners[name] = where
            default, help_text, *bounds = declaration
            metadata = {"help": f"{module}: {help_text}", "bounds": bounds[0] if bounds else None}
            metadata.update(owner=(flag, module), readers=frozenset({(flag, module)}))
            fields.append((name, _TYPES[type(default)], dataclasses.field(default=default, metadata=metadata)))
    for flag, module, path in files:
        where = os.path.relpath(path, root)
        named = models.read_constant(path, "READS", ())
        if not (isinstance(named, (tuple, list)) and all(isinstance(name, str) for name in named)):
            errors.append(f"{where}: READS must be a tuple of setting names, not {named!r}")
            continue
        for name in named:
            if name not in owners:
                errors.append(f"{where}: READS {name}, which no file declares")
                continue
            reads.setdefault(name, set()).add((flag, module))
    return fields, reads, errors


# The actions a fork adds (--actions): files of engine/run/actions/, found by path (this wing imports nothing of the
# run's); the interface and the engine's own actions there declare nothing.
ACTIONS_DIR = os.path.join(ROOT, "engine", "run", "actions")
ENGINE_ACTIONS = ("base", "builtin")


def available_actions():
    """The action names --actions accepts: the files of engine/run/actions/ but the interface and the engine's own."""
    return sorted(
        name[:-3]
        for name in os.listdir(ACTIONS_DIR)
        if name.endswith(".py") and name[:-3].isidentifier() and name[0] != "_" and name[:-3] not in ENGINE_ACTIONS
    )


def packages():
    """((selecting setting, directory, module names), ...) of the packages whose files declare settings."""
    return [
        *(
            (flag, os.path.dirname(os.path.abspath(package.__file__)), package.available())
            for flag, package in (("model", models), ("task", tasks), ("dataset", sources))
        ),
        ("actions", ACTIONS_DIR, available_actions()),
    ]
