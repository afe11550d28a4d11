"""Your own photos (--dataset=folder:PATH): a sub-folder of JPEG or PNG files per class.

Your own photos, no builder: `--dataset=folder:PATH`, a folder with a sub-folder per class of JPEG or PNG files
(by extension, in any case: .jpg, .jpeg, .png; other files, hidden ones and deeper folders are not read, and a
warning names the photos of other formats, .gif, .bmp, .webp, ..., the deeper folders and the photos beside the
class folders):

    PATH/cat/0001.jpg  PATH/cat/0002.PNG  PATH/dog/0001.jpeg  ...

The classes are the sorted class-folder names: label i is the i-th (the source's info gives `num_classes` and
`class_names`). Photos come in many sizes, so --image_size is required: training reads random-resized crops of that
side, flipped at random; evaluation the centre crop (engine/data/images.py). PATH may be on any file system TensorFlow
reads (gs://...).

Splits. A PATH holding a folder named --train_split (`train`) of folders holds one folder per split, each with the
same class folders (PATH/train/cat/..., PATH/validation/cat/..., PATH/test/cat/...); --eval_split names one of them
(a folder `train` of photos is a class: bus/, car/, train/). Any other
PATH is carved: --folder_eval_percent (10) of its photos are held out, chosen by a hash of each file's path under
PATH (`cat/0001.jpg`), so the same files give the same split on every machine and adding or removing photos never
moves the others between training and evaluation (a larger percent only adds photos to the held-out part). The
held-out photos answer to --eval_split=test (the default) and to --eval_split=validation alike: there is one
held-out part, so a tuner's validation and the final test read the same photos (give split folders for a test the
tuning never saw). --eval_split=train evaluates on the training photos.

Only the paths and labels are held in memory: each input pipeline reads the files of its own positions (random
access: a resume starts at its data position at once). A file that does not decode stops the run naming it (the
engine's policy: nothing is skipped silently).
"""

import hashlib
import os

import tensorflow as tf

from engine.api import ConfigError, Source, image_decoder, in_memory

SETTINGS = {
    "folder_eval_percent": (
        10,
        "photos held out for evaluation when PATH has no split folders, in percent (chosen by a hash of each path)",
        (1, 50),
    ),
}
READS = ("image_size",)  # the engine's setting: the side of the crops the photos decode to
# What follows the source's name in --dataset, and what it names: --help says so.
ARGUMENT = ("PATH", "a sub-folder of JPEG/PNG files per class")
EXTENSIONS = (".jpg", ".jpeg", ".png")
# Images of other formats by their extension: not read, and said so (_say_unread).
OTHER_IMAGES = (".gif", ".bmp", ".webp", ".tif", ".tiff", ".jfif", ".jpe", ".heic", ".heif", ".avif")
PHOTOS = (*EXTENSIONS, *OTHER_IMAGES)  # a photo beside the class folders is of no class: not read, and said so
HELD_OUT = ("test", "validation")  # the names of a carved PATH's held-out part


def load(config, eval_split):
    path = config.dataset.partition(":")[2]
    where = f"--dataset={config.dataset}"
    if not path:
        raise ConfigError(f"{where}: name the folder, --dataset=folder:PATH")
    if not config.image_size:
        raise ConfigError(f"{where}: photos come in many sizes: set --image_size (e.g. 224), the side of the crops")
    if not tf.io.gfile.isdir(path):
        raise ConfigError(f"{where}: no such folder")
    if _split_folder(path, config.train_split):
        names, train, evals = _split_folders(path, where, config.train_split, eval_split)
    else:
        names, train, evals = _carved(path, where, config, eval_split)
    size = config.image_size
    spec = {"image": tf.TensorSpec([size, size, 3], tf.uint8), "label": tf.TensorSpec([], tf.int64)}
    info = {"num_classes": len(names), "class_names": tuple(names)}

    decode_image = image_decoder(config.data)

    def decode(example, seed, training):
        features = {k: v for k, v in example.items() if k != "path"}
        return decode_image({**features, "image": tf.io.read_file(example["path"])}, seed, training)

    return Source(train, evals, spec, info, decode=decode)


