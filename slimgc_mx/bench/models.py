"""Gluon models for the training job and the benchmarks, selected by name.

Every model is a HybridBlock built from stock Gluon layers, so it can be hybridized.
The set spans the tensor-size mixes the SlimGC strategies care about: `cnn1d` has
many tiny tensors, `resnet20` many small BN/conv tensors, `vgg` a few huge FC ones
behind conv layers, `fc` the same huge FC layers with almost no compute.
"""
from mxnet.gluon import nn

from . import shapes

__all__ = ["MODELS", "get_model", "count_params"]


class MLP(nn.HybridBlock):
    """Fully connected ReLU network on flattened inputs (any input shape)."""

    def __init__(self, num_classes, hidden=(256, 256), **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = nn.HybridSequential(prefix="")
            self.body.add(nn.Flatten())
            for width in hidden:
                self.body.add(nn.Dense(width, activation="relu"))
            self.body.add(nn.Dense(num_classes))

    def hybrid_forward(self, F, x):
        return self.body(x)


class CNN1D(nn.HybridBlock):
    """Small 1-D conv net for (L,) or (C, L) signals such as MNIST-1D.

    Convolutions are 2-D with (1, k) kernels on a (C, 1, L) view: MKLDNN reorders conv
    weights in place at inference, and 3-D (Conv1D) weights in that layout can no
    longer be written by a kvstore; 4-D ones can. No BatchNorm (MKLDNN's 1-D BN fails
    at inference). Tensors range from 10-128 (biases) and 160 (first conv) elements to
    81920 (the dense layer on (40,) inputs), so a communication threshold splits them.
    """

    def __init__(self, num_classes, channels=(32, 64, 64), hidden=128, add_channel_axis=True,
                 **kwargs):
        super().__init__(**kwargs)
        self._add_channel_axis = add_channel_axis
        with self.name_scope():
            self.body = nn.HybridSequential(prefix="")
            c1, c2, c3 = channels
            self.body.add(nn.Conv2D(c1, (1, 5), padding=(0, 2), activation="relu"))
            self.body.add(nn.Conv2D(c2, (1, 3), padding=(0, 1), activation="relu"))
            self.body.add(nn.MaxPool2D((1, 2), strides=(1, 2)))
            self.body.add(nn.Conv2D(c3, (1, 3), padding=(0, 1), activation="relu"))
            self.body.add(nn.MaxPool2D((1, 2), strides=(1, 2)))
            self.body.add(nn.Flatten())
            self.body.add(nn.Dense(hidden, activation="relu"))
            self.body.add(nn.Dense(num_classes))

    def hybrid_forward(self, F, x):
        if self._add_channel_axis:
            x = F.expand_dims(x, axis=1)  # (N, L) -> (N, 1, L)
        return self.body(F.expand_dims(x, axis=2))  # (N, C, L) -> (N, C, 1, L)


class BasicBlock(nn.HybridBlock):
    """CIFAR ResNet basic block: two 3x3 conv+BN, identity or 1x1 conv+BN shortcut."""

    def __init__(self, channels, stride, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = nn.HybridSequential(prefix="")
            self.body.add(nn.Conv2D(channels, 3, strides=stride, padding=1, use_bias=False))
            self.body.add(nn.BatchNorm())
            self.body.add(nn.Activation("relu"))
            self.body.add(nn.Conv2D(channels, 3, strides=1, padding=1, use_bias=False))
            self.body.add(nn.BatchNorm())
            self.shortcut = None
            if stride != 1:
                self.shortcut = nn.HybridSequential(prefix="sc_")
                self.shortcut.add(nn.Conv2D(channels, 1, strides=stride, use_bias=False))
                self.shortcut.add(nn.BatchNorm())

    def hybrid_forward(self, F, x):
        residual = x if self.shortcut is None else self.shortcut(x)
        return F.Activation(self.body(x) + residual, act_type="relu")


class ResNetCIFAR(nn.HybridBlock):
    """ResNet-(6n+2) for 32x32 images (He et al. 2016, CIFAR variant); n=3 is ResNet-20."""

    def __init__(self, num_classes, n=3, widths=(16, 32, 64), **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.features = nn.HybridSequential(prefix="")
            self.features.add(nn.Conv2D(widths[0], 3, padding=1, use_bias=False))
            self.features.add(nn.BatchNorm())
            self.features.add(nn.Activation("relu"))
            for stage, width in enumerate(widths):
                for i in range(n):
                    stride = 2 if (stage > 0 and i == 0) else 1
                    self.features.add(BasicBlock(width, stride))
            self.features.add(nn.GlobalAvgPool2D())
            self.output = nn.Dense(num_classes)

    def hybrid_forward(self, F, x):
        return self.output(self.features(x))


class VGG(nn.HybridBlock):
    """VGG-style net for 32x32 images: conv+BN features, then two 4096-wide FC layers.

    Communication-heavy on purpose: ~30M parameters, ~85% of them in the FC layers.
    Larger inputs are average-pooled to 2x2 before the FC layers, so the size holds.
    """

    def __init__(self, num_classes, cfg=(64, "M", 128, "M", 256, 256, "M", 512, 512, "M"),
                 fc=4096, dropout=0.5, feature_size=2, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.features = nn.HybridSequential(prefix="")
            for v in cfg:
                if v == "M":
                    self.features.add(nn.MaxPool2D(pool_size=2, strides=2))
                else:
                    self.features.add(nn.Conv2D(v, 3, padding=1, use_bias=False))
                    self.features.add(nn.BatchNorm())
                    self.features.add(nn.Activation("relu"))
            if feature_size > 2:
                k = feature_size // 2
                self.features.add(nn.AvgPool2D(pool_size=k, strides=k))
            self.classifier = nn.HybridSequential(prefix="")
            self.classifier.add(nn.Flatten())
            for _ in range(2):
                self.classifier.add(nn.Dense(fc, activation="relu"))
                if dropout:
                    self.classifier.add(nn.Dropout(dropout))
            self.classifier.add(nn.Dense(num_classes))

    def hybrid_forward(self, F, x):
        return self.classifier(self.features(x))


def _mlp(num_classes, input_shape):
    return MLP(num_classes)


def _fc(num_classes, input_shape):
    # 3 weight tensors hold 99.9% of ~29M parameters (3x32x32 inputs) at ~2 FLOPs per
    # parameter and sample: the communication-bound extreme.
    return MLP(num_classes, hidden=(4096, 4096))


MODELS = {
    "mlp": _mlp,
    "fc": _fc,
    "cnn1d": lambda k, shape: CNN1D(k, add_channel_axis=len(shape) == 1),
    "resnet20": lambda k, shape: ResNetCIFAR(k, n=3),
    "vgg": lambda k, shape: VGG(k, feature_size=shape[1] // 16),
}


def get_model(name, num_classes, input_shape):
    """Build the (uninitialized) model `name` for `num_classes` and per-sample `input_shape`."""
    return shapes.build(MODELS, name, num_classes, input_shape)


def count_params(net, trainable_only=True):
    """(number of elements, number of tensors) of an initialized net's parameters.

    trainable_only skips BN running statistics (grad_req 'null'), which are never communicated.
    """
    elems = tensors = 0
    for p in net.collect_params().values():
        if trainable_only and p.grad_req == "null":
            continue
        n = 1
        for d in p.shape:
            n *= d
        elems += n
        tensors += 1
    return elems, tensors
