"""Runs the engine: absl flags -> Config -> engine.

    python launch.py                                   # MLP on the bundled digits, one device
    python launch.py --strategy=mirrored --num_cpu_devices=2 --model=resnet
    python launch.py --flagfile=experiments/digits_resnet.flags

Every flag is a field of engine/settings/fields.py's Config, with the same name, default and help; only here is absl.

The exit codes are docs/exit-codes.md's table, the one list of them: the constants below, the cluster's
(engine/cluster/resolvers.py) and the signals' (engine/cluster/signals.py); tests/test_launch.py checks that the table
lists exactly these. A signal during training stops every worker after the same step, which the chief
saves (run the same command to resume); anywhere else (start-up, evaluation) there is nothing to save and the
process exits at once. While a multi-worker job waits for its peers, TensorFlow holds Python's lock: Ctrl-C ends
it at once (130), SIGTERM once the wait ends (75), or at --connect_timeout.
"""

from engine.cluster.signals import SIGNALS  # imports little, and no TensorFlow

if __name__ == "__main__":  # first: a Ctrl-C while the rest imports is one line, not a traceback
    SIGNALS.exit_until_installed()

import contextlib
import dataclasses
import functools
import importlib
import io
import os
import re
import sys
import traceback

# TensorFlow's C++ start-up chatter (CUDA probing on a CPU machine) would bury our output; errors
# still reach us as Python exceptions. Set TF_CPP_MIN_LOG_LEVEL=0 to see it all.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags, logging

from engine.run import compile_cache  # imports no TensorFlow
from engine.settings import flagfiles, plugins
from engine.settings.checks import TASKS_OWN
from engine.settings.config import Given, validate
from engine.settings.environment import tf_config
from engine.settings.errors import ConfigError, counted
from engine.settings.fields import DECLARATION_ERRORS, Config, Switch, show
from engine.settings.help import usage
from engine.settings.plugins import RESEARCH_MODES
from engine.settings.unread import unread, unread_by_the_mode

BAD_INPUT = 2  # a flag, TF_CONFIG, data, a checkpoint that does not fit, a workdir that holds another run
NON_FINITE = 3  # training stopped (TrainingError): a non-finite loss, or float16 stuck at its scale floor
CANNOT_WRITE = 4  # the workdir cannot be written (at the start too), or its storage failed a read
LOST_PEER = 5  # a multi-worker peer stopped answering


class _SwitchParser(flags.ArgumentParser):
    """auto, true or false, spelled as absl spells a bool's true and false (true, t, 1; false, f, 0)."""

    def parse(self, argument):
        text = str(argument).lower()
        for value, spellings in (("auto", ("auto",)), ("true", ("true", "t", "1")), ("false", ("false", "f", "0"))):
            if text in spellings:
                return value
        raise ValueError("must be auto, true or false")

    def flag_type(self):
        return "auto|true|false"


class _SwitchFlag(flags.Flag):
    """A Switch setting: --name=auto|true|false; as for a bool, --name alone is true and --noname false."""

    def __init__(self, name, default, help_text):
        super().__init__(_SwitchParser(), flags.ArgumentSerializer(), name, default, help_text, boolean=True)

    def _serialize(self, value):
        return f"--{self.name}={value}"


_DEFINE = {
    str: flags.DEFINE_string,
    int: flags.DEFINE_integer,
    float: flags.DEFINE_float,
    bool: flags.DEFINE_boolean,
    tuple: flags.DEFINE_list,
    Switch: lambda name, default, help_text: flags.DEFINE_flag(_SwitchFlag(name, default, help_text)),
}

# absl's own: --flagfile, --log_dir, ..., and the help flags app.run defines only as it starts (--help, --helpshort,
# --helpxml, --only_check_flags), defined here first so a plugin's setting of one of their names is a clash said in one
# line, not absl's DuplicateFlagError traceback as the run starts.
app.define_help_flags()
_ABSL_FLAGS = set(flags.FLAGS)
for _field in dataclasses.fields(Config):
    if _field.name in _ABSL_FLAGS:  # a plugin's setting named as one: every command stops on it, as on any clash
        _file = plugins.file(*_field.metadata["owner"])
        DECLARATION_ERRORS.append(
            f"{_file}: declares the setting {_field.name}, which absl's own flags define: rename it"
        )
        continue
    _default = _field.default
    if _field.type is tuple:
        _default = [str(v) for v in _default]
    _DEFINE[_field.type](_field.name, _default, _field.metadata["help"])

