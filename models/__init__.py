"""Model families, one file each: `--model=NAME` loads `models/NAME.py` and calls its
`create(config, input_shape, num_classes)`, which returns a `tf.keras.Model`.

Models never import the engine; `config` is read only for the family's own fields.
The last layer computes in float32 so the loss is float32 under any precision.
"""
