"""A Wasserstein GAN with a gradient penalty (WGAN-GP, Gulrajani et al. 2017): a critic and a generator, two updates.

The critic D scores images (higher: more real) and estimates the Wasserstein-1 distance between the real and the
generated images as E[D(x)] - E[D(G(z))], over critics whose gradient has norm 1 almost everywhere; the penalty holds
it there at points x_hat between a real and a fake example. Per example (Algorithm 1 of the paper):
    critic:    D(G(z)) - D(x) + lambda * (||grad_x D(x_hat)||_2 - 1)^2,   x_hat = eps * x + (1 - eps) * G(z)
    generator: -D(G(z))
with eps ~ U(0, 1) and lambda --wgan_penalty. The penalty is the norm of a gradient: the critic's loss takes it with
a tape of its own, nested in the step's, which differentiates it again with respect to the critic's weights.

The step is two updates (engine/numerics/updates.py): the critic's, --wgan_critic_steps times, each repetition on a
fresh batch of real images of its own, as the paper draws one per critic iteration (a step then reads that many
batches: the generator's update reads the first, and the data position counts them all); then the generator's.
Each is Adam with beta_1 = 0.5 and beta_2 = 0.9, the settings of the paper's released MNIST code (its Algorithm 1
says beta_1 = 0); the run's --learning_rate (the paper's 1e-4), --epsilon, --weight_decay, schedule and clipping
apply to both.

The networks are MLPs as tasks/gan.py builds them, sized by --hidden_sizes, with leaky-ReLU hidden layers (slope
0.2): the generator turns z (--wgan_latent normals) into an image through a sigmoid, the critic's last layer is its
score, unbounded (no sigmoid; its bias adds alike to D(x) and D(G(z)) and cancels from every loss that trains
the critic, so it never moves). Neither has batch norm, which would make one example's score depend on the others'
and break the per-example penalty, and --dropout is refused: the penalty asks for the gradient of one function,
which dropout would draw anew in each pass. The data, the samples, the reported Frechet distance and samples.png are
gan.py's; --mode=export serves the generator: z [n, --wgan_latent] -> images [n, height, width, channels].

The noise: each example's z and eps are functions of (--seed, the example's `index` in the training stream, their
role, the update's repetition within its step) alone (tasks/base.py): one device, mirrored replicas and workers draw
alike, a resumed run draws what an uninterrupted one drew, and each critic repetition draws its own. The `seed` the
engine hands a loss is not used: it differs by replica.

Reported beside gan.py's `frechet_distance` (lower is better), per evaluation example, with z and eps of evaluation's
own: `wasserstein`, the critic's estimate D(x) - D(G(z)) (its mean is the estimate of the distance); `critic_loss`
and `generator_loss` as trained; `gradient_norm`, ||grad_x D(x_hat)||_2, which the penalty pulls to 1.
"""

import tensorflow as tf

from engine.api import ConfigError, Update
from tasks import base, gan

DATASET = "digits"  # the default --dataset
READS = ("hidden_sizes",)  # models/mlp.py's setting: the widths of its own networks' hidden layers
SETTINGS = {
    "wgan_latent": (16, "width of the generator's noise z"),
    "wgan_critic_steps": (5, "critic updates per generator update, each on a fresh batch of its own"),
    "wgan_penalty": (10.0, "lambda: the weight of the critic's gradient penalty, (||grad D(x_hat)|| - 1)^2"),
}

ADAM = {"optimizer": "adamw", "beta_1": 0.5, "beta_2": 0.9}
# The roles of the noise beside gan.py's roles of z (critic, generator, evaluation, samples): eps's.
INTERPOLATION = 5
TINY = 1e-12  # under the norm's square root: its gradient at 0 is infinite