FLAGS = flags.FLAGS


def _refuse_unread(config, unread_of):
    """Settings given that no part of this run reads (`unread_of`: engine/settings/unread.py's): refused when typed
    on the command line (a typo's twin, another task's or mode's setting, would change nothing), a warning when they
    come from a flagfile (a recipe reused with another task or model)."""
    typed, given = _typed(), {f.name for f in dataclasses.fields(Config) if FLAGS[f.name].present}
    for name, readers in unread_of(config, sorted(given & typed)):
        raise ConfigError(f"--{name}={show(getattr(config, name))}: no part of this run reads it ({readers})")
    for name, readers in unread_of(config, sorted(given - typed)):
        print(
            f"warning: --{name}={show(getattr(config, name))} (from a flagfile): no part of this run reads it "
            f"({readers})",
            file=sys.stderr,
            flush=True,
        )


def _typed():
    """The names of the flags typed on the command line (not read from a flagfile)."""
    typed = set()
    for arg in sys.argv[1:]:
        name = arg.lstrip("-").split("=", 1)[0]
        typed.update({name, name[2:]} if name.startswith("no") else {name})
    return typed


def _config_from_flags():
    values = {}
    for field in dataclasses.fields(Config):
        if field.name not in FLAGS:  # not defined, for a declaration error that validate() raises
            continue
        value = FLAGS[field.name].value
        if field.type is tuple:
            try:
                value = tuple(int(v) for v in value)
            except ValueError:
                raise ConfigError(f"--{field.name}={','.join(value)}: must be comma-separated integers") from None
        values[field.name] = value
    return validate(Config(**values))


def main(argv):
    logging.set_verbosity(logging.WARNING)  # tensorflow-datasets logs every file it opens at INFO
    _print_bytes_as_they_are()
    if len(argv) > 1:
        _exit(flagfiles.unexpected(argv[1:], sys.argv[1:]))
    config = _checked_config()
    from engine.cluster import launcher

    if config.local_workers:
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--local_workers=0"]
        network = config.local_cluster_network
        sys.exit(launcher.run(config.strategy, config.local_workers, config.num_ps, command, network=network))
    try:
        tf_config()  # a bad TF_CONFIG fails before TensorFlow starts; an empty one is dropped
        if config.compile_cache:  # TensorFlow reads where at its first op
            compile_cache.use(config.compile_cache)
    except ConfigError as e:
        _exit(str(e))
    SIGNALS.install()  # before TensorFlow starts any thread: they all inherit the blocked signals
    launcher.end_with_the_launcher()  # a task the launcher started: stopped as it ends, however it ends
    with _quiet_native_stderr():
        # Deferred: TensorFlow starts here, after the flags are known good.
        from engine.cluster import distribute
        from engine.cluster.resolvers import PeerLost
        from engine.settings.errors import CheckpointError, Preempted, TrainingError

        run = _mode(config)
    if isinstance(run, str):
        _exit(run)
    try:
        if distribute.serve(config.cluster):  # a parameter-server job's worker or ps task: serves until stopped
            return
        result = run(config)
    except ConfigError as e:
        _exit(str(e))
    except TrainingError as e:
        _exit(f"training stopped: {e}", code=NON_FINITE)
    except CheckpointError as e:
        _exit(str(e), code=CANNOT_WRITE)
    except PeerLost as e:
        _exit(str(e), code=LOST_PEER)
    except Preempted as e:  # the message says preempted or interrupted, and by what
        _exit(str(e), code=e.exit_code)
    except Exception as e:  # a peer lost outside the steps (a chief reading its servers' variables) is one too
        lost = distribute.lost_peer(config.cluster, e)
        if lost is not None:
            _exit(str(lost), code=LOST_PEER)
        failed = plugins.failure(e)  # a fork's own code that raised: its line; the engine's own keeps its traceback
        if failed is None:
            raise
        _exit(failed)
    _print_result(config, result)


