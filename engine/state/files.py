"""How a run writes its files in its workdir.

Never through a symbolic link planted there (a link would let whoever can write the workdir make the run overwrite
a file elsewhere): a file is written to a fresh temporary name no one can guess, created exclusively and without
following links, then renamed over its target (a link at the target is replaced, not followed); a log appended to is
opened without following links, and a link there is refused. Object stores have no links: there TensorFlow's file
system writes as it is. A write that fails (a full disk) raises CheckpointError naming its path (`writing`,
`write_text`, `write_json`, `append_text`; launch.py: exit 4).
"""

import contextlib
import errno
import json
import math
import os
import re
import shutil
import uuid

import tensorflow as tf

from engine.settings.config import first_line
from engine.settings.errors import CheckpointError


def is_local(path):
    return "://" not in path


def remove_tree(path):
    """Removes a directory or file of this run's, and nothing where there is none; a link there is removed itself,
    never what it points to (TensorFlow's rmtree follows it and empties its target)."""
    if not is_local(path):
        if tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
        return
    path = os.path.normpath(path)  # as TensorFlow reads it: a/../b is b even where a does not exist
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)  # never follows the links inside


def local_path(path):
    """A local path as TensorFlow's file system reads it (a/../b is b even where a does not exist, which the
    kernel's own lookup refuses), so that os calls and tf.io.gfile calls name the same file."""
    return os.path.normpath(path) if is_local(path) else path


def open_new(path):
    """A file descriptor of `path`, created here and now: never an existing file, never through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def _link_refused(path):
    """OSError for a symbolic link found where the run writes (its message names the link's target)."""
    return OSError(
        errno.ELOOP,
        f"it is a symbolic link (to {os.readlink(path)}); a run writes only inside its workdir: remove the link",
        path,
    )


def replace_text(path, text):
    """Writes `text` (str, or bytes: a figure, an .npz) to `path` atomically (a reader or a kill never sees half a
    file), never through a link (see the module's docstring). Raises OSError or tf.errors.OpError for the caller
    to name."""
    binary = isinstance(text, bytes)
    if not is_local(path):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with tf.io.gfile.GFile(tmp, "wb" if binary else "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, path, overwrite=True)
        return
    path = local_path(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = open_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text if binary else text.encode("utf-8"))
        os.replace(tmp, path)  # renames over a link at `path` itself: its target is untouched
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def writing(path):
    """Turns a failed write into CheckpointError naming `path` (launch.py: exit 4)."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from None
    except tf.errors.OpError as e:
        file, reason = failed_file(e)
        raise CheckpointError(f"cannot write {file or path}: {reason}") from None


def check_listable(directory, what):
    """CheckpointError where a local `directory` is there but cannot be listed (a permission, a file in its place),
    which TensorFlow's glob takes for an empty one: a run would find no checkpoint and start again from step 0. A
    permission may be mended and the command rerun; a file in its place is moved away by its owner."""
    if not is_local(directory) or not os.path.lexists(directory):
        return
    try:
        os.listdir(directory)
    except FileNotFoundError:
        pass  # a link to nowhere (Checkpoints refuses a link)
    except NotADirectoryError:  # a rerun alone never mends it: the file is someone's, which a run never removes
        raise CheckpointError(
            f"cannot read {what} {directory}: it is a file, not a directory; nothing was changed: move that file "
            "away, then run the same command again"
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"cannot read {what} {directory}: {e.strerror}; nothing was changed: run the same command again once it "
            "can be read"
        ) from None


def failed_file(error):
    """(the file, or None where it names none; the reason) of a failed file operation, for a person: an OSError's,
    or a TensorFlow error's first line without what it adds for its own ("{{function_node __wrapped__SaveV2...}}
    file; why [Op:SaveV2]", and the op's empty name an eager op gives: "[Op:CreateSummaryFileWriter] name: ")."""
    if isinstance(error, OSError):
        return error.filename, error.strerror or str(error)
    said = re.sub(r"\s*\[Op:\w+\](\s*name:.*)?$", "", re.sub(r"^\{\{.*?\}\}\s*", "", first_line(error)))
    named = re.fullmatch(r"(\S+); (.+)", said)
    return (named[1], named[2]) if named else (None, said)


def write_text(path, text):
    """replace_text, a failed write raised as CheckpointError naming `path`: a reader or a kill never sees half a
    file, and a link planted at either name is never written through."""
    with writing(path):
        replace_text(path, text)


def write_json(path, obj):
    """Writes `obj` as JSON atomically (write_text): a reader never sees half a file, a crash never leaves one."""
    write_text(path, json_text(obj, indent=2, sort_keys=True) + "\n")


def json_text(obj, **options):
    """`obj` as JSON text, a number that is not finite (a diverged evaluation's loss, a task's 0/0) as null: JSON has
    no NaN or Infinity, which Python writes bare and a strict reader (JavaScript's, Go's) refuses."""
    return json.dumps(_finite(obj), allow_nan=False, **options)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def append_text(path, text):
    """Appends `text` to the log `path`, created if missing, on a line of its own: after a torn last line (a killed
    process's, a full disk's) it starts a new one, so that the record it appends reads back whole. A link there is
    refused (CheckpointError, like any failed write of the run's files), never appended through."""
    path = local_path(path)  # a remote path as it is
    with writing(path):
        if not is_local(path):
            size = tf.io.gfile.stat(path).length if tf.io.gfile.exists(path) else 0
            if size:
                with tf.io.gfile.GFile(path, "rb") as f:
                    f.seek(size - 1)
                    text = text if f.read(1) == b"\n" else "\n" + text
            with tf.io.gfile.GFile(path, "a") as f:
                f.write(text)
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP and os.path.islink(path):
                raise _link_refused(path) from None
            raise
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(text)


def make_workdir(path):
    """Creates the workdir and checks that a file can be written there (CheckpointError naming it: exit 4)."""
    try:
        tf.io.gfile.makedirs(path)
        if is_local(path):
            probe = os.path.join(local_path(path), f".write_probe-{uuid.uuid4().hex}")
            fd = open_new(probe)
            try:
                os.write(fd, b"probe")
            finally:
                os.close(fd)
                os.remove(probe)
            return
        probe = os.path.join(path, f".write_probe-{uuid.uuid4().hex}")
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("probe")  # GFile opens the file at its first write
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as e:
        why = e.strerror if isinstance(e, OSError) else first_line(e)
        raise CheckpointError(f"--workdir={path}: cannot write there ({why})") from None


def missing_directories(path):
    """The directories from `path` up that do not exist yet, deepest first (what creating `path` makes)."""
    missing = []
    path = local_path(os.path.abspath(path)) if is_local(path) else path
    while is_local(path) and not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing
