"""Model zoo: names, output shapes, parameter counts, and MKLDNN-safe weights."""
import mxnet as mx
import numpy as np
import pytest

from slimgc_mx.bench.models import MODELS, count_params, get_model

SHAPES = {"mlp": (40,), "fc": (3, 32, 32), "cnn1d": (40,), "resnet20": (3, 32, 32), "vgg": (3, 32, 32)}


def _built(name, input_shape, num_classes=10, hybridize=False):
    mx.random.seed(0)
    net = get_model(name, num_classes, input_shape)
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    out = net(mx.nd.zeros((2,) + tuple(input_shape)))
    return net, out


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_output_shape(name):
    _, out = _built(name, SHAPES[name], num_classes=7)
    assert out.shape == (2, 7)


def test_names_are_the_documented_ones():
    assert sorted(MODELS) == ["cnn1d", "fc", "mlp", "resnet20", "vgg"]


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_model("resnet18", 10, (3, 32, 32))
    for name in MODELS:
        assert name in str(e.value)


@pytest.mark.parametrize("name,shape", [("resnet20", (40,)), ("vgg", (64,)),
                                        ("cnn1d", (3, 32, 32))])
def test_wrong_input_rank_is_rejected(name, shape):
    with pytest.raises(ValueError):
        get_model(name, 10, shape)


def test_resnet20_size():
    net, _ = _built("resnet20", (3, 32, 32))
    n, tensors = count_params(net)
    assert 0.26e6 < n < 0.28e6
    # conv+BN stem, 9 blocks x 2 (conv, BN gamma, BN beta), 2 projection shortcuts, FC
    assert tensors == 3 + 9 * 6 + 2 * 3 + 2
    n_all, tensors_all = count_params(net, trainable_only=False)
    assert tensors_all > tensors and n_all > n  # BN running statistics


def test_vgg_is_communication_heavy():
    net, _ = _built("vgg", (3, 32, 32))
    n, _ = count_params(net)
    assert 20e6 < n < 50e6
    largest = max(p.data().size for p in net.collect_params().values())
    assert largest >= 4096 * 4096


def test_vgg_size_does_not_grow_with_image_size():
    small = count_params(_built("vgg", (3, 32, 32), num_classes=1000)[0])
    big = count_params(_built("vgg", (3, 64, 64), num_classes=1000)[0])
    assert small == big
    with pytest.raises(ValueError):
        get_model("vgg", 10, (1, 8, 8))


def test_cnn1d_mixes_small_and_large_tensors():
    net, _ = _built("cnn1d", (40,))
    sizes = [p.data().size for p in net.collect_params().values()]
    assert min(sizes) < 1000 and sum(s < 1000 for s in sizes) >= 4
    assert max(sizes) > 10000


def test_mlp_accepts_any_input_shape():
    _, out = _built("mlp", (1, 8, 8))
    assert out.shape == (2, 10)


@pytest.mark.parametrize("name", ["mlp", "cnn1d"])
def test_hybridized_matches_imperative(name):
    x = mx.nd.array(np.random.default_rng(0).standard_normal((4,) + SHAPES[name]))
    net, _ = _built(name, SHAPES[name])
    ref = net(x).asnumpy()
    net.hybridize()
    np.testing.assert_allclose(net(x).asnumpy(), ref, rtol=1e-5, atol=1e-5)


def test_cnn1d_weights_stay_writable_after_inference():
    """MKLDNN reorders conv weights in place at inference; a kvstore must still write them."""
    net, _ = _built("cnn1d", (40,), hybridize=True)
    net(mx.nd.ones((3, 40))).wait_to_read()  # inference forward
    for p in net.collect_params().values():
        w = p.data()
        (mx.nd.ones(w.shape) * 0.25).copyto(w)
        w.wait_to_read()
        assert float(w.asnumpy().mean()) == pytest.approx(0.25)


def test_fc_is_vgg_sized_with_three_big_tensors():
    net, _ = _built("fc", (3, 32, 32))
    n, tensors = count_params(net)
    assert n == 3072 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    sizes = sorted(p.data().size for p in net.collect_params().values())
    assert tensors == 6 and sizes[-2:] == [3072 * 4096, 4096 * 4096]
