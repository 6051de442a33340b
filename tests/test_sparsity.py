"""Sparsity: compressed layers compute exactly what the dense-masked layers do, DSR keeps its invariants over many
rewirings, and CSR bytes are counted from first principles."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_train import results, tiny
from torch import nn

from lowmem.memory.accounting import account_step
from lowmem.techniques import precision, sparsity
from lowmem.wrn.models import build_model
from lowmem.wrn.train import Techniques, train, train_step


def _pair(level: float, method: str = "dsr") -> tuple[nn.Module, nn.Module, dict[str, sparsity.SparseConv2d]]:
    """A sparse WRN-10-1 and the same network dense, its weights masked to the sparse pattern."""
    torch.manual_seed(0)
    sparse = build_model("wrn-10-1")
    dense = build_model("wrn-10-1")
    dense.load_state_dict(sparse.state_dict())
    layers = sparsity.sparsify(sparse, level, method, seed=3)
    for name, layer in layers.items():
        dense.get_submodule(name).weight.data = layer.dense_weight().clone()
    return sparse, dense, layers


def _momentum(opt: torch.optim.Optimizer, layer: sparsity.SparseConv2d) -> torch.Tensor:
    return opt.state[layer.values]["momentum_buffer"]


def _scatter(layer: sparsity.SparseConv2d, values: torch.Tensor) -> torch.Tensor:
    return torch.zeros(layer.shape.numel()).index_add_(0, layer.indices, values)


def test_compressed_forward_and_backward_equal_the_dense_masked_computation() -> None:
    sparse, dense, layers = _pair(0.8)
    x, y = torch.randn(4, 3, 32, 32, requires_grad=True), torch.randint(0, 10, (4,))
    xd = x.detach().clone().requires_grad_()
    out_s, out_d = sparse(x), dense(xd)
    assert torch.equal(out_s, out_d)
    F.cross_entropy(out_s, y).backward()
    F.cross_entropy(out_d, y).backward()
    assert torch.equal(x.grad, xd.grad)
    for name, layer in layers.items():
        dense_grad = dense.get_submodule(name).weight.grad.reshape(-1)
        assert torch.equal(layer.values.grad, dense_grad[layer.indices.long()])
    sparse_params = {f"{n}.values" for n in layers}
    dense_rest = {n: p for n, p in dense.named_parameters() if not any(n == f"{m}.weight" for m in layers)}
    for n, p in sparse.named_parameters():
        if n not in sparse_params:
            assert torch.equal(p.grad, dense_rest[n].grad), n


def test_sparsify_keeps_the_dense_layers_dense_and_the_level_exact() -> None:
    torch.manual_seed(0)
    model = build_model("wrn-28-2")
    total = sparsity.sparse_weight_count(model)
    layers = sparsity.sparsify(model, 0.9, "static")
    assert len(layers) == 24  # two 3x3 convs in each of WRN-28-2's 12 blocks; stem, shortcuts and fc stay dense
    for layer in layers.values():
        assert layer.nnz == round(0.1 * layer.shape.numel())
    assert sum(layer.nnz for layer in layers.values()) == pytest.approx(0.1 * total, abs=len(layers))
    assert isinstance(model.conv1, nn.Conv2d) and isinstance(model.blocks[4].shortcut, nn.Conv2d)


def _train_with_dsr(steps: int, period: int, wd: float = 5e-4):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = build_model("wrn-10-1")
    layers = sparsity.sparsify(model, 0.8, "dsr", seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=wd, nesterov=True)
    dsr = sparsity.DSR(layers, steps, reallocate=300, periods=(period,), phases=(0.0,), stop=2.0, seed=0)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    return model, layers, opt, dsr, x, y


def test_dsr_holds_the_sparsity_level_and_a_consistent_pattern_over_many_rewirings() -> None:
    model, layers, opt, dsr, x, y = _train_with_dsr(80, 2)
    nnz = sum(layer.nnz for layer in layers.values())
    total = sum(layer.shape.numel() for layer in layers.values())
    moved = set()
    for _ in range(80):
        train_step(model, opt, x, y)
        before = {n: layer.nnz for n, layer in layers.items()}
        if dsr.after_step(opt):
            moved |= {n for n, layer in layers.items() if layer.nnz != before[n]}
            assert sum(layer.nnz for layer in layers.values()) == nnz  # the global level, exactly
            for layer in layers.values():
                idx = layer.indices.long()
                assert layer.indices.dtype == torch.int32
                assert torch.all(idx[1:] > idx[:-1]) and 0 <= int(idx[0]) and int(idx[-1]) < layer.shape.numel()
                assert layer.values.shape == idx.shape == _momentum(opt, layer).shape
    assert dsr.rewirings == 40
    assert 1 - nnz / total == pytest.approx(0.8, abs=1e-3)
    assert moved  # DSR moved weights between layers; the total did not change
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_static_pattern_holds_every_layers_level_and_positions() -> None:
    torch.manual_seed(0)
    model = build_model("wrn-10-1")
    layers = sparsity.sparsify(model, 0.9, "static")
    start = {n: layer.indices.clone() for n, layer in layers.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for _ in range(30):
        train_step(model, opt, x, y)
    for n, layer in layers.items():
        assert torch.equal(layer.indices, start[n])
        w = layer.dense_weight().reshape(-1)
        off = torch.ones_like(w, dtype=torch.bool)
        off[layer.indices.long()] = False
        assert torch.count_nonzero(w[off]) == 0  # momentum and weight decay revived nothing


def test_pruned_weights_stay_exactly_zero_through_momentum_and_weight_decay() -> None:
    model, layers, opt, dsr, x, y = _train_with_dsr(100, 1)
    for _ in range(5):
        train_step(model, opt, x, y)
    before = {n: set(layer.indices.tolist()) for n, layer in layers.items()}
    dsr.rewire(opt)
    pruned = {n: torch.tensor(sorted(before[n] - set(layer.indices.tolist())), dtype=torch.long) for n, layer in layers.items()}
    assert sum(len(v) for v in pruned.values()) > 0
    for _ in range(20):  # momentum and weight decay at work, no rewiring
        train_step(model, opt, x, y)
    for n, layer in layers.items():
        if len(pruned[n]):
            assert torch.count_nonzero(layer.dense_weight().reshape(-1)[pruned[n]]) == 0


def test_regrown_weights_start_at_zero_with_zero_momentum_and_survivors_keep_theirs() -> None:
    model, layers, opt, dsr, x, y = _train_with_dsr(100, 1)
    for _ in range(5):
        train_step(model, opt, x, y)
    old = {n: (set(layer.indices.tolist()), _scatter(layer, layer.values.detach()), _scatter(layer, _momentum(opt, layer)))
           for n, layer in layers.items()}
    dsr.rewire(opt)
    grown_total = 0
    for n, layer in layers.items():
        positions, values, momentum = old[n]
        idx = layer.indices.long()
        new_w, new_m = _scatter(layer, layer.values.detach()), _scatter(layer, _momentum(opt, layer))
        grown = torch.tensor([i for i in idx.tolist() if i not in positions], dtype=torch.long)
        kept = torch.tensor([i for i in idx.tolist() if i in positions], dtype=torch.long)
        grown_total += len(grown)
        if len(grown):
            assert torch.count_nonzero(new_w[grown]) == 0 and torch.count_nonzero(new_m[grown]) == 0
        assert torch.equal(new_w[kept], values[kept]) and torch.equal(new_m[kept], momentum[kept])
    assert grown_total == dsr.pruned_last > 0


def test_reallocation_is_apportioned_exactly_within_caps() -> None:
    got = sparsity._apportion(100, torch.tensor([1.0, 2.0, 7.0]), torch.tensor([50.0, 10.0, 1000.0]))
    assert got.sum() == 100 and got[1] == 10 and got[0] >= 9
    assert sparsity._apportion(7, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([9.0, 9.0, 9.0])).tolist() in ([3, 2, 2], [2, 3, 2], [2, 2, 3])


class _OneLayer(nn.Module):
    def __init__(self, conv: nn.Conv2d, keep: torch.Tensor) -> None:
        super().__init__()
        self.conv = sparsity.SparseConv2d(conv, keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).sum((2, 3))


@pytest.mark.parametrize("value_bytes,index_bytes", [(4, 4), (4, 2), (2, 2)])
def test_csr_bytes_equal_a_hand_count(value_bytes: int, index_bytes: int) -> None:
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a 4 x 27 matrix in CSR
    keep = torch.zeros(4 * 3 * 3 * 3, dtype=torch.bool)
    keep[torch.tensor([0, 5, 26, 27, 40, 41, 60, 80, 99, 107])] = True  # nnz = 10
    model = _OneLayer(conv, keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(2, 3, 5, 5), torch.zeros(2, dtype=torch.long)
    fmt = sparsity.CSRFormat(model, index_bytes, value_bytes)
    r = account_step(lambda mark: train_step(model, opt, x, y, Techniques(), mark), model, opt, (x, y), fmt=fmt)
    nnz, rows = 10, 4
    assert r.category_max["model"] == nnz * value_bytes + (nnz + rows + 1) * index_bytes
    assert r.category_max["gradients"] == nnz * value_bytes
    assert r.category_max["optimizer"] == nnz * value_bytes
    assert fmt.index_widths() == {"conv": index_bytes}


def test_16bit_indices_only_where_they_fit() -> None:
    with torch.device("meta"):
        model = build_model("wrn-28-2")
    sparsity.sparsify(model, 0.5, "dsr")
    widths = sparsity.CSRFormat(model, index_bytes=2).index_widths()
    for name, layer in sparsity.sparse_layers(model).items():
        assert widths[name] == (2 if layer.nnz < 2**16 else 4), name  # 128x128x3x3 at 50%: 73,728 nonzeros
    assert set(widths.values()) == {2, 4}


def test_sparse_layers_train_under_autocast_and_in_half() -> None:
    for mode in ("mixed-bf16", "half-bf16"):
        prec = precision.parse(mode)
        sparse, _, layers = _pair(0.8)
        precision.prepare(sparse, prec)
        opt = torch.optim.SGD(sparse.parameters(), lr=0.05, momentum=0.9)
        scaler = precision.make_scaler(prec, "cpu")
        x, y = precision.cast_batch(torch.randn(4, 3, 32, 32), prec), torch.randint(0, 10, (4,))
        before = [layer.values.detach().clone() for layer in layers.values()]
        train_step(sparse, opt, x, y, Techniques(precision=mode), scaler=scaler)
        for layer, b in zip(layers.values(), before):
            assert layer.values.grad.dtype == layer.values.dtype == (torch.bfloat16 if mode == "half-bf16" else torch.float32)
            assert not torch.equal(layer.values.detach(), b)


def test_a_dsr_run_resumes_to_the_same_final_metrics(tmp_path: Path) -> None:
    p = tiny(tmp_path, epochs=2)
    tech = Techniques(sparsity=0.8, dsr_periods=(2, 2, 2, 2), dsr_reallocate=200_000)
    whole = train(p, 0, tech, progress=False, root=tmp_path / "whole")

    def interrupt(epoch: int, _: dict) -> None:
        if epoch == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(p, 0, tech, progress=False, on_epoch_end=interrupt, root=tmp_path / "cut")
    resumed = train(p, 0, tech, progress=False, root=tmp_path / "cut")
    assert whole[-1]["rewirings"] > 0
    assert results(resumed) == results(whole)


def test_the_recipes_reference_count_is_wrn_28_2s_sparse_layer_weights() -> None:
    """The techniques layer writes WRN-28-2's sparse-layer weights from its shapes (it builds no model)."""
    with torch.device("meta"):
        assert sparsity.RECIPE_SPARSE_WEIGHTS == sparsity.sparse_weight_count(build_model("wrn-28-2"))


def test_sparse_methods_are_a_registry_and_an_unknown_name_lists_them() -> None:
    with pytest.raises(ValueError, match="dsr, static"):
        sparsity.sparsify(build_model("wrn-10-1"), 0.5, "rigl")
    w = torch.tensor([[0.1, -3.0], [2.0, 0.5]])
    keep = sparsity.keep_mask(w, 2, "static", torch.Generator().manual_seed(0))
    assert keep.tolist() == [False, True, True, False]  # the two largest magnitudes
