"""Model families, one file each: `--model=NAME` loads `models/NAME.py` and calls its
`create(config, spec, num_outputs, info)`, which returns a `tf.keras.Model`: `spec` is the tf.TensorSpec of one
input example, `info` what the data source knows of it (a text's `vocabulary`, a label's `num_classes`; {} when
nothing), so a model that sizes itself from its data (a character tagger's embedding) is a model file. A factory
of the older form, `create(config, input_shape, num_outputs)` (three parameters, the shape a tuple), is still
called that way.

A family says how large it is before it exists, for the memory check (engine/run/memory.py):
`size(config, input_shape, num_outputs)` -> (parameters, activation floats per example that a forward pass keeps
for the backward one[, the floats per example a forward pass alone holds at once: one layer's, where it frees the
others]). A family without it is built unchecked, and the run's first lines say so.

A family's own settings are declared in its file as a literal `SETTINGS = {"name": (default, "help")}`:
each becomes a flag and a field of the run's Config (engine/settings/config.py), read by the runs that choose the
family; a file that reads a setting another file declares names it in `READS = ("name", ...)`. `create`
reads them from `config` and raises ValueError("--name=value: why") for a value it cannot build. Models
never import the engine. The last layer computes in float32 so the loss is float32
under any precision.

The engine finds these files by path (engine/settings/plugins.py) and imports one only to run it.
"""
