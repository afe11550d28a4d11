"""Classification trained with sharpness-aware minimization (SAM, Foret et al. 2021): a worked custom step.

SAM looks for weights whose whole neighbourhood has a low loss. Each update takes the gradient at w + e, where e is
the step of radius rho (--sam_rho) up the loss from w, and applies it at w:

    g = grad L(w)            all-reduced once, unscaled, checked and clipped like any update's gradients
    e = rho * g / ||g||      ||g||: the global norm of those gradients over every trained variable, after clipping
    grad L(w + e)            all-reduced once, unscaled, checked and clipped, then applied at w by the optimizer

Two forward and backward passes and two all-reduces per update, where the default step takes one of each.

The norm is taken of the gradients as the step hands them (after --clip_norm or --clip_value), so ||e|| = rho
exactly. Norm clipping only rescales g, so e points where the unclipped gradient does; value clipping bends it.
e comes from the GLOBAL batch's gradient: every replica and worker perturbs alike and the update is one device's,
whatever the replica count (the paper's "m-sharpness" perturbs each accelerator by its own shard's gradient;
that is a different method, not this one).

What a user sees and what else moves:
- `loss` is the first evaluation's, at w (the loss being minimized, as the default logs it); `grad_norm` is the
  second's, the norm of the gradients applied, before clipping.
- Batch-norm statistics: both passes are training passes. The second starts from the statistics the first left,
  and the update keeps what the second left: moving statistics take two steps per update, the second at w + e.
  (The primitives keep the state of the step's latest forward pass; some SAM codes keep the first pass's only.)
  The digits MLP has none.
- Dropout: each evaluation draws its own masks (the engine seeds each forward pass by step, replica and pass).
- Weight regularizers are part of L, evaluated at w + e in the second pass.
- float16: both evaluations use the update's loss scale; the update is applied only if both were finite, else
  nothing changes and the scale halves.
- --sam_rho=0 is the default step at twice its cost (an ablation of the method, not of the code).

    python launch.py --flagfile=experiments/digits_mlp.flags --task=sam --workdir=runs/digits_sam
"""

import tensorflow as tf

from engine.api import DEFAULT
from tasks import classification

DATASET = "digits"  # the default --dataset
SETTINGS = {
    "sam_rho": (0.05, "radius of SAM's ascent step: the global norm of the weights' perturbation", (0.0, 10.0)),
}

EPSILON = 1e-12  # keeps e finite (and zero) where the gradient is exactly zero


class Task(classification.Task):
    def replica_step(self, step, batch):
        """One SAM update of every trained variable (the task's one update, "train")."""
        first = step.gradients(DEFAULT, batch)
        scale = self.config.sam_rho / (tf.linalg.global_norm(first.grads) + EPSILON)
        ascent = step.gradients(DEFAULT, batch, shift=[scale * g for g in first.grads])
        step.apply(DEFAULT, ascent)
