"""The flagfiles a command line names (absl's --flagfile), and the mistakes in them that absl reads as arguments:
launch.py says which file holds them. No TensorFlow here: launch.py reads this before TensorFlow starts."""

from engine.settings.errors import ConfigError


def named(args):
    """The --flagfile values among `args` (--flagfile=PATH, or --flagfile PATH)."""
    given = [a.partition("=")[2] for a in args if a.startswith(("--flagfile=", "-flagfile="))]
    return given + [after for flag, after in zip(args, args[1:]) if flag in ("--flagfile", "-flagfile")]


def unexpected(arguments, argv):
    """What is wrong where absl left `arguments` over from the command line `argv`: a flagfile's line it read as an
    argument, named with its file, or arguments typed on the command line."""
    bom = _holding(named(argv), lambda lines: lines[0].startswith("\ufeff"))
    if bom and any(a.startswith("\ufeff") for a in arguments):  # absl reads it as part of the first line
        return (
            f"--flagfile={bom}: starts with a byte order mark (U+FEFF, as some Windows editors save UTF-8), which "
            "hides its first line; save it as UTF-8 without one"
        )
    for argument in (a for a in arguments if a.startswith(("#", "//"))):  # absl: a comment starts its line
        indented = lambda lines: any(line.strip() == argument != line.rstrip() for line in lines)  # noqa: E731
        path = _holding(named(argv), indented)
        if path:
            return (
                f"--flagfile={path}: the comment {argument!r} is indented, so it is read as an argument: begin its "
                f"line with {argument[0]}"
            )
    return f"unexpected arguments {' '.join(arguments)!r} (flags look like --name=value)"


def _holding(paths, holds, seen=None):
    """The first of the flagfiles `paths`, or of those they name in turn, whose lines `holds(lines)` is true of;
    None if none."""
    seen = set() if seen is None else seen
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines() or [""]
        except OSError:
            continue
        if holds(lines):
            return path
        found = _holding(named([line.strip() for line in lines]), holds, seen)
        if found:
            return found
    return None


def check_actions_typed_once(argv):
    """ConfigError where the command line `argv` types --actions more than once: absl keeps the last value, and the
    actions the others named would not run, unsaid (a flagfile's --actions, which the command line overrides, is not
    typed)."""
    given = [a.partition("=")[2] for a in argv if a.startswith(("--actions=", "-actions="))]
    given += [after for flag, after in zip(argv, argv[1:]) if flag in ("--actions", "-actions")]
    if len(given) > 1:
        names = dict.fromkeys(name for value in given for name in value.split(",") if name)
        raise ConfigError(
            f"--actions is given {len(given)} times ({' and '.join(map(repr, given))}): only the last would run; "
            f"name them all in one: --actions={','.join(names)}"
        )
