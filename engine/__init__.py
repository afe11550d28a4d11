"""A low-level TensorFlow training engine: every step explicit, distributed with tf.distribute.

Read in this order: config.py (every setting), loop.py (the story of a run), step.py (the replica
step), then optim.py, precision.py, data.py, distribute.py, report.py.
"""