def _checked_config():
    """The run's Config from the flags, checked as far as it can be before anything starts; bad input exits."""
    try:
        flagfiles.check_actions_typed_once(sys.argv[1:])
        config = _config_from_flags()
        if config.mode == "train":
            _refuse_unread(config, unread)
        elif config.mode not in RESEARCH_MODES:  # from the run's config.json: only what the command line selects
            _refuse_unread(config, unread_by_the_mode)
        if config.mode in RESEARCH_MODES:  # research's own checks, before anything starts
            from research import checks, space

            checks.check(config)
            checks.check_given(config, _given(config))
            if config.mode == "tune":  # each searched value is tried in this config, which must be good already
                checks.check_searched(config, space.parse_space(config.tune_space, config), _typed())
    except ConfigError as e:
        _exit(str(e))
    return config


def _mode(config):
    """The function that runs the run's --mode, imported as it is asked for: a training run needs none of research/'s
    tools (Optuna, SciPy, Matplotlib), and runs where they are not installed. Where those a research run will use
    are missing, the line that says so instead."""
    mode = config.mode
    if mode in RESEARCH_MODES:
        from research import tools

        try:
            for tool in tools(config):
                importlib.import_module(tool)
            research = importlib.import_module(f"research.{mode}")
        except ImportError as e:  # Optuna, SciPy, Matplotlib: research's own requirements
            return f"--mode={mode} needs research's tools: pip install -r requirements-research.txt ({e})"
        return getattr(research, mode)
    if mode == "train":
        from engine.run import loop

        return loop.train
    from engine.run import modes

    run = {"eval": modes.evaluate, "continuous_eval": modes.follow, "export": modes.export, "sample": modes.sample}
    return functools.partial(run[mode], given=_given(config))


def _given(config):
    """The settings the command line gave, which a trained run's settings yield to only where they may
    (for_evaluation, research/checks.py check_given): a model flag typed at its default value contradicts the run as
    much as any other; a flagfile's (a recipe reused to evaluate its run) counts where it is not the default. An
    empty --dataset or --model (the task's own) gives none: the trained run's task's is its own."""
    typed = _typed()
    given = {
        f.name
        for f in dataclasses.fields(Config)
        if (f.name in typed or (FLAGS[f.name].present and getattr(config, f.name) != f.default))
        and not (f.name in TASKS_OWN and FLAGS[f.name].value == "")  # empty: the trained run's task's own
    }
    return Given(given, typed)


def _print_result(config, result):
    """The run's last line: what it reached, and where it says so."""
    if config.mode == "train":
        results = result["eval"]
        headline = importlib.import_module(f"tasks.{config.task}").Task.headline
        value = results[headline]  # null in a summary.json read back where it was NaN (no number: "-")
        print(
            f"{config.eval_split} {headline} {'-' if value is None else format(value, '.4f')} "
            f"on {results['examples']} examples "
            f"({counted(result['step'], 'step')}, {result['wall_seconds']:.1f} s"
            + (f" since it resumed at step {result['resumed_at']})" if result.get("resumed_at") is not None else ")")
        )
    elif config.mode == "tune":
        best = result["best"]
        trials = counted(result["trials"], "trial")
        counts = f"({trials}: {result['complete']} complete, {result['pruned']} pruned; "
        counts += f"{result['wall_seconds']:.1f} s)"
        if best:
            print(
                f"best trial {best['trial']}: {result['split']} {result['objective']} {best['value']:.4f} {counts}; "
                f"rerun: python launch.py --flagfile={best['flagfile']}"
            )
        else:
            print(f"no trial completed {counts}")
    elif config.mode == "ensemble":
        metric = result["objective"]  # the task's, e.g. accuracy
        test = {name: result[name]["test"][metric] for name in ("weighted", "average")}
        # The member best on validation, as the weighted ensemble is chosen: test is only scored, never picked by.
        pick = max if result["direction"] == "max" else min
        best = pick(result["members"], key=lambda member: member["validation"][metric])
        print(
            f"{config.eval_split} {metric} {test['weighted']:.4f} weighted, {test['average']:.4f} average, "
            f"{best['test'][metric]:.4f} the member best on validation ({len(result['members'])} members, "
            f"{result['test_examples']} examples)"
        )


def _absl_flags_help():
    """absl's own flags (--flagfile, --logtostderr, ...), by the absl module that defines them, as absl writes them."""
    text = FLAGS.get_help()  # launch.py's flags first, then absl's modules', each headed "absl.<module>:"
    at = text.find("\nabsl.")
    return text[at:].strip("\n") if at >= 0 else ""


