"""A low-level TensorFlow training engine: every step explicit, distributed with tf.distribute.

Read in this order: loop.py (the story of a run: build, restore, rounds of steps, then what is due),
actions.py (what is due after a round), trainer.py (what a run holds, built in order from build.py's pieces;
the traced inner loop), step.py (the replica step and its primitives), updates.py (a step's updates),
inputs.py (how the steps get their batches), then settings.py and config.py (every setting), optim.py,
precision.py, data.py, distribute.py (the strategy) and cluster.py (who a cluster's tasks are, and what a task
does when a peer stops answering), report.py; errors.py holds the errors everyone may import.
"""
