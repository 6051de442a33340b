"""The optimizer step fused into backward (lowmem.techniques.fused_step): the plain step's parameters after many
steps under an LR schedule, gradients that never all exist at once, and refusals where it cannot work."""

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmem.memory.accounting import profile_step
from lowmem.techniques import fused_step
from lowmem.wrn.models import build_model

SGD = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    a = build_model("wrn-10-1", num_classes=10, in_channels=3)
    b = build_model("wrn-10-1", num_classes=10, in_channels=3)
    b.load_state_dict(a.state_dict())
    return a, b


def _train_side_by_side(pairs: list[tuple[nn.Module, torch.optim.Optimizer]], seed: int,
                        after_step: Callable[[int], None] = lambda i: None) -> None:
    """8 steps of each (model, optimizer) on the same batches, under the same LR schedule (drops at steps 3 and 6)."""
    scheds = [torch.optim.lr_scheduler.MultiStepLR(o, [3, 6], 0.2) for _, o in pairs]
    g = torch.Generator().manual_seed(seed)
    for i in range(8):
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        for model, opt in pairs:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        for s in scheds:
            s.step()
        after_step(i)


def test_parameters_equal_plain_sgd_bit_for_bit_after_many_steps_under_a_schedule() -> None:
    plain_model, fused_model = _pair()
    plain, fused = torch.optim.SGD(plain_model.parameters(), **SGD), fused_step.fused_sgd(fused_model, **SGD)
    _train_side_by_side([(plain_model, plain), (fused_model, fused)], seed=1)
    for (n, p), q in zip(plain_model.named_parameters(), fused_model.parameters()):
        assert torch.equal(p, q), n
        assert q.grad is None  # freed in backward
    for p, q in zip(plain_model.parameters(), fused_model.parameters()):
        assert torch.equal(plain.state[p]["momentum_buffer"], fused.state[q]["momentum_buffer"])
    assert fused.state_dict()["param_groups"][0]["lr"] == plain.state_dict()["param_groups"][0]["lr"]
    for a, b in zip(plain_model.buffers(), fused_model.buffers()):
        assert torch.equal(a, b)  # BatchNorm statistics move alike


def test_a_resumed_optimizer_follows_the_schedule_it_loaded() -> None:
    plain_model, fused_model = _pair()
    plain = torch.optim.SGD(plain_model.parameters(), **SGD)
    fused = fused_step.fused_sgd(fused_model, **SGD)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for model, opt in ((plain_model, plain), (fused_model, fused)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    fused.load_state_dict(fused.state_dict())  # new group dicts, as a resume makes them
    for opt in (plain, fused):
        torch.optim.lr_scheduler.MultiStepLR(opt, [1], 0.01).step()  # the LR drops to a hundredth
    for model, opt in ((plain_model, plain), (fused_model, fused)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for p, q in zip(plain_model.parameters(), fused_model.parameters()):
        assert torch.equal(p, q)


def _groups(model: nn.Module) -> list[dict]:
    # Two groups, as a recipe without weight decay on biases and BatchNorm makes them.
    decay = [p for p in model.parameters() if p.dim() > 1]
    return [{"params": decay}, {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


@pytest.mark.parametrize("make,resume_from", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05), "plain"),
    # bitsandbytes' state_dict wraps its 8-bit state in a format of its own (for FSDP), which torch's
    # Optimizer.load_state_dict does not read: a fused 8-bit optimizer resumes from its own checkpoint, not from a
    # plain one's. Its uint8 codes must come back as uint8, or bitsandbytes would read them as 32-bit moments.
    (lambda ps: __import__("bitsandbytes").optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.05, min_8bit_size=256), "own"),
], ids=["adamw", "bnb-adamw8bit"])
def test_any_per_parameter_optimizer_fused_equals_its_plain_step_after_a_resume(make, resume_from: str) -> None:
    plain_model, fused_model = _pair()
    plain = make(_groups(plain_model))
    fused = fused_step.FusedOptimizer(_groups(fused_model), make)

    def resume(i: int) -> None:
        if i == 3:  # from the plain optimizer's checkpoint, its state_dict is the same, groups and all
            # A copy, as torch.save makes: load_state_dict keeps the "step" tensors it is given, not copies of them.
            fused.load_state_dict(copy.deepcopy((plain if resume_from == "plain" else fused).state_dict()))

    _train_side_by_side([(plain_model, plain), (fused_model, fused)], seed=2, after_step=resume)
    for (n, p), q in zip(plain_model.named_parameters(), fused_model.parameters()):
        assert torch.equal(p, q), n
        assert q.grad is None
    a, b = plain.state_dict(), fused.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k, (pa, pb) in enumerate(zip(plain_model.parameters(), fused_model.parameters())):
        assert plain.state[pa].keys() == fused.state[pb].keys()
        for name, v in plain.state[pa].items():
            w = fused.state[pb][name]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, name)


def test_at_most_one_layers_gradient_is_alive_where_the_plain_step_holds_them_all() -> None:
    # A chain of bias-free linear layers: each weight's gradient is freed by its own step before the next exists.
    sizes = [64, 256, 128, 512, 32]

    def model() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in zip(sizes, sizes[1:])])

    batch = (torch.empty(16, sizes[0], device="meta"), torch.empty(16, dtype=torch.long, device="meta"))
    weights = [4 * i * o for i, o in zip(sizes, sizes[1:])]
    m = model()
    plain = profile_step(m, torch.optim.SGD(m.parameters(), **SGD), batch, F.cross_entropy)
    m = model()
    fused = profile_step(m, fused_step.fused_sgd(m, **SGD), batch, F.cross_entropy)
    assert plain.category_max["gradients"] == sum(weights)
    assert fused.category_max["gradients"] == max(weights)
    assert fused.category_max["optimizer"] == plain.category_max["optimizer"] == sum(weights)  # momentum


def test_a_parameter_unfrozen_after_the_optimizer_was_built_is_not_left_unupdated() -> None:
    m = nn.Linear(4, 2)
    m.bias.requires_grad_(False)
    opt = fused_step.FusedOptimizer(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    m.bias.requires_grad_(True)
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="frozen when the fused optimizer was built"):
        opt.step()


def test_refuses_microbatching_and_loss_scaling_before_any_compute() -> None:
    with pytest.raises(ValueError, match="microbatch=8"):
        fused_step.check(8, "fp32")
    with pytest.raises(ValueError, match="half-bf16"):
        fused_step.check(0, "half-bf16")
    fused_step.check(0, "fp32")


def test_accounted_on_meta_equals_the_cpu_allocators_peak() -> None:
    from lowmem.memory.accounting import account_step, standard_step
    from lowmem.memory.measure import CPUWorkspace, measure_step

    def run(device: str) -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(0)
        with torch.device(device):
            m = build_model("wrn-10-1", num_classes=10, in_channels=3)
            batch = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
        return m, fused_step.fused_sgd(m, **SGD), batch

    m, opt, batch = run("cpu")
    measured, _ = measure_step(standard_step(m, opt, batch, F.cross_entropy), m, opt, batch)
    m, opt, batch = run("meta")
    accounted = account_step(standard_step(m, opt, batch, F.cross_entropy), m, opt, batch, workspace=CPUWorkspace())
    assert abs(accounted.peak - measured) <= 0.01 * measured, (accounted.peak, measured)
