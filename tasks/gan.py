"""A generative adversarial network on images: a generator and a discriminator, two updates of one step.

A generative adversarial network (Goodfellow et al. 2014) on images: a generator turns noise z into images, a
discriminator tells them from real ones, trained in turn as two updates of one step (engine/numerics/updates.py): the
discriminator's, --gan_critic_steps times, then the generator's, each with its own Adam and its own slots, update
count and loss scale. The updates set the rule (adamw) and beta_1 (0.5, as DCGAN) over the run's --optimizer and
--beta_1; the run's --learning_rate, --beta_2, --epsilon, --weight_decay, schedule and clipping apply to both.

Both networks are MLPs built here, sized by --hidden_sizes, with leaky-ReLU hidden layers (slope 0.2) and the run's
--dropout in the discriminator. The generator's sigmoid output has the shape of a prepared image, scaled to [0, 1].

The losses are the non-saturating ones, written with softplus (log(1 + e^x)) on the discriminator's logit D:
    discriminator: softplus(-D(x)) + softplus(D(G(z)))  = -log sigmoid(D(x)) - log(1 - sigmoid(D(G(z))))
    generator:     softplus(-D(G(z)))                   = -log sigmoid(D(G(z)))
The generator's minimax loss, -softplus(D(G(z))), has a vanishing gradient where the discriminator rejects the fakes
with confidence, which is how training begins; the non-saturating one has its largest gradient there.

The noise: each real example of a batch is paired with one z, a function of (--seed, the example's `index`, the
role: the critic's, the generator's, evaluation's) alone, as tasks/contrastive.py's views. So one device, mirrored
replicas and worker processes draw the same z for the same example, and a resumed run the z an uninterrupted one
drew. The critic's repetitions within a step see the step's batch and its z again, each in a fresh forward pass
(dropout masks). The seed the engine hands an update's loss is not used: it differs by replica, so the same example
would get another z on two replicas than on one.

Reported: `frechet_distance` (lower is better), the Frechet distance between Gaussians fitted to the real images of
the evaluation split and to as many generated ones (z of a fixed stream, the same at every evaluation), in pixel
space: the features are the image's pixels themselves. No network is trained or shipped for them (there is no
Inception for 8x8 digits), they are deterministic, and they read what a digit is made of: the mean image and which
pixels ink together. Beside it, per real evaluation example: the discriminator's loss on it and on a fake paired with
it, the generator's loss on that fake, and the shares the discriminator calls real (`real_accepted` of the real
examples, `fake_accepted` of their fakes: near 0.5 each where it cannot tell them apart). `samples.png` shows a grid
of generated images from the same fixed z.
--mode=export serves the generator: z [n, --gan_latent] -> images [n, height, width, channels].
"""

import numpy as np
import tensorflow as tf

from engine.api import ConfigError, Update
from tasks import base

DATASET = "digits"  # the default --dataset
READS = ("hidden_sizes", "dropout")  # models/mlp.py's width of its networks' hidden layers; the discriminator's rate
SETTINGS = {
    "gan_latent": (16, "width of the generator's noise z"),
    "gan_critic_steps": (1, "discriminator updates per generator update, each on the step's batch and noise"),
}

BETA_1 = 0.5  # both Adams' first-moment decay: 0.9 oscillates in adversarial training (Radford et al. 2016)
SLOPE = 0.2  # the leaky ReLUs' slope below 0
# The roles of the noise: the keys of each z are (seed, index, role).
CRITIC, GENERATOR, EVALUATION, SAMPLES = 1, 2, 3, 4
GRID = 10  # samples.png: GRID x GRID generated images
ZOOM = 4  # screen pixels per image pixel in samples.png


