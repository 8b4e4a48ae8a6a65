"""Tensor shapes and forward FLOPs of models, built from their layer definitions (no weights).

The scale model (scale.py) needs only what a step communicates and computes: each trainable
tensor's shape, in the order the model defines them, and the forward FLOPs of one sample.
VGG-16 and ResNet-50 are the ImageNet networks at 224 x 224 (torchvision's layout: VGG's
convolutions with biases, ResNet's without and with BatchNorm's gamma and beta); BERT-base
is the encoder with a SQuAD span head (no pooler) at 128 tokens. fc, vgg and resnet20 are
the harness's models (bench/models.py) on 3 x 32 x 32 inputs with 10 classes; no MXNet is
imported here, and tests/test_bench_scale.py checks them against the Gluon models.
"""
from dataclasses import dataclass
from math import prod
from typing import Callable, Dict, Tuple

__all__ = ["ModelShapes", "MODELS", "get", "names"]

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class ModelShapes:
    """A model's trainable tensors (name, shape) in definition order, and its forward FLOPs
    per sample (multiply-adds count 2; 0 where not computed)."""

    name: str
    tensors: Tuple[Tuple[str, Shape], ...]
    forward_flops: float
    description: str

    @property
    def elements(self) -> int:
        """Trainable elements: what one worker's fp32 push carries, / 4 bytes."""
        return sum(prod(shape) for _, shape in self.tensors)


class _Net:
    """Walks a network's layers over an activation of shape (C, H, W) or (L, D), recording
    each layer's tensors and multiply-adds per sample."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.tensors = []
        self.macs = 0

    def _add(self, name, shape):
        self.tensors.append((name, tuple(shape)))

    def conv(self, name, channels, k, stride=1, pad=None, bias=False):
        c, h, w = self.shape
        pad = k // 2 if pad is None else pad
        h, w = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        self._add(name + ".weight", (channels, c, k, k))
        if bias:
            self._add(name + ".bias", (channels,))
        self.macs += channels * c * k * k * h * w
        self.shape = (channels, h, w)

    def bn(self, name):
        self._add(name + ".gamma", (self.shape[0],))
        self._add(name + ".beta", (self.shape[0],))

    def pool(self, k, stride):
        c, h, w = self.shape
        self.shape = (c, (h - k) // stride + 1, (w - k) // stride + 1)

    def global_pool(self):
        self.shape = (self.shape[0],)

    def dense(self, name, units, bias=True, tokens=1):
        """A dense layer over the last axis (`tokens` rows of it), or the flattened input."""
        fan_in = self.shape[-1] if tokens > 1 else prod(self.shape)
        self._add(name + ".weight", (units, fan_in))
        if bias:
            self._add(name + ".bias", (units,))
        self.macs += tokens * units * fan_in
        self.shape = (tokens, units) if tokens > 1 else (units,)

    def build(self, name, description):
        return ModelShapes(name, tuple(self.tensors), 2.0 * self.macs, description)


def vgg16(classes=1000) -> ModelShapes:
    """VGG-16 (configuration D) at 224 x 224: 13 3x3 convolutions with biases, 3 FC layers."""
    net = _Net((3, 224, 224))
    cfg = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
           512, 512, 512, "M")
    i = 0
    for v in cfg:
        if v == "M":
            net.pool(2, 2)
        else:
            net.conv("features.%d" % i, v, 3, bias=True)
            i += 1
    for j, units in enumerate((4096, 4096, classes)):
        net.dense("classifier.%d" % j, units)
    return net.build("vgg16", "VGG-16, ImageNet 224x224")


def _bottleneck(net, name, width, stride, downsample):
    """ResNet v1.5 bottleneck (stride on the 3x3): 1x1, 3x3, 1x1 (x4), each with BN."""
    entry = net.shape
    net.conv(name + ".conv1", width, 1)
    net.bn(name + ".bn1")
    net.conv(name + ".conv2", width, 3, stride=stride)
    net.bn(name + ".bn2")
    net.conv(name + ".conv3", width * 4, 1)
    net.bn(name + ".bn3")
    if downsample:
        out = net.shape
        net.shape = entry
        net.conv(name + ".downsample.0", width * 4, 1, stride=stride)
        net.bn(name + ".downsample.1")
        net.shape = out


def resnet50(classes=1000) -> ModelShapes:
    """ResNet-50 (v1.5) at 224 x 224: 53 convolutions, 53 BatchNorms, one FC layer."""
    net = _Net((3, 224, 224))
    net.conv("conv1", 64, 7, stride=2, pad=3)
    net.bn("bn1")
    net.pool(3, 2)  # padding 1: 112 -> 56
    net.shape = (64, 56, 56)
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            _bottleneck(net, "layer%d.%d" % (stage + 1, b), width, stride, b == 0)
    net.global_pool()
    net.dense("fc", classes)
    return net.build("resnet50", "ResNet-50 v1.5, ImageNet 224x224")


def bert_base(seq_len=128, vocab=30522, positions=512, hidden=768, layers=12,
              intermediate=3072) -> ModelShapes:
    """BERT-base encoder with a SQuAD span head (768 -> 2), `seq_len` tokens per sample."""
    net = _Net((seq_len, hidden))
    for name, rows in (("word", vocab), ("position", positions), ("token_type", 2)):
        net._add("embeddings.%s_embeddings" % name, (rows, hidden))
    net.shape = (hidden,)
    net.bn("embeddings.LayerNorm")  # gamma and beta, as a BatchNorm's
    for i in range(layers):
        p = "encoder.layer.%d." % i
        for part in ("query", "key", "value"):
            net.shape = (seq_len, hidden)
            net.dense(p + "attention.self." + part, hidden, tokens=seq_len)
        net.macs += 2 * seq_len * seq_len * hidden  # scores Q K^T and their weighted sum of V
        net.dense(p + "attention.output.dense", hidden, tokens=seq_len)
        net.shape = (hidden,)
        net.bn(p + "attention.output.LayerNorm")
        net.shape = (seq_len, hidden)
        net.dense(p + "intermediate.dense", intermediate, tokens=seq_len)
        net.dense(p + "output.dense", hidden, tokens=seq_len)
        net.shape = (hidden,)
        net.bn(p + "output.LayerNorm")
        net.shape = (seq_len, hidden)
    net.dense("qa_outputs", 2, tokens=seq_len)
    return net.build("bert-base", "BERT-base, SQuAD span head, %d tokens" % seq_len)


def fc(classes=10) -> ModelShapes:
    """The harness's fc: 3072-4096-4096-10 MLP on 3 x 32 x 32 inputs."""
    net = _Net((3, 32, 32))
    for i, units in enumerate((4096, 4096, classes)):
        net.dense("dense%d" % i, units)
    return net.build("fc", "fc (harness), 3x32x32")


