"""Compressed activations (lowmem.techniques.compress): packed bytes from first principles, the accountant counting
the packed bytes and not the tensors they came from, the error bound, an unchanged forward pass, and checkpointing."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lowmem.memory.accounting import account_step
from lowmem.techniques import compress
from lowmem.techniques.step import Techniques
from lowmem.wrn.train import run_techniques

B, D, H, C = 32, 64, 512, 10


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_packed_bytes_from_first_principles(bits):
    n = 1000  # four groups of 256, the last one padded
    expected = 2 * n if bits == 16 else 4 * 256 * bits // 8 + 4 * 2 * 4
    assert compress.packed_bytes(n, bits) == expected
    p = compress.pack(torch.randn(n), bits)
    assert sum(t.untyped_storage().nbytes() for t in p.tensors()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_unpacked_within_the_error_bound(bits, dtype):
    g = torch.Generator().manual_seed(0)
    # Rows of one group each; values over five decades; 1000 elements, so the last group is padded.
    t = (torch.randn(1000, generator=g) * torch.logspace(-3, 2, 1000)).to(dtype).view(10, 100)
    t[:3] = 0.0  # a whole constant group (ReLU zeros, elements 0-255) has no range and must come back exact
    back = compress.unpack(compress.pack(t, bits))
    assert back.dtype == dtype and back.shape == t.shape
    assert ((back.float() - t.float()).abs() <= compress.error_bound(t, bits)).all()
    assert (back[:2] == 0).all()
    if bits < 16:  # the bound is tight: a coarser code would break it
        coarse = compress.unpack(compress.pack(t, bits // 2)) if bits > 2 else None
        if coarse is not None:
            assert ((coarse.float() - t.float()).abs() > compress.error_bound(t, bits)).any()


def _mlp(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        m = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))
        x, y = torch.randn(B, D), torch.randint(0, C, (B,))
    return m, x, y


def _activations(bits, device="cpu"):
    m, x, y = _mlp(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(mark):
        opt.zero_grad(set_to_none=True)
        mark("forward")
        with compress.compressing(bits):
            out = m(x)
        loss = F.cross_entropy(out, y)
        mark("backward")
        loss.backward()
        mark("optimizer")
        opt.step()

    return account_step(step, m, opt, (x, y)).category_max["activations"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_accountant_counts_the_packed_bytes_not_the_unpacked(bits, device):
    # The ReLU's output (B x H fp32) is saved by the ReLU and by the second Linear; the rest (the batch, the
    # weights, the loss's few bytes) is the same with and without the lever. So the lever's saving is exactly the
    # fp32 tensor less its packed form, counted once.
    plain = _activations(0, device)
    assert plain - _activations(bits, device) == B * H * 4 - compress.packed_bytes(B * H, bits)


@pytest.mark.parametrize("autocast", [False, True])
def test_only_activations_are_packed(monkeypatch, autocast):
    packed = []
    real = compress.pack
    monkeypatch.setattr(compress, "pack", lambda t, bits, group=compress.GROUP: packed.append(tuple(t.shape)) or real(t, bits, group))
    m, x, y = _mlp()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), compress.compressing(8):
        out = m(x)
    F.cross_entropy(out.float(), y).backward()
    # Not the batch, not a weight, its transpose or autocast's bf16 copy of it; the ReLU output once.
    assert packed == [(B, H)]


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_weight_gradient_error_within_the_quantization_bound(bits):
    m, x, y = _mlp()
    h = m[1](m[0](x)).detach()
    grads = []
    for b in (0, bits):
        m.zero_grad()
        with compress.compressing(b):
            out = m(x)
        F.cross_entropy(out, y).backward()
        grads.append(m[2].weight.grad.clone())
    # grad W = g^T h, where h is what was saved: the error is g^T (h' - h), at most |g|^T bound(h) per element.
    out = m(x)
    g = torch.autograd.grad(F.cross_entropy(out, y), out)[0]
    bound = g.abs().T @ compress.error_bound(h, bits)
    err = (grads[1] - grads[0]).abs()
    assert (err <= bound * (1 + 1e-4) + 1e-7).all()
    assert err.max() > 0  # the lever really is lossy: the test would pass trivially if nothing were packed


def test_forward_and_batchnorm_statistics_unchanged():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 16, 16)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    out_plain = net(x)
    stats_plain = (net[1].running_mean.clone(), net[1].running_var.clone())
    net.load_state_dict(state)
    with compress.compressing(2):
        out_packed = net(x)
    assert torch.equal(out_plain, out_packed)
    assert torch.equal(stats_plain[0], net[1].running_mean) and torch.equal(stats_plain[1], net[1].running_var)


def test_composes_with_checkpointing():
    # Each checkpointed segment is one Linear: the segment input that checkpoint keeps is packed, and the recomputed
    # Linear saves exactly that dequantized input, so the weight gradients equal those of the lever alone, bitwise.
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(H, H) for _ in range(3))
    x = torch.randn(B, H)

    def run(ckpt):
        for layer in layers:
            layer.zero_grad()
        with compress.compressing(4):
            h = layers[0](x)  # a non-leaf: the first segment's input is an activation
            for layer in layers[1:]:
                h = checkpoint(layer, h, use_reentrant=False) if ckpt else layer(h)
        h.square().mean().backward()
        return [layer.weight.grad.clone() for layer in layers[1:]]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_checkpoint_inputs_are_counted_packed():
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(H, H) for _ in range(4)))
    x = torch.randn(B, H)
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)

    def activations(bits):
        def step(mark):
            opt.zero_grad(set_to_none=True)
            mark("forward")
            with compress.compressing(bits):
                h = layers[0](x)
                for layer in layers[1:]:
                    h = checkpoint(layer, h, use_reentrant=False)
            mark("backward")
            h.sum().backward()
        r = account_step(step, layers, opt, (x,))
        return r.timeline[[p for p, _ in r.timeline].index("backward")][1]["activations"]

    # At the start of backward, what is kept are the three segments' inputs: packed, three B x H tensors.
    assert activations(0) - activations(8) == 3 * (B * H * 4 - compress.packed_bytes(B * H, 8))


@pytest.mark.parametrize("bits", [1, 3, 32, True, "8"])
def test_bad_bit_width_refused_with_the_allowed_values(bits):
    with pytest.raises(ValueError, match=r"activation_bits=.*0 \(off\) or one of 2, 4, 8, 16"):
        Techniques(activation_bits=bits)


def test_run_key_unchanged_when_off_and_changed_when_on():
    assert "activation_bits" not in run_techniques(Techniques(), 32)
    assert run_techniques(Techniques(activation_bits=4), 32)["activation_bits"] == 4
    # Checkpointing is exact only against the plain step (its run is the plain run's); with packed activations,
    # a segment's recomputed internals are exact where the plain step's are packed: another run.
    assert run_techniques(Techniques(checkpoint="block"), 32) == run_techniques(Techniques(), 32)
    assert run_techniques(Techniques(checkpoint="block", activation_bits=4), 32) != run_techniques(Techniques(activation_bits=4), 32)