class Task(base.Task):
    features = ("image",)
    input = "image"
    objective = ("frechet_distance", "min")
    headline = "frechet_distance"

    def __init__(self, config, spec, info):
        super().__init__(config, spec, info)
        if config.model != "mlp":
            raise ConfigError(
                f"--model={config.model}: --task=gan builds its own generator and discriminator (tasks/gan.py), "
                "MLPs sized by --hidden_sizes; leave --model empty"
            )
        drawable(config, spec["image"].shape)

    def prepare(self, batch):
        return {"image": base.float_image(self, batch)}

    def models(self, create):
        del create  # no family of models/ generates images from noise
        shape, config = tuple(self.spec["image"].shape), self.config
        return networks(shape, config.gan_latent, config.hidden_sizes, "discriminator", "logit", config.dropout)

    # ---- The step: the critic's update, then the generator's -----------------------------------------------

    def updates(self):
        adam = {"optimizer": "adamw", "beta_1": BETA_1}
        return (
            Update(
                "discriminator",
                self.discriminator_loss,
                trains=("discriminator",),
                optimizer=adam,
                repeat=self.config.gan_critic_steps,
            ),
            Update("generator", self.generator_loss, trains=("generator",), optimizer=adam),
        )

    def noise(self, index, role):
        """[n, --gan_latent] standard normals, row i a function of (--seed, index[i], role) alone."""
        return base.example_normals(base.example_keys(self.config.seed, index, role), self.config.gan_latent)

    def discriminator_loss(self, models, batch, seed):
        """Per example: softplus(-D(x)) + softplus(D(G(z))); the fake is a constant of this update."""
        del seed  # per replica: the noise is the example's (see the module's docstring)
        fake = tf.stop_gradient(models["generator"](self.noise(batch["index"], CRITIC), training=True))
        real_logit = base.first_output(models["discriminator"](batch["image"], training=True))
        fake_logit = base.first_output(models["discriminator"](fake, training=True))
        return tf.nn.softplus(-real_logit) + tf.nn.softplus(fake_logit)

    def generator_loss(self, models, batch, seed):
        """Per example: softplus(-D(G(z))), the non-saturating loss."""
        del seed
        fake = models["generator"](self.noise(batch["index"], GENERATOR), training=True)
        return tf.nn.softplus(-base.first_output(models["discriminator"](fake, training=True)))

    # ---- Evaluation ------------------------------------------------------------------------------------------

    def forward(self, models, batch, training):
        """The discriminator's logits on the batch's real images and on one fake paired with each."""
        fake = models["generator"](self.noise(batch["index"], EVALUATION), training=training)
        return {
            "real": base.first_output(models["discriminator"](batch["image"], training=training)),
            "fake": base.first_output(models["discriminator"](fake, training=training)),
        }

    def metrics(self, outputs, batch):
        real, fake = outputs["real"], outputs["fake"]
        return {
            "discriminator_loss": tf.nn.softplus(-real) + tf.nn.softplus(fake),
            "generator_loss": tf.nn.softplus(-fake),
            "real_accepted": tf.cast(real > 0, tf.float32),  # the share the discriminator calls real
            "fake_accepted": tf.cast(fake > 0, tf.float32),
        }

    def samples(self, models, count):
        """[count, height, width, channels] float64: the generator's images for the first `count` z of the fixed
        stream of samples (the same at every evaluation, in every run of this seed)."""
        z = self.noise(tf.range(count, dtype=tf.int64), SAMPLES)
        return np.asarray(models["generator"](z, training=False), np.float64)

    def probe(self, models, examples):
        real, weights = [], []
        for batch in examples(self.config.eval_split):
            weight = batch["weight"].numpy()
            kept = weight > 0  # padding weighs 0
            real.append(batch["image"].numpy()[kept].reshape(int(kept.sum()), -1))
            weights.append(weight[kept])
        real = np.concatenate(real).astype(np.float64)
        fake = self.samples(models, len(real)).reshape(len(real), -1)
        return {"frechet_distance": frechet_distance(real, fake, np.concatenate(weights).astype(np.float64))}

    def pictures(self, models):
        return {"samples": grid(self.samples(models, GRID * GRID), GRID)}

    def serve(self, models):
        return serve_generator(models["generator"], self.config.gan_latent)


