"""Bundled data sources beside tensorflow-datasets, one file each: `--dataset=NAME` finds
`sources/NAME.py`, whose `load(config, eval_split)` returns an `engine.api.Source` (in memory or streamed).
A source declares its own settings as a model does (models/__init__.py: `SETTINGS`), and names the settings
of other files it reads in `READS` (shakespeare reads language_model's `sequence_length`).

The engine finds these files by path (engine/settings/plugins.py) and imports one only to run it.
"""
