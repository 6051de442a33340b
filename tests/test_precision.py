"""Low precision: every tensor counted at its real width, overflows skipped, and fp32 untouched."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowmem.memory.accounting import account_step
from lowmem.techniques import precision
from lowmem.wrn.models import build_model
from lowmem.wrn.recipe import make_optimizer
from lowmem.wrn.train import Techniques, train_step

N, D, H, C = 6, 8, 16, 4  # batch, input, hidden, classes of the small MLP


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))


@pytest.mark.parametrize("mode", precision.MODES)
def test_bytes_per_category_equal_a_hand_count(mode: str) -> None:
    prec = precision.parse(mode)
    ctx, device = precision.shapes_only(prec)
    with ctx:
        with torch.device(device):
            model = precision.prepare(_mlp(), prec)
            x, y = precision.cast_batch(torch.randn(N, D), prec), torch.zeros(N, dtype=torch.long)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = precision.make_scaler(prec, device.type, sync=False)
        r = account_step(lambda mark: train_step(model, opt, x, y, Techniques(precision=mode), mark, scaler), model, opt, (x, y))

    params = D * H + H + H * C + C
    w = 2 if prec.kind != "fp32" else 4  # bytes of the 16-bit format, or fp32's
    stored = 2 if prec.kind == "half" else 4  # weights, gradients and momentum: 16-bit only in half mode
    # mixed: the fp32 master weights plus autocast's 16-bit copy of each (weights and biases alike).
    assert r.category_max["model"] == params * stored + (params * 2 if prec.kind == "mixed" else 0)
    assert r.category_max["gradients"] == params * stored
    assert r.category_max["optimizer"] == params * stored
    # Saved for backward: the ReLU output (which the second Linear saves too; one storage), in the compute width;
    # under autocast also the 16-bit cast of the batch, which the first Linear saves; the loss's log-softmax, fp32
    # since the loss is computed in fp32; and nll_loss's 4-byte total weight. (The batch itself is "other".)
    activations = N * H * w + (N * D * 2 if prec.kind == "mixed" else 0) + N * C * 4 + 4
    assert r.category_max["activations"] == activations


def test_shapes_only_accounting_equals_meta_in_fp32() -> None:
    reports = []
    for ctx, device in (precision.shapes_only(precision.parse("fp32")), (precision.FakeTensorMode(), torch.device("cpu"))):
        with ctx:
            with torch.device(device):
                model = build_model("wrn-10-1", 10, 3)
                x, y = torch.randn(4, 3, 32, 32), torch.zeros(4, dtype=torch.long)
            opt = make_optimizer(model)
            reports.append(account_step(lambda mark: train_step(model, opt, x, y, Techniques(), mark), model, opt, (x, y)))
    assert reports[0].peak == reports[1].peak
    assert reports[0].category_max == reports[1].category_max


def test_fp32_path_is_bit_identical_to_the_plain_step() -> None:
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model("wrn-10-1", 10, 3))
    opts = [make_optimizer(m) for m in models]
    for step in range(4):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        train_step(models[0], opts[0], x, y, Techniques(precision="fp32"))
        # The baseline recipe's step, written out.
        opts[1].zero_grad(set_to_none=True)
        F.cross_entropy(models[1](x), y).backward()
        opts[1].step()
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        assert torch.equal(a, b)


def _setup(mode: str) -> tuple[nn.Module, torch.optim.Optimizer, precision.Scaler]:
    torch.manual_seed(0)
    prec = precision.parse(mode)
    model = precision.prepare(_mlp(), prec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scaler = precision.make_scaler(prec, "cpu")
    assert scaler is not None
    return model, opt, scaler


def _batch(mode: str, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(N, D) * scale
    return precision.cast_batch(x, precision.parse(mode)), torch.randint(0, C, (N,))


@pytest.mark.parametrize("mode", ["mixed-fp16", "mixed-bf16", "half-fp16", "half-bf16"])
def test_an_overflowing_step_is_skipped_and_the_scale_backs_off(mode: str) -> None:
    model, opt, scaler = _setup(mode)
    for _ in range(3):
        train_step(model, opt, *_batch(mode), Techniques(precision=mode), scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.scale_value
    # An input at the top of fp16's range overflows the forward pass; with bf16, an infinite input does.
    huge = 6e4 if precision.parse(mode).dtype == torch.float16 else float("inf")
    loss = train_step(model, opt, *_batch(mode, huge), Techniques(precision=mode), scaler=scaler)
    assert not torch.isfinite(loss)
    assert scaler.skipped == 1
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)  # the non-finite loss never reached the weights (nor the momentum into them)
    # fp16 backs off the scale; bf16 needs no scaling and keeps it at 1.
    assert scaler.scale_value == (scale / 2 if precision.parse(mode).dtype == torch.float16 else 1.0)
    train_step(model, opt, *_batch(mode), Techniques(precision=mode), scaler=scaler)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))  # and training goes on


@pytest.mark.parametrize("mode", ["half-fp16", "half-bf16", "mixed-fp16"])
def test_a_run_whose_loss_scale_collapses_stops_with_a_clear_error(mode: str) -> None:
    model, opt, scaler = _setup(mode)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(precision.LossScaleCollapse, match="diverged"):
        for _ in range(40):
            train_step(model, opt, *_batch(mode, float("inf")), Techniques(precision=mode), scaler=scaler)
    assert 20 < scaler.skipped <= 32
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", ["half-fp16", "half-bf16", "mixed-bf16"])
def test_16bit_training_of_a_small_problem_reaches_fp32s_loss(mode: str) -> None:
    def final_loss(m: str) -> float:
        torch.manual_seed(1)
        centers = torch.randn(C, D) * 2
        y = torch.randint(0, C, (512,))
        x = centers[y] + torch.randn(512, D)
        model, opt, scaler = _setup(m) if m != "fp32" else (_mlp(), None, None)
        if opt is None:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        prec = precision.parse(m)
        for epoch in range(10):
            for i in range(0, 512, 32):
                train_step(model, opt, precision.cast_batch(x[i : i + 32], prec), y[i : i + 32], Techniques(precision=m), scaler=scaler)
        with torch.no_grad():
            return F.cross_entropy(model(precision.cast_batch(x, prec)).float(), y).item()

    fp32, low = final_loss("fp32"), final_loss(mode)
    assert fp32 < 0.5  # the problem is learnt
    assert low == pytest.approx(fp32, abs=0.05)


def test_mixed_precision_refuses_the_meta_device_with_a_way_out() -> None:
    with pytest.raises(ValueError, match="FakeTensorMode"):
        precision.autocast(precision.parse("mixed-bf16"), "meta")


def test_a_16bit_step_without_its_scaler_is_refused() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="needs a loss scaler"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(N, D), torch.zeros(N, dtype=torch.long), Techniques(precision="mixed-bf16"))


def test_unknown_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match="mixed-bf16"):
        Techniques(precision="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bad", [False, True])
def test_on_cuda_bf16_gradients_are_checked_and_unscaled_as_the_cpu_kernel_does(bad: bool) -> None:
    # PyTorch's CUDA check-and-unscale kernel has no bf16: the scaler's own path must agree with the CPU kernel.
    grads = [torch.randn(n, dtype=torch.bfloat16) for n in (7, 300)]
    if bad:
        grads[1][5] = float("nan")
    results = []
    for device in ("cpu", "cuda"):
        ps = [torch.zeros_like(g, device=device, requires_grad=True) for g in grads]
        for p, g in zip(ps, grads):
            p.grad = g.to(device) * 4
        scaler = precision.LossScaler(init_scale=4.0)
        stepped = scaler.step(torch.optim.SGD(ps, lr=1.0))
        results.append((stepped, scaler.skipped, [p.grad.cpu() for p in ps]))
    (cpu_stepped, cpu_skipped, cpu_grads), (gpu_stepped, gpu_skipped, gpu_grads) = results
    assert (cpu_stepped, cpu_skipped) == (gpu_stepped, gpu_skipped) == (not bad, int(bad))
    for a, b in zip(cpu_grads, gpu_grads):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
