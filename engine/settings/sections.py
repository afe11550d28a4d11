"""The run's settings by what they are about: read-only views of a Config that hold one section each.

Each engine setting names its section where engine/settings/fields.py declares it (`momentum: float =
_optimization(...)`), and the other sections that read it too (`shared=`: the schedule reads --train_steps); a
model's, task's or source's own settings are their owner's (`config.own("model", "resnet")`), with the settings
its READS names. A function handed `config.optimization` reads the optimizer's settings and no others: reading
another section's is an AttributeError that names where the setting lives. config.json and the flags stay flat:
sections are views.

No TensorFlow here: launch.py reads engine/settings/fields.py, which reads this, before TensorFlow starts.
"""

import dataclasses

from engine.settings import plugins

# The sections of the engine's own settings, in the order a reader meets them.
SECTIONS = {
    "run": "what to run and where: the mode, the workdir, what is trained (task, model) and the seed",
    "loop": "the outer loop: how many steps, in rounds of how many, and what is due between them",
    "data": "what is read and how: the dataset, its splits, shuffling and batches",
    "models": "the models' weights: dropout, where they start, which stay fixed",
    "optimization": "the optimizer, its learning-rate schedule, clipping and the moving average of the weights",
    "numerics": "precision, the loss scale, XLA, determinism and eager execution",
    "cluster": "where the run executes: the strategy, devices, cluster resolvers, timeouts, tf.data service",
}
# Derived values a section answers too (a property of Config computed from that section's settings).
DERIVED = {"per_eval_batch_size": "data", "dataset_name": "data"}
# Names no model, task, source or action may declare as a setting, with what each is: Config's sections, what a view
# answers itself, and the values Config derives (a setting so named would hide the engine's).
RESERVED = {
    **dict.fromkeys(SECTIONS, "a section of Config"),
    **dict.fromkeys(("own", "READ_BY", "names", "values", "replace", "fields"), "a name a section answers itself"),
    **dict.fromkeys(DERIVED, "a value Config derives"),
    # What engine/state/workdir.py write_config saves in config.json beside the settings, which would replace a
    # setting so named there (and a resume read it back as that setting's value).
    **dict.fromkeys(("class_names", "updates", "training_split", "source"), "a key config.json holds"),
}


def home(field):
    """The section of a Config field: an engine setting's `section`, a declared one's owner ("model", "resnet")."""
    return field.metadata.get("owner") or field.metadata["section"]


def _where(section):
    if isinstance(section, tuple) and section[0] == "plugin":
        return f"the settings {section[1]} {section[2]} is handed"
    if isinstance(section, tuple):
        return f"config.own{section!r}"
    return f"config.{section}"


class Section:
    """The settings of one section of `config`, read as attributes; frozen. `names` are the settings it reads. Each
    section has a class of its own (section() makes it: Optimization, Loop, ...), its settings annotated with their
    types."""

    __slots__ = ("_config", "_name", "_names")

    def __init__(self, config, name, names):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_names", frozenset(names))

    def __getattr__(self, name):
        if name.startswith("_"):  # Python's and TensorFlow's own probes (copy, tracing), and unset slots
            raise AttributeError(name)
        if name in self._names:
            return getattr(self._config, name)
        field = {f.name: f for f in dataclasses.fields(self._config)}.get(name)
        if field is None and name not in DERIVED:
            raise AttributeError(f"no setting {name} (in {_where(self._name)} or any other section)")
        lives = DERIVED[name] if field is None else home(field)
        how = "name it in the file's READS" if isinstance(self._name, tuple) else f"add {self._name!r} to its shared="
        raise AttributeError(
            f"the setting {name} is in {_where(lives)}, not {_where(self._name)}: hand the function that reads "
            f"it that section too, or {how} where it is declared"
        )

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"{_where(self._name)} is read-only: cannot set {name}")

    def __eq__(self, other):
        return isinstance(other, Section) and self._name == other._name and self.values() == other.values()

    def __hash__(self):
        return hash((self._name, tuple(sorted(self.values().items()))))

    def __repr__(self):
        inner = ", ".join(f"{k}={v!r}" for k, v in sorted(self.values().items()))
        return f"{_where(self._name)}({inner})"

    @property
    def names(self):
        """The settings this section reads (its own and those shared with it), sorted."""
        return tuple(sorted(self._names))

    def values(self):
        """{setting: value} of every setting this section reads."""
        return {name: getattr(self._config, name) for name in self._names}

    def replace(self, **changes):
        """This section of the config with `changes` (a setting of any section, as dataclasses.replace takes)."""
        return type(self)(dataclasses.replace(self._config, **changes), self._name, self._names)


def whole(config):
    """The Config a section (or a Config) is a view of."""
    return config._config if isinstance(config, Section) else config


def every_setting(config):
    """The names of every setting of the Config under `config` (a Config or a view), whatever section."""
    whole = config._config if isinstance(config, Section) else config
    return [f.name for f in dataclasses.fields(whole)]


def _names(config_type, name):
    reads = getattr(config_type, "READ_BY", {})  # {setting: {owner whose READS names it}}
    names = set()
    for f in dataclasses.fields(config_type):
        if home(f) == name or name in f.metadata.get("shared", ()) or name in reads.get(f.name, ()):
            names.add(f.name)
    return names | {derived for derived, section in DERIVED.items() if section == name}


