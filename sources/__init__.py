"""Bundled data sources beside tensorflow-datasets, one file each: `--dataset=NAME` finds
`sources/NAME.py`, whose `load(config)` returns a `engine.api.Source` (in memory or streamed).
A source declares its own settings as a model does (models/__init__.py: `SETTINGS`), and names the settings
of other files it reads in `READS` (shakespeare reads language_model's `sequence_length`).

This file imports no TensorFlow: flags are checked against it before TensorFlow starts.
"""

import os


def available():
    """The source names in this directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(
        name[:-3] for name in os.listdir(here) if name.endswith(".py") and name[:-3].isidentifier() and name[0] != "_"
    )
