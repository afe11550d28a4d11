"""A low-level TensorFlow training engine: every step explicit, distributed with tf.distribute.

Its wings, each importing only the ones below it: run/ (build.py builds a run in one place; loop.py and
controller.py tell its story: restore, rounds of steps, then the actions due; program.py is the traced inner loop),
state/ (checkpoints, the workdir, the report), cluster/ (strategies, resolvers, the local launcher, signals),
data/ (sources' pipelines as a pure function of the data position), numerics/ (replica.py: the replica step and
its primitives; updates, optimizers, the loss scale), settings/ (every setting, its checks, the errors everyone may
import). api.py is the public face a task, a source or a fork imports.
"""