def _split_folder(path, train_split):
    """Whether PATH holds a folder per split: its folder named --train_split holds folders (the classes). One of
    photos alone is a class of that name (vehicles: bus, car, train)."""
    inside = os.path.join(path, train_split)
    return tf.io.gfile.isdir(inside) and bool(_folders(inside))


def _split_folders(path, where, train_split, eval_split):
    """(class names, train Split, eval Split) of a PATH with a folder per split."""
    splits = _folders(path)
    if eval_split not in splits:
        raise ConfigError(f"--eval_split={eval_split}: not a split of {path} (splits: {', '.join(splits)})")
    _say_unread(where, [], [], _loose(path, where))
    found = {s: _photos(os.path.join(path, s), f"{where}: split {s!r}") for s in (train_split, eval_split)}
    names = sorted(found[train_split])
    other = sorted(found[eval_split])
    if names != other:
        lacks = ", ".join(sorted(set(names) - set(other))) or "none"
        extra = ", ".join(sorted(set(other) - set(names))) or "none"
        raise ConfigError(
            f"{where}: splits {train_split!r} and {eval_split!r} must have the same class folders "
            f"({eval_split!r} lacks: {lacks}; has beyond {train_split!r}: {extra})"
        )

    def split(name):
        folder = os.path.join(path, name)
        return _split([(os.path.join(folder, c, f), label) for label, c in enumerate(names) for f in found[name][c]])

    return names, split(train_split), split(eval_split)


def _carved(path, where, config, eval_split):
    """(class names, train Split, eval Split) of a PATH of class folders, --folder_eval_percent held out."""
    if config.train_split != "train":
        raise ConfigError(
            f"--train_split={config.train_split}: {path} has no folder {config.train_split!r}; without split "
            "folders its photos are carved into train and a held-out part (test or validation)"
        )
    if eval_split not in (config.train_split, *HELD_OUT):
        raise ConfigError(
            f"--eval_split={eval_split}: not a split of {path} (it has no split folders: train, and the held-out "
            f"{config.folder_eval_percent}% as test or validation)"
        )
    photos = _photos(path, where)
    names = sorted(photos)
    parts = {True: [], False: []}
    for label, name in enumerate(names):
        for file in photos[name]:
            parts[_held_out(f"{name}/{file}", config.folder_eval_percent)].append(
                (os.path.join(path, name, file), label)
            )
    for held, part in parts.items():
        if not part and (not held or eval_split != config.train_split):  # a part the run reads
            total = len(parts[not held])
            raise ConfigError(
                f"{where}: {'none' if held else 'all'} of its {total} photos fall in the held-out "
                f"{config.folder_eval_percent}% (--folder_eval_percent): add photos, or split folders"
            )
    return names, _split(parts[False]), _split(parts[eval_split != config.train_split])


def _held_out(relative_path, percent):
    # A hash of the path alone: a file's split depends on nothing else in the folder, nor on the machine.
    digest = hashlib.sha256(os.fsencode(relative_path)).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def _entries(path):
    """The names in the folder `path`. On a local file system a name that is not UTF-8 comes as Python lists it,
    its bytes as surrogate escapes (os.fsdecode), where TensorFlow's own listing would stop on it: a photo so named is
    read by its bytes (_split)."""
    return tf.io.gfile.listdir(path) if "://" in path else os.listdir(path)


def _files(path, where):
    """(files, folders): the names in the folder `path` (_entries), its files and its sub-folders apart: an object
    store lists a folder with a trailing /, a local disk says which are (without a call per name). A visible link to
    nothing is refused by name: a photo so linked stopped the run at its first read, epochs in, and a class folder so
    linked was left out without a word."""
    if "://" in path:
        names = tf.io.gfile.listdir(path)
        return [n for n in names if not n.endswith("/")], [n.rstrip("/") for n in names if n.endswith("/")]
    with os.scandir(path) as entries:
        entries = list(entries)
    for e in entries:  # is_symlink() is known from the listing: only a link costs a call
        if not e.name.startswith(".") and e.is_symlink() and not os.path.exists(e.path):
            raise ConfigError(
                f"{where}: {e.path} is a link to {os.readlink(e.path)}, which does not exist: fix or remove the link"
            )
    return [e.name for e in entries if not e.is_dir()], [e.name for e in entries if e.is_dir()]