def _print_help(full=False):
    """The engine's help, and with --helpfull absl's own flags after it (absl's --helpfull would list every flag
    alphabetically in one group, the plugins of this checkout left out), to a reader who may stop reading:
    `--help | head` ends quietly, not in a BrokenPipeError traceback."""
    try:
        print(usage() + (f"\nabsl's own flags:\n\n{_absl_flags_help()}" if full else ""), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exiting flushes what is left: to nowhere


def _parse_flags(argv):
    full = any(arg in ("-helpfull", "--helpfull") for arg in argv[1:])
    if full or any(arg in ("-h", "-help", "--help", "-helpshort", "--helpshort", "-?") for arg in argv[1:]):
        _print_help(full)
        if DECLARATION_ERRORS:  # what stops every other command: two files declare one setting
            _exit(DECLARATION_ERRORS[0])
        sys.exit(0)
    args = argv[1:]
    # absl reads nothing of an empty one and says nothing: --flagfile=, --flagfile= " ", --flagfile "".
    given = flagfiles.named(args)
    if any(not value.strip() for value in given):
        _exit("--flagfile=: names no file (an empty variable in a script?); give the flag file's path")
    try:
        return FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        given = e.flagvalue if str(e.flagvalue).startswith("-") else f"--{e.flagname}"
        suggestions = str(e).partition("Did you mean: ")[2].rstrip(" ?")
        _exit(f"{given}: no such flag" + (f" (did you mean --{suggestions}?)" if suggestions else ""))
    except flags.CantOpenFlagFileError as e:
        cause = e.__context__  # the OSError, which absl's message only quotes
        if isinstance(cause, OSError):
            _exit(f"--flagfile={cause.filename}: cannot read it ({cause.strerror})")
        _exit(str(e))
    except flags.Error as e:  # absl's own text: "flag --name=value: why", Python's words for a number it is not
        said = re.sub(r"invalid literal for int\(\) with base 10: .*", "must be an integer", str(e))
        _exit(re.sub(r"could not convert string to float: .*", "must be a number", said).removeprefix("flag "))
    except UnicodeDecodeError as e:
        # absl reads a flagfile as UTF-8 text without saying which one was not; its reader's frame knows.
        frames = traceback.walk_tb(e.__traceback__)
        read = [f.f_locals["filename"] for f, _ in frames if f.f_code.co_name == "_get_flag_file_lines"]
        given = [a.split("=", 1)[1] for a in argv if a.startswith(("--flagfile=", "-flagfile="))]
        _exit(f"--flagfile={(read or given or ['?'])[-1]}: not a text file of flags (byte {e.start} is not UTF-8)")
    except ValueError as e:  # absl's for a negated boolean given a value: "--nodeterministic=true does not take ..."
        given, _, why = str(e).partition(" ")
        name = given.split("=", 1)[0].removeprefix("--").removeprefix("-").removeprefix("no")
        if not given.startswith("-") or "does not take an argument" not in why:
            raise
        _exit(f"{given}: --no{name} takes no value (write --{name}=true or --{name}=false)")
    except SystemExit:  # absl's --help, --helpfull and --helpxml print what was asked for and exit 1: no error
        sys.exit(0)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silences what TensorFlow's native libraries print while they load (CUDA probing on a machine
    without GPUs), before any log level applies. Python errors still surface after the block."""
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _print_bytes_as_they_are():
    """stdout and stderr write a path that is not UTF-8 (held as surrogate escapes) as its own bytes, not a
    UnicodeEncodeError: the run's lines name its files as the file system does."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream.flush()
        try:
            stream.reconfigure(errors="surrogateescape")
        except (OSError, AttributeError, ValueError):  # a stream whose buffer cannot tell where it stands: anew
            raw = open(stream.fileno(), "wb", closefd=False)  # noqa: SIM115  (the process's own descriptor)
            setattr(sys, name, io.TextIOWrapper(raw, stream.encoding, "surrogateescape", line_buffering=True))


def _exit(message, code=BAD_INPUT):
    print(f"error: {message}", file=sys.stderr, flush=True)
    # The error is the last line: what TensorFlow warns of as the process ends (a refused checkpoint's values left
    # unrestored, collected at exit) is not a user's to read.
    if "tensorflow" in sys.modules:
        sys.modules["tensorflow"].get_logger().setLevel("ERROR")
    sys.exit(code)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
