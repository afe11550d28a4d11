"""CIFAR-style ResNet (He et al. 2016, section 4.2): depth 6n+2, three stages of n basic blocks.

Batch norm is synchronized across replicas: statistics come from the global batch, so every
replica computes the same normalization as one device and the moving averages never drift.
"""

import tensorflow as tf

keras = tf.keras


def _conv(filters, strides=1):
    return keras.layers.Conv2D(
        filters, 3, strides=strides, padding="same", use_bias=False, kernel_initializer="he_normal"
    )


def _norm():
    return keras.layers.BatchNormalization(synchronized=True, momentum=0.9, epsilon=1e-5)


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


def create(config, input_shape, num_classes):
    if len(input_shape) != 3:
        raise ValueError(f"resnet needs images of shape (height, width, channels), got {input_shape}")
    return ResNet(config.resnet_depth, config.resnet_width, num_classes, name="resnet")