_CACHE = {}


def section(config, name):
    """The view of section `name` ("optimization", or an owner ("model", "resnet")) of `config`: a Config, or a
    view already (returned as it is when it reads at least that section's settings). A function that may be handed
    either (the optimizer's, which tests give a whole Config) calls this on it, so it reads the same whether given
    the whole Config or its section; one the run hands its section reads it as it is."""
    if not isinstance(name, tuple) and name not in SECTIONS:
        raise ValueError(f"no section {name!r}: the sections are {', '.join(SECTIONS)} and each owner's own")
    whole = config._config if isinstance(config, Section) else config
    key = (type(whole), name)
    if key not in _CACHE:
        _CACHE[key] = _typed(type(whole), name, _names(type(whole), name))
    cls = _CACHE[key]
    if isinstance(config, Section):  # a view that reads at least that section's settings serves as it is
        if not config._names >= cls.NAMES:
            raise AttributeError(f"handed {_where(config._name)} where {_where(name)} is read: hand it that section")
        return config
    return cls(whole, name, cls.NAMES)


def _typed(config_type, name, names, base=Section, title=None, doc=None):
    """The class of section `name`'s views: a Section named after it (Optimization, Loop; ResnetSettings for a
    file's own; `title` where given), its settings annotated with their types, so a reader and a type checker see
    what it holds."""
    fields = {f.name: f.type for f in dataclasses.fields(config_type)}
    if title is None and isinstance(name, tuple):
        title = f"{name[1].title().replace('_', '')}Settings"
        doc = f"the settings {name[0]} {name[1]} declares in its file, and those its READS names"
    elif title is None:
        title, doc = name.title(), SECTIONS[name]
    # A derived value (per_eval_batch_size) is annotated with what its property returns.
    annotations = {n: fields.get(n) or getattr(config_type, n).fget.__annotations__["return"] for n in sorted(names)}
    return type(title, (base,), {"__doc__": f"{title}: {doc}.", "__annotations__": annotations, "NAMES": names})


def undeclared(name):
    """What a read of a setting no file declares is told."""
    return (
        f"no setting {name}: the engine declares none, nor does any file of this checkout; a model, task, source or "
        "action declares its own in its file's SETTINGS (docs/forking.md)"
    )


class Sectioned:
    """The sections of a Config, as properties: config.optimization, config.loop, ..., and config.own(...)."""

    run = property(lambda self: section(self, "run"))
    loop = property(lambda self: section(self, "loop"))
    data = property(lambda self: section(self, "data"))
    models = property(lambda self: section(self, "models"))
    optimization = property(lambda self: section(self, "optimization"))
    numerics = property(lambda self: section(self, "numerics"))
    cluster = property(lambda self: section(self, "cluster"))

    def __getattr__(self, name):  # only for a name no field, section or method answers
        # Python's and TensorFlow's own probes (copy, pickle, tracing); a property of Config's that failed inside.
        if name.startswith("_") or hasattr(type(self), name):
            raise AttributeError(name)
        raise AttributeError(undeclared(name))

    def own(self, kind, module):
        """The settings models/<module>.py (kind "model"), tasks/<module>.py ("task"), the source <module>
        ("dataset") or the action <module> ("actions") declares, and those its READS names."""
        return section(self, (kind, module))

    def plugin(self, kind, module):
        """What plugin `module` of `kind` ("model", "task", "dataset", "actions") is handed of this run: every engine
        setting, its file's own and those its READS names (a Plugin view)."""
        return plugin(self, kind, module)


class Plugin(Section, Sectioned):
    """What one plugin reads of a run's settings (a task's `self.config`, a model's `create(config, ...)`, a
    source's `load(config, ...)`, an action's `Action(config)`): every engine setting, the settings its own file
    declares and those its READS names, with the sections, `own` and `plugin` a Config answers (Sectioned). A
    setting another file declares is an AttributeError naming both files: read unnamed, the run would neither depend
    on it nor accept it typed."""

    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        field = {f.name: f for f in dataclasses.fields(self._config)}.get(name)
        if field is None and name not in DERIVED:
            raise AttributeError(undeclared(name))
        if field is None or name in self._names:
            return Section.__getattr__(self, name)
        kind, module = self._name[1:]
        reader, owner = plugins.file(kind, module), plugins.file(*home(field))
        raise AttributeError(
            f"{reader} reads the setting {name}, which {owner} declares: name it in {reader}'s READS (READS = "
            f"({name!r},)), so a run of {reader} depends on it and takes --{name}"
        )


def plugin(config, kind, module):
    """What plugin `module` of `kind` ("model", "task", "dataset", "actions") is handed of `config` (a Config, or
    what another plugin was handed): a Plugin view."""
    whole = config._config if isinstance(config, Section) else config
    key = (type(whole), ("plugin", kind, module))
    if key not in _CACHE:
        engine = {f.name for f in dataclasses.fields(whole) if "section" in f.metadata}
        names = engine | _names(type(whole), (kind, module)) | set(DERIVED)
        title = f"{module.title().replace('_', '')}{kind.title()}Config"
        doc = f"what {kind} {module} reads: every engine setting, its file's own and those its READS names"
        _CACHE[key] = _typed(type(whole), key[1], names, Plugin, title, doc)
    cls = _CACHE[key]
    return cls(whole, key[1], cls.NAMES)
