"""The PyTorch adapter's bad input, in one process (no process group: a job of one)."""
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import slimgc_mx.torch as slimgc  # noqa: E402


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def make(model=None, **options):
    model = model or net()
    return model, slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              model, **options)


@pytest.mark.slow
def test_import_needs_no_mxnet():
    code = ("import sys, slimgc_mx.torch; "
            "assert 'mxnet' not in sys.modules, sorted(m for m in sys.modules if 'mxnet' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_ddp_wrapped_model_is_refused_naming_the_fix():
    model = net()
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(TypeError, match="model.module"):
        slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), wrapped)


def test_unknown_codec_and_option():
    with pytest.raises(ValueError, match="unknown compressor '3bit'"):
        make(compression="3bit")
    with pytest.raises(ValueError, match="ratoi"):
        make(compression="topk", ratoi=0.1)


def test_parameters_the_optimizer_lacks_or_float64():
    model = net()
    with pytest.raises(ValueError, match="not in the optimizer"):
        slimgc.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="float32"):
        make(net().double())


def test_missing_and_sparse_gradients():
    model, opt = make(compression="none")
    with pytest.raises(RuntimeError, match="has no gradient"):
        opt.step()
    emb = torch.nn.Embedding(10, 4, sparse=True)
    model, opt = make(emb, compression="none")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradient"):
        opt.step()


def test_dgc_refuses_the_optimizers_momentum():
    model = net()
    with pytest.raises(ValueError, match="momentum must be 0"):
        slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model, compression="dgc")


def test_randomk_below_half_with_the_optimizers_momentum_is_warned_about(monkeypatch):
    from slimgc_mx.engine import planner
    monkeypatch.setattr(planner, "_ADVISED", set())
    model = net()
    with pytest.warns(UserWarning, match="ratio=0.1 with optimizer momentum 0.9.*ratio >= 0.5"):
        opt = slimgc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
            compression="randomk", ratio=0.1)
    opt.close()


def test_flush_takes_a_distributed_optimizer():
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        slimgc.flush(torch.optim.SGD(net().parameters(), lr=0.1))


def test_a_job_of_one_trains_and_state_dict_loads_into_another_optimizer_class_refused():
    model, opt = make(compression="2bit", comm_threshold=0, warmup_steps=2)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    state = opt.state_dict()
    other = net()
    adam = slimgc.DistributedOptimizer(torch.optim.Adam(other.parameters()), other,
                                       compression="2bit", comm_threshold=0, warmup_steps=2)
    with pytest.raises(ValueError, match="optimizer"):
        adam.load_state_dict(state)
    opt.close()
    adam.close()


def _trained(steps=3, **options):
    """A job of one after `steps` steps of the same batch."""
    model, opt = make(**dict(dict(compression="2bit", comm_threshold=0, warmup_steps=2),
                             **options))
    x, y = torch.randn(32, 4, generator=torch.Generator().manual_seed(1)), \
        torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def test_a_state_of_another_world_size_says_the_sizes_differ():
    """It listed the two (identical) key lists instead."""
    model, opt = _trained()
    state = opt.state_dict()
    state["num_workers"] = 4
    with pytest.raises(ValueError) as exc:
        opt.load_state_dict(state)
    message = str(exc.value)
    assert "world sizes differ (saved 4, now 1)" in message, message
    assert "keys" not in message and "'0.weight'" not in message, message
    opt.close()


def test_a_misspelt_setting_or_option_suggests_the_closest_name():
    """warmup_step=5 said "codec '2bit' has no option warmup_step" with no hint."""
    with pytest.raises(ValueError, match="has no option warmup_step.*did you mean warmup_steps"):
        make(warmup_step=5)
    with pytest.raises(ValueError, match="did you mean ratio"):
        make(compression="topk", ratoi=0.1)


def test_codec_options_with_compression_none_are_refused():
    """threshold=0.1 with compression='none' was accepted and did nothing."""
    with pytest.raises(ValueError, match="compressor 'none' takes no codec options.*"
                                         "threshold=0.1"):
        make(compression="none", threshold=0.1)
    with pytest.raises(ValueError, match="compressor 'none' takes no codec options.*levels=8"):
        make(compression="none", levels=8)
    make(compression="none")[1].close()  # none alone is fine


def test_a_model_on_the_meta_device_is_refused_naming_the_fix():
    """It got torch's bare "Cannot copy out of meta tensor"."""
    with torch.device("meta"):
        model = net()
    with pytest.raises(ValueError, match=r"parameter 0.weight is on the meta device.*"
                                         r"to_empty\(device=.*before"):
        slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def _body_and_head():
    """A model whose head is frozen, and the optimizer of its body alone."""
    model = net()
    for p in model[2].parameters():
        p.requires_grad_(False)
    return model, torch.optim.SGD(model[0].parameters(), lr=0.1)


def _one_step(model, opt):
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_a_param_group_added_after_wrapping_is_refused_naming_the_fix():
    """It was accepted, and the head it held never changed."""
    model, inner = _body_and_head()
    opt = slimgc.DistributedOptimizer(inner, model, compression="none")
    for p in model[2].parameters():
        p.requires_grad_(True)
    with pytest.raises(ValueError, match=r"add_param_group.*inner.add_param_group\(\.\.\.\) "
                                         r"first, then build the DistributedOptimizer.*lr=0"):
        opt.add_param_group({"params": model[2].parameters()})
    assert len(opt.param_groups) == 1
    opt.close()


def test_a_param_group_added_to_the_inner_optimizer_after_wrapping_fails_the_next_step():
    model, inner = _body_and_head()
    opt = slimgc.DistributedOptimizer(inner, model, compression="none")
    _one_step(model, opt)
    for p in model[2].parameters():
        p.requires_grad_(True)
    inner.add_param_group({"params": model[2].parameters()})
    with pytest.raises(ValueError, match=r"2 param groups of 4 parameters, 1 of 2 when it "
                                         r"was wrapped.*inner.add_param_group"):
        _one_step(model, opt)
    opt.close()


def test_the_head_given_from_the_start_at_lr_0_trains_once_its_lr_is_raised():
    """The fine-tuning pattern the message advises."""
    model = net()
    inner = torch.optim.SGD([{"params": model[0].parameters()},
                             {"params": model[2].parameters(), "lr": 0.0}], lr=0.1)
    opt = slimgc.DistributedOptimizer(inner, model, compression="none")
    head = model[2].weight.detach().clone()
    _one_step(model, opt)
    opt.flush()
    assert torch.equal(model[2].weight, head)
    opt.param_groups[1]["lr"] = 0.1
    _one_step(model, opt)
    opt.flush()
    assert not torch.equal(model[2].weight, head)
    opt.close()