class Task(gan.Task):
    def __init__(self, config, spec, info):
        if config.model != "mlp":
            raise ConfigError(
                f"--model={config.model}: --task=wgan_gp builds its own generator and critic (tasks/wgan_gp.py), "
                "MLPs sized by --hidden_sizes; leave --model empty"
            )
        if config.dropout:
            raise ConfigError(
                f"--dropout={config.dropout}: --task=wgan_gp's gradient penalty holds the critic's gradient to norm 1, "
                "which dropout would make another function's in each pass; leave --dropout at 0"
            )
        super().__init__(config, spec, info)

    def models(self, create):
        del create  # no family of models/ generates images from noise
        shape = tuple(self.spec["image"].shape)
        return gan.networks(shape, self.config.wgan_latent, self.config.hidden_sizes, "critic", "score")

    # ---- The step: the critic's update on fresh batches, then the generator's --------------------------------

    def updates(self):
        return (
            Update(
                "critic",
                self.critic_loss,
                trains=("critic",),
                optimizer=ADAM,
                repeat=self.config.wgan_critic_steps,
                fresh=True,
            ),
            Update("generator", self.generator_loss, trains=("generator",), optimizer=ADAM),
        )

    def noise(self, index, role, repetition=None):
        """[n, --wgan_latent] standard normals, row i a function of (--seed, index[i], role, repetition) alone."""
        keys = base.example_keys(self.config.seed, index, role, repetition)
        return base.example_normals(keys, self.config.wgan_latent)

    def interpolation(self, index, repetition=None):
        """[n] eps ~ U(0, 1), each a function of (--seed, index[i], repetition) alone."""
        return base.example_uniforms(base.example_keys(self.config.seed, index, INTERPOLATION, repetition), 1)[:, 0]

    def critic_loss(self, models, batch, seed, repetition):
        """Per example: D(G(z)) - D(x) + lambda (||grad D(x_hat)|| - 1)^2; the fake is a constant of this update."""
        del seed  # per replica: the noise is the example's (see the module's docstring)
        index = batch["index"]
        fake = tf.stop_gradient(models["generator"](self.noise(index, gan.CRITIC, repetition), training=True))
        eps = self.interpolation(index, repetition)
        return self.critic_objective(*scores(models["critic"], batch["image"], fake, eps, training=True))

    def critic_objective(self, real, fake, norm):
        """D(G(z)) - D(x) + lambda (||grad D(x_hat)|| - 1)^2 per example, from the critic's scores and norm."""
        return fake - real + self.config.wgan_penalty * tf.square(norm - 1.0)

    def generator_loss(self, models, batch, seed, repetition):
        """Per example: -D(G(z))."""
        del seed
        fake = models["generator"](self.noise(batch["index"], gan.GENERATOR, repetition), training=True)
        return -base.first_output(models["critic"](fake, training=True))

    # ---- Evaluation ------------------------------------------------------------------------------------------

    def forward(self, models, batch, training):
        """The critic's scores of the batch's real images and of a fake paired with each, and its gradient's norm
        at a point between them."""
        index = batch["index"]
        fake = models["generator"](self.noise(index, gan.EVALUATION), training=training)
        real, fake, norm = scores(models["critic"], batch["image"], fake, self.interpolation(index), training=training)
        return {"real": real, "fake": fake, "norm": norm}

    def metrics(self, outputs, batch):
        real, fake, norm = outputs["real"], outputs["fake"], outputs["norm"]
        return {
            "wasserstein": real - fake,
            "critic_loss": self.critic_objective(real, fake, norm),
            "generator_loss": -fake,
            "gradient_norm": norm,
        }

    def serve(self, models):
        return gan.serve_generator(models["generator"], self.config.wgan_latent)


def scores(critic, real, fake, eps, training):
    """(D(real), D(fake), ||grad_x D(x_hat)||_2) per example, x_hat = eps * real + (1 - eps) * fake, in float32.

    The gradient is taken with a tape of its own; a tape around this call differentiates the norm again."""
    eps = tf.reshape(eps, [-1] + [1] * (real.shape.rank - 1))
    mixed = eps * real + (1.0 - eps) * fake
    with tf.GradientTape() as tape:
        tape.watch(mixed)
        mixed_score = base.first_output(critic(mixed, training=training))
    # The gradient of the scores' sum (a tape's of a vector); each score depends on its own example alone (no batch
    # norm), so row i is example i's own gradient.
    grads = tf.cast(tape.gradient(mixed_score, mixed), tf.float32)
    norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=list(range(1, real.shape.rank))) + TINY)
    return base.first_output(critic(real, training=training)), base.first_output(critic(fake, training=training)), norm
