"""The models of bench/models.py in PyTorch, parameter for parameter (same shapes, same order).

scripts/train_torch.py trains them, so the cluster harness compares PyTorch's DDP and
SlimGC's PyTorch adapter with the MXNet runs on the same tensors. Weights start as
train.py's do (Gaussian Xavier over fan-in with magnitude 2, zero biases); BatchNorm
keeps MXNet's momentum (0.9 there is 0.1 here) and epsilon. Imports no MXNet.
"""
import math

import torch
from torch import nn

from . import shapes

__all__ = ["MODELS", "get_model", "count_params", "init_weights"]

_BN = {"momentum": 0.1, "eps": 1e-5}


def _mlp_body(in_features, hidden, num_classes):
    layers = [nn.Flatten()]
    for width in hidden:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    return layers + [nn.Linear(in_features, num_classes)]


class MLP(nn.Sequential):
    """Fully connected ReLU network on flattened inputs (models.MLP)."""

    def __init__(self, num_classes, input_shape, hidden=(256, 256)):
        super().__init__(*_mlp_body(math.prod(input_shape), hidden, num_classes))


class CNN1D(nn.Module):
    """models.CNN1D: 2-D convolutions with (1, k) kernels on a (C, 1, L) view, as MXNet's."""

    def __init__(self, num_classes, input_shape, channels=(32, 64, 64), hidden=128):
        super().__init__()
        self._add_channel_axis = len(input_shape) == 1
        c_in = 1 if self._add_channel_axis else input_shape[0]
        length = input_shape[-1] // 2 // 2
        c1, c2, c3 = channels
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c1, (1, 5), padding=(0, 2)), nn.ReLU(),
            nn.Conv2d(c1, c2, (1, 3), padding=(0, 1)), nn.ReLU(),
            nn.MaxPool2d((1, 2), (1, 2)),
            nn.Conv2d(c2, c3, (1, 3), padding=(0, 1)), nn.ReLU(),
            nn.MaxPool2d((1, 2), (1, 2)),
            nn.Flatten(), nn.Linear(c3 * length, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes))

    def forward(self, x):
        if self._add_channel_axis:
            x = x.unsqueeze(1)  # (N, L) -> (N, 1, L)
        return self.body(x.unsqueeze(2))  # (N, C, L) -> (N, C, 1, L)


class BasicBlock(nn.Module):
    """models.BasicBlock: two 3x3 conv+BN, identity or 1x1 conv+BN shortcut."""

    def __init__(self, c_in, channels, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, channels, 3, stride, 1, bias=False), nn.BatchNorm2d(channels, **_BN),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels, **_BN))
        self.shortcut = None
        if stride != 1:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(channels, **_BN))

    def forward(self, x):
        residual = x if self.shortcut is None else self.shortcut(x)
        return torch.relu(self.body(x) + residual)


class ResNetCIFAR(nn.Module):
    """models.ResNetCIFAR: ResNet-(6n+2) for 32x32 images; n=3 is ResNet-20."""

    def __init__(self, num_classes, input_shape, n=3, widths=(16, 32, 64)):
        super().__init__()
        layers = [nn.Conv2d(input_shape[0], widths[0], 3, 1, 1, bias=False),
                  nn.BatchNorm2d(widths[0], **_BN), nn.ReLU()]
        c_in = widths[0]
        for stage, width in enumerate(widths):
            for i in range(n):
                layers.append(BasicBlock(c_in, width, 2 if (stage > 0 and i == 0) else 1))
                c_in = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.output = nn.Linear(c_in, num_classes)

    def forward(self, x):
        return self.output(self.features(x))


class VGG(nn.Module):
    """models.VGG: conv+BN features, average-pooled to 2x2, then two 4096-wide FC layers."""

    def __init__(self, num_classes, input_shape, cfg=(64, "M", 128, "M", 256, 256, "M", 512,
                                                     512, "M"), fc=4096, dropout=0.5):
        super().__init__()
        c_in, size = input_shape[0], input_shape[1]
        feature_size = size // 16
        layers = []
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                size //= 2
            else:
                layers += [nn.Conv2d(c_in, v, 3, 1, 1, bias=False), nn.BatchNorm2d(v, **_BN),
                           nn.ReLU()]
                c_in = v
        if feature_size > 2:
            k = feature_size // 2
            layers.append(nn.AvgPool2d(k, k))
            size //= k
        self.features = nn.Sequential(*layers)
        head, width = [nn.Flatten()], c_in * size * size
        for _ in range(2):
            head += [nn.Linear(width, fc), nn.ReLU()]
            if dropout:
                head.append(nn.Dropout(dropout))
            width = fc
        self.classifier = nn.Sequential(*head, nn.Linear(width, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


MODELS = {
    "mlp": lambda k, shape: MLP(k, shape),
    "fc": lambda k, shape: MLP(k, shape, hidden=(4096, 4096)),
    "cnn1d": lambda k, shape: CNN1D(k, shape),
    "resnet20": lambda k, shape: ResNetCIFAR(k, shape, n=3),
    "vgg": lambda k, shape: VGG(k, shape),
}


def init_weights(model):
    """train.py's initialization: weights N(0, 2 / fan_in) (MXNet's Gaussian Xavier over
    fan-in, magnitude 2), biases 0, BatchNorm scale 1 and shift 0."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


def get_model(name, num_classes, input_shape):
    """The model `name` for `num_classes` and per-sample `input_shape`, initialized as
    init_weights() does (seed torch first for the same weights on every rank)."""
    return init_weights(shapes.build(MODELS, name, num_classes, input_shape))


def count_params(model):
    """(number of elements, number of tensors) of the trainable parameters (BatchNorm's
    running statistics are buffers, never communicated), as models.count_params."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)
