"""The bundled UCI 8x8 handwritten digits (--dataset=digits, the default): a tensorflow-datasets builder.

Importing this module registers the builder as `digits`, so the bundled data is read through tensorflow-datasets
like any other dataset (prepared once into --data_dir), without a network. The data file, data/digits.csv.gz, is
the UCI test set shipped with scikit-learn; data/DIGITS.md has its source, license (CC BY 4.0) and split.
"""

import gzip
import os

import numpy as np
import tensorflow_datasets as tfds

from engine.api import tfds_source

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")

# Deterministic split by row: rows are ordered by writer, so every tenth row spreads each split
# over all writers and classes.
_SPLIT_OF_REMAINDER = {0: "test", 1: "test", 2: "validation"}


def _split(row_index):
    return _SPLIT_OF_REMAINDER.get(row_index % 10, "train")


class Digits(tfds.core.GeneratorBasedBuilder):
    """1,797 8x8 grayscale digits: 1,257 train, 180 validation, 360 test."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Bundled copy of the UCI optdigits test set, split 70/10/20 by row."}

    def _info(self):
        return self.dataset_info_from_configs(
            description="UCI Optical Recognition of Handwritten Digits, 8x8 images of 0..16 counts scaled to 0..255.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1)),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits",
            license="CC BY 4.0",
            citation="Alpaydin, E. and Kaynak, C. (1998). Optical Recognition of Handwritten Digits. "
            "UCI Machine Learning Repository. https://doi.org/10.24432/C50P49",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # the data ships with the repository
        return {name: self._generate_examples(name) for name in ("train", "validation", "test")}

    def _generate_examples(self, split):
        for index, (image, label) in enumerate(read_rows()):
            if _split(index) == split:
                yield index, {"image": image, "label": label}


def read_rows(path=DATA_FILE):
    """Yields (uint8 image of shape 8x8x1 in 0..255, label) from the bundled CSV."""
    with gzip.open(path, "rt") as f:
        for line_number, line in enumerate(f, start=1):
            values = [int(v) for v in line.split(",")]
            if len(values) != 65 or not 0 <= values[-1] <= 9 or min(values[:64]) < 0 or max(values[:64]) > 16:
                raise ValueError(f"{path}:{line_number}: expected 64 pixel counts in 0..16 and a label in 0..9")
            pixels = np.rint(np.array(values[:64], np.float32) * (255 / 16)).astype(np.uint8)
            yield pixels.reshape(8, 8, 1), values[64]


def load(config, eval_split):
    """The digits' Source: 1,257 training, 180 validation and 360 test images (uint8, 8x8x1) and their labels."""
    return tfds_source(config, "digits", ("image", "label"), eval_split)