def networks(image_shape, latent, widths, judge, output, dropout=0.0):
    """{"generator": noise of `latent` numbers -> an image of `image_shape` (pixels in [0, 1]), `judge`: an image ->
    one number (its last layer named `output`)}: MLPs of `widths` with leaky ReLUs, the judge's with `dropout`. Their
    variables exist before the first trace, their layers named: checkpoints key them by path."""
    generator = tf.keras.Sequential(
        [
            *_hidden(widths),
            tf.keras.layers.Dense(int(np.prod(image_shape)), activation="sigmoid", dtype="float32", name="pixels"),
            tf.keras.layers.Reshape(image_shape, dtype="float32", name="image"),
        ],
        name="generator",
    )
    judged = tf.keras.Sequential(
        [
            tf.keras.layers.Flatten(name="flatten"),
            *_hidden(widths, dropout),
            tf.keras.layers.Dense(1, dtype="float32", name=output),
        ],
        name=judge,
    )
    generator(tf.zeros((1, latent)))
    judged(tf.zeros((1, *image_shape)))
    return {"generator": generator, judge: judged}


def drawable(config, shape):
    """Refuses (ConfigError naming --dataset) an image `grid` cannot draw into samples.png: drawn only at the first
    evaluation, it ended the run there, after its training, and a resumed run at each evaluation again."""
    if not (len(shape) == 2 or (len(shape) == 3 and 1 <= shape[2] <= 4)):
        raise ConfigError(
            f"--dataset={config.dataset}: its image has shape {tuple(shape)}, which --task={config.task} cannot draw "
            "into samples.png: it generates images of shape (height, width) or (height, width, channels) with 1 to 4 "
            "channels"
        )


def serve_generator(generator, latent):
    """The exported function: noise z [batch, latent] -> {"images": the generator's images}."""

    @tf.function(input_signature=[tf.TensorSpec([None, latent], tf.float32, name="z")])
    def serve(z):
        return {"images": tf.cast(generator(z, training=False), tf.float32)}

    return serve


def _hidden(widths, dropout=0.0):
    layers = []
    for i, width in enumerate(widths):
        layers.append(tf.keras.layers.Dense(width, name=f"dense{i}"))
        layers.append(tf.keras.layers.LeakyReLU(SLOPE, name=f"leaky{i}"))
        if dropout:
            layers.append(tf.keras.layers.Dropout(dropout, name=f"dropout{i}"))
    return layers


def frechet_distance(a, b, a_weights=None):
    """The Frechet distance between Gaussians fitted to the rows of `a` and of `b` ([n, d] float64):
    |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2). Each row of `a` counts by its weight in
    `a_weights` ([n], the evaluation's `weight`; None: 1 each), as it counts in the evaluation's means: the real
    images' Gaussian counted an example of weight 0.01 as much as one of weight 1.

    The matrix roots by eigendecompositions of symmetric matrices: exact, deterministic, and real where a
    covariance of fewer examples than dimensions is singular (a border pixel that never inks)."""
    mean_a, mean_b = np.average(a, axis=0, weights=a_weights), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False, aweights=a_weights), np.cov(b, rowvar=False)
    values, vectors = np.linalg.eigh(cov_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T
    middle = root_a @ cov_b @ root_a
    cross = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0.0, None)).sum()
    return float(np.sum((mean_a - mean_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2.0 * cross)


def grid(images, columns):
    """uint8 [height, width, channels]: `images` ([n, h, w, c], or [n, h, w] of one channel, in [0, 1]) in rows of
    `columns`, each pixel ZOOM screen pixels wide, with a one-pixel gray frame around each image."""
    if images.ndim == 3:
        images = images[..., None]
    n, h, w, c = images.shape
    rows = -(-n // columns)
    canvas = np.full((rows * (h + 1) + 1, columns * (w + 1) + 1, c), 0.5)
    for i, image in enumerate(images):
        top, left = 1 + (i // columns) * (h + 1), 1 + (i % columns) * (w + 1)
        canvas[top : top + h, left : left + w] = image
    canvas = np.repeat(np.repeat(canvas, ZOOM, axis=0), ZOOM, axis=1)
    return np.round(np.clip(canvas, 0.0, 1.0) * 255).astype(np.uint8)
