"""CIFAR-style ResNet (He et al. 2016, section 4.2): depth 6n+2, three stages of n basic blocks.

Batch norm is synchronized across replicas: statistics come from the global batch, so every
replica computes the same normalization as one device and the moving averages never drift.
"""

import math

import tensorflow as tf

keras = tf.keras

SETTINGS = {
    "resnet_depth": (20, "number of layers, 6n+2 (20, 32, 44, 56, 110)"),
    "resnet_width": (16, "channels of the first stage; stages use 1x, 2x, 4x"),
}


def _conv(filters, strides=1):
    return keras.layers.Conv2D(
        filters, 3, strides=strides, padding="same", use_bias=False, kernel_initializer="he_normal"
    )


def _sum_over_replicas(values):
    """Each of `values` (tensors) summed over all replicas; its gradient, the upstream gradients summed over all
    replicas (every replica's loss depends on every replica's batch): as ReplicaContext.all_reduce, traced in a
    fraction of the time.

    all_reduce's gradient is a tf.custom_gradient, which walks the graph back from the sums to find the variables
    they used. Under MirroredStrategy every replica traces into one graph, so the walk crosses into the other
    replicas' inputs and on through all they computed before: each call costs the whole graph traced so far, and
    a mirrored ResNet-20's 42 calls were most of its first step's time. Here every all-reduce sums inputs behind
    tf.stop_gradient, where the walk ends, and this function gives the gradient itself: the same sums of the same
    values as all_reduce's, forward and backward.
    """
    ctx = tf.distribute.get_replica_context()

    def reduce(tensors):
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.stop_gradient(t) for t in tensors])

    @tf.custom_gradient
    def summed(*tensors):
        return reduce(tensors), lambda *upstream: reduce(upstream)

    return summed(*values)


class SyncBatchNorm(keras.layers.Layer):
    """Batch normalization over the global batch: every replica all-reduces its sums.

    Keras's BatchNormalization(synchronized=True) computes the variance as E[x^2] - E[x]^2 from
    all-reduced sums; when a channel's variance is tiny that difference cancels catastrophically and
    one device and several replicas drift apart by far more than float rounding. Here the mean is
    all-reduced first, then the squared deviations from it: two passes, each exact to rounding.
    Statistics are computed in float32 under any precision.
    """

    def __init__(self, momentum=0.9, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.momentum, self.epsilon = momentum, epsilon

    def build(self, input_shape):
        channels = (input_shape[-1],)
        weight = lambda name, init, trainable: self.add_weight(  # noqa: E731
            shape=channels, initializer=init, trainable=trainable, name=name, autocast=False
        )
        self.gamma, self.beta = weight("gamma", "ones", True), weight("beta", "zeros", True)
        self.moving_mean = weight("moving_mean", "zeros", False)
        self.moving_variance = weight("moving_variance", "ones", False)

    def call(self, inputs, training=False):
        x = tf.cast(inputs, tf.float32)
        if training:
            axes = list(range(len(x.shape) - 1))
            count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), tf.float32)
            total, count = _sum_over_replicas([tf.reduce_sum(x, axes), count])
            mean = total / count
            (squares,) = _sum_over_replicas([tf.reduce_sum(tf.square(x - mean), axes)])
            variance = squares / count
            for moving, value in ((self.moving_mean, mean), (self.moving_variance, variance)):
                moving.assign(moving * self.momentum + value * (1.0 - self.momentum))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        y = tf.nn.batch_normalization(x, mean, variance, self.beta, self.gamma, self.epsilon)
        return tf.cast(y, inputs.dtype)


def _norm():
    return SyncBatchNorm(momentum=0.9, epsilon=1e-5)


class BasicBlock(keras.layers.Layer):
    def __init__(self, filters, strides, **kwargs):
        super().__init__(**kwargs)
        self.conv1, self.norm1 = _conv(filters, strides), _norm()
        self.conv2, self.norm2 = _conv(filters), _norm()
        self.filters, self.strides = filters, strides
        self.shortcut = None

    def build(self, input_shape):
        if self.strides != 1 or input_shape[-1] != self.filters:
            self.shortcut = keras.Sequential(
                [
                    keras.layers.Conv2D(
                        self.filters, 1, strides=self.strides, use_bias=False, kernel_initializer="he_normal"
                    ),
                    _norm(),
                ]
            )

    def call(self, inputs, training=False):
        x = tf.nn.relu(self.norm1(self.conv1(inputs), training=training))
        x = self.norm2(self.conv2(x), training=training)
        shortcut = self.shortcut(inputs, training=training) if self.shortcut else inputs
        return tf.nn.relu(x + shortcut)


class ResNet(keras.Model):
    def __init__(self, depth, width, num_classes, **kwargs):
        super().__init__(**kwargs)
        blocks_per_stage = (depth - 2) // 6
        self.stem, self.stem_norm = _conv(width), _norm()
        self.blocks = [
            BasicBlock(width * 2**stage, strides=2 if stage and i == 0 else 1)
            for stage in range(3)
            for i in range(blocks_per_stage)
        ]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(num_classes, dtype="float32")

    def call(self, inputs, training=False):
        x = tf.nn.relu(self.stem_norm(self.stem(inputs), training=training))
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


def create(config, spec, num_classes, info):
    del info  # the images' shape is all it reads of them
    input_shape = tuple(spec.shape)
    if len(input_shape) != 3:
        raise ValueError(f"resnet needs images of shape (height, width, channels), got {input_shape}")
    if (config.resnet_depth - 2) % 6 or config.resnet_depth < 8:
        raise ValueError(f"--resnet_depth={config.resnet_depth}: must be 6n+2 with n >= 1 (8, 14, 20, 32, 44, 56, 110)")
    return ResNet(config.resnet_depth, config.resnet_width, num_classes, name="resnet")


def size(config, input_shape, num_classes):
    """(parameters, activation floats per example) before the model exists: parameters exact (Keras's
    count_params), activations what a forward pass keeps for the backward one, roughly."""
    height, width, channels = (list(input_shape) + [1, 1, 1])[:3]
    norm = lambda c: 4 * c  # noqa: E731  (gamma, beta and the two moving statistics)
    stem = config.resnet_width
    parameters = 9 * channels * stem + norm(stem)
    activations = 2 * height * width * stem  # the stem's convolution and norm
    previous = stem
    for stage in range(3):
        filters = config.resnet_width * 2**stage
        if stage:
            height, width = math.ceil(height / 2), math.ceil(width / 2)
        for block in range((config.resnet_depth - 2) // 6):
            parameters += 9 * previous * filters + 9 * filters * filters + 2 * norm(filters)
            if previous != filters or (stage and block == 0):
                parameters += previous * filters + norm(filters)
            activations += 5 * height * width * filters  # two convolutions, two norms, the sum
            previous = filters
    return parameters + previous * num_classes + num_classes, activations + previous + num_classes