def _is_utf8(name):
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: a byte that is not UTF-8
        return False
    return True


def _folders(path):
    """The sorted names of the visible sub-folders of `path` (object stores list them with a trailing /). A class is
    named by its folder, in the export too: a folder whose name is not UTF-8 is refused by name."""
    found = []
    for name in _entries(path):
        name = name.rstrip("/")
        if not _is_utf8(name):  # local: TensorFlow cannot name it
            if os.path.isdir(os.path.join(path, name)):
                raise ConfigError(
                    f"--dataset=folder:{path}: the folder {name!r} in it is not named in UTF-8 "
                    f"({os.fsencode(name)!r}): a class is named by its folder; rename it"
                )
        elif not name.startswith(".") and tf.io.gfile.isdir(os.path.join(path, name)):
            found.append(name)
    return sorted(found)


def _photos(path, where):
    """{class name: sorted photo file names} of the class folders in `path`; every class has one at least."""
    names = _folders(path)
    if not names:
        raise ConfigError(f"{where}: {path} has no class folders (a sub-folder per class of JPEG or PNG files)")
    if len(names) < 2:  # one class leaves nothing to learn
        raise ConfigError(
            f"{where}: one class folder ({names[0]}): a folder of classes holds a folder of photos for each class, "
            "two at least"
        )
    photos, unread, folders = {}, [], []
    loose = _loose(path, where)
    for name in names:
        files, inside = _files(os.path.join(path, name), where)
        photos[name] = sorted(f for f in files if not f.startswith(".") and f.lower().endswith(EXTENSIONS))
        unread += [f"{name}/{f}" for f in sorted(files) if not f.startswith(".") and f.lower().endswith(OTHER_IMAGES)]
        folders += [f"{name}/{f}" for f in sorted(inside) if not f.startswith(".")]
    _say_unread(where, unread, folders, loose)
    if not any(photos.values()):
        raise ConfigError(f"{where}: no JPEG or PNG files (.jpg, .jpeg, .png) in the class folders of {path}")
    empty = [name for name, files in photos.items() if not files]
    if empty:
        raise ConfigError(
            f"{where}: class folder {os.path.join(path, empty[0])} holds no JPEG or PNG files (.jpg, .jpeg, .png)"
            + (f"; nor do {len(empty) - 1} other(s): {', '.join(empty[1:4])}" if len(empty) > 1 else "")
        )
    return photos


def _loose(path, where):
    """The sorted photos (by extension, of any format) in `path` itself, beside its class or split folders: of no
    class, so not read."""
    return [f for f in sorted(_files(path, where)[0]) if not f.startswith(".") and f.lower().endswith(PHOTOS)]


def _say_unread(where, unread, folders, loose):
    """A warning naming the photos of other formats (by extension), the folders in the class folders and the photos
    beside the class folders (of no class), which the run does not read: they were left out without a word, and the
    run trained on fewer photos than the folder holds (files of no image format, a notes.txt or a Thumbs.db, are left
    out unsaid)."""
    said = []
    if unread:
        said.append(f"{len(unread)} photo(s) of another format than JPEG or PNG ({_some(unread)})")
    if folders:
        said.append(f"{len(folders)} folder(s) inside class folders ({_some(folders)})")
    if loose:
        said.append(f"{len(loose)} photo(s) outside the class folders ({_some(loose)})")
    if said:
        print(
            f"warning: {where}: not read: {' and '.join(said)}: only .jpg, .jpeg and .png files directly in a "
            "class folder are",
            flush=True,
        )


def _some(names):
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _split(examples):
    """An in-memory Split of (path, label) pairs. The path is read by `decode` and is the `origin` the engine
    names when the file does not decode (one tensor under both names)."""
    paths, labels = zip(*examples)
    # A path's bytes: a name that is not UTF-8 (listed as its surrogate escapes, os.fsdecode) reads as it is on disk.
    paths = tf.constant([os.fsencode(path) for path in paths], tf.string)
    return in_memory({"path": paths, "origin": paths, "label": tf.constant(labels, tf.int64)})