def vgg_cifar(classes=10) -> ModelShapes:
    """The harness's vgg: 6 conv+BN layers (no bias), two 4096-wide FC layers, on 32 x 32."""
    net = _Net((3, 32, 32))
    i = 0
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M"):
        if v == "M":
            net.pool(2, 2)
        else:
            net.conv("conv%d" % i, v, 3)
            net.bn("batchnorm%d" % i)
            i += 1
    for j, units in enumerate((4096, 4096, classes)):
        net.dense("dense%d" % j, units)
    return net.build("vgg", "vgg (harness), 3x32x32")


def resnet20(classes=10) -> ModelShapes:
    """The harness's resnet20: CIFAR ResNet-20, basic blocks, 1x1 shortcuts where strided."""
    net = _Net((3, 32, 32))
    net.conv("conv0", 16, 3)
    net.bn("bn0")
    for stage, width in enumerate((16, 32, 64)):
        for b in range(3):
            stride = 2 if stage > 0 and b == 0 else 1
            name = "stage%d.block%d" % (stage + 1, b)
            entry = net.shape
            net.conv(name + ".conv1", width, 3, stride=stride)
            net.bn(name + ".bn1")
            net.conv(name + ".conv2", width, 3)
            net.bn(name + ".bn2")
            if stride != 1:
                out = net.shape
                net.shape = entry
                net.conv(name + ".shortcut", width, 1, stride=stride, pad=0)
                net.bn(name + ".shortcut_bn")
                net.shape = out
    net.global_pool()
    net.dense("output", classes)
    return net.build("resnet20", "resnet20 (harness), 3x32x32")


#: name -> builder; the first three are the tabulated models, the rest the harness's
MODELS: Dict[str, Callable[[], ModelShapes]] = {
    "vgg16": vgg16, "resnet50": resnet50, "bert-base": bert_base,
    "fc": fc, "vgg": vgg_cifar, "resnet20": resnet20,
}


def names():
    return list(MODELS)


def get(name: str) -> ModelShapes:
    """The shapes of model `name`; ValueError naming the valid names otherwise."""
    if name not in MODELS:
        raise ValueError("unknown model %r; valid: %s" % (name, ", ".join(MODELS)))
    return MODELS[name]()


def build(builders, name, num_classes, input_shape):
    """builders[name](num_classes, input_shape) for the harness's models (bench/models.py's
    Gluon and bench/torch_models.py's torch ones alike), after one check of the name and of
    the per-sample input shape each model needs; ValueError naming the problem otherwise."""
    if name not in builders:
        raise ValueError("unknown model %r; valid names: %s" % (name, ", ".join(sorted(builders))))
    shape = tuple(int(d) for d in input_shape)
    if name == "cnn1d" and len(shape) not in (1, 2):
        raise ValueError("cnn1d needs (L,) or (C, L) inputs, got input_shape=%r" % (shape,))
    if name in ("resnet20", "vgg") and len(shape) != 3:
        raise ValueError("%s needs (C, H, W) inputs, got input_shape=%r" % (name, shape))
    if name == "vgg" and (min(shape[1:]) < 32 or shape[1] != shape[2]):
        raise ValueError("vgg needs square images of at least 32x32, got %r" % (shape,))
    return builders[name](int(num_classes), shape)
