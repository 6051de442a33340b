"""The four techniques on DynamicConv through lowmem's fairseq plugin: fairseq-train runs each option, update-freq and
checkpointing leave the gradients as they are, DSR keeps its sparsity over many updates, and the accountant
reflects each option at full size, byte for byte."""

import copy
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from lowmem.config import ParamError
from lowmem.dynamicconv import memory as translation_memory
from lowmem.dynamicconv import commands, translation
from lowmem.dynamicconv.params import TranslationDataParams, TranslationTechniquesParams
from lowmem.dynamicconv.plugin import ARCH, TASK
from lowmem.dynamicconv.translation import PLUGIN_DIR
from lowmem.memory.accounting import CATEGORIES
from lowmem.studies import translation as translation_study
from lowmem.techniques import optimizers, sparse_linear

sys.path.insert(0, str(Path(__file__).parent))
from test_translation import TINY_MODEL  # noqa: E402

PLUGIN = ["--user-dir", str(PLUGIN_DIR), "--task", TASK]
TINY = [*TINY_MODEL[2:], "--arch", ARCH, "--optimizer", "adam", "--lr", "0.001", "--criterion", "label_smoothed_cross_entropy"]
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--weight-dropout", "0"]
FULL = ["--arch", "lightconv_iwslt_de_en", "--encoder-glu", "0", "--decoder-glu", "0"]
# FFN maps of 64 x 128 = 8192 weights: past bitsandbytes' 4096 elements, so their optimizer state is 8-bit.
WIDER = ["--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke corpus, binarized (sentences of several lengths, so batches are padded)."""
    d = tmp_path_factory.mktemp("techniques")
    p = TranslationDataParams(corpus="synthetic", synthetic_pairs=400, test_size=20, bpe_merges=50)
    translation.prepare(p, d)
    translation.binarize(p, d)
    return d


def trainer(data: Path, extra: list[str]):  # type: ignore[no-untyped-def]
    """fairseq's own Trainer for the tiny model with the plugin and ``extra`` options, built as fairseq-train
    builds it (seed 0). No loader workers: fairseq's default of one worker process per iterator is shut down when
    the iterator is collected, which waits seconds per iterator in whichever test runs next."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    args = options.parse_args_and_arch(options.get_training_parser(), [str(data / "bin"), *PLUGIN, *TINY, "--cpu", "--num-workers", "0", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    return Trainer(cfg, task, model, task.build_criterion(cfg.criterion)), task


def batch(task, indices: list[int]) -> dict:  # type: ignore[no-untyped-def]
    ds = task.dataset("train")
    return ds.collater([ds[i] for i in indices])


@pytest.mark.slow
# Each option runs in at least one combination (a fairseq-train process costs seconds to start): DSR in the 16-bit
# rows, --update-freq in the last two.
@pytest.mark.parametrize("options", [
    ["--checkpoint-activations", "--sparsity", "0.8", "--sparse-method", "static"],
    # A low initial loss scale: fairseq 0.12's Trainer calls .cuda() on an fp16 overflow, which fails on CPU.
    ["--memory-efficient-fp16", "--fp16-init-scale", "4", "--sparsity", "0.8", "--dsr-periods", "[2,2,2,2]"],
    # (mixed-bf16 trains through fairseq's Trainer in the gradient test below)
    ["--precision", "half-bf16", "--optimizer", "lowmem_adamw", "--sparsity", "0.8", "--dsr-periods", "[2,2,2,2]"],
    ["--activation-bits", "4", "--checkpoint-activations", "--update-freq", "2", "--max-tokens", "500"],
    ["--precision", "half-bf16", "--optimizer", "lowmem_adamw_kahan", "--checkpoint-activations", "--update-freq", "2", "--max-tokens", "500"],
], ids=["checkpoint+static", "memory-efficient-fp16+dsr", "half-bf16+adamw+dsr", "activations-4+checkpoint+update-freq",
        "all-bf16-kahan+checkpoint+update-freq"])
def test_fairseq_train_runs_a_few_updates_with_each_option(data: Path, options: list[str], tmp_path: Path) -> None:
    args = [str(data / "bin"), *PLUGIN, *TINY, "--max-tokens", "1000", "--max-update", "6", "--cpu", "--save-dir", str(tmp_path),
            "--required-batch-size-multiple", "1", "--num-workers", "0", "--log-format", "json", "--log-interval", "3",
            "--no-epoch-checkpoints", *options]
    r = commands.captured("train", args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    records = translation.parse_log((r.stdout + r.stderr).splitlines())
    assert [int(x["num_updates"]) for x in records if x["kind"] == "train_inner"] == [3, 6]
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
    assert state["cfg"]["model"].arch == ARCH
    if "--activation-bits" in options:  # the option reached the model, not only the parser
        assert state["cfg"]["model"].activation_bits == int(options[options.index("--activation-bits") + 1])
    if "lowmem_adamw_kahan" in options:
        # optimi's state with a compensation tensor, which it keeps only for 16-bit weights (None in fp32; fairseq
        # saves 16-bit tensors as fp32, and loading casts them back to the parameters' dtype)
        saved = state["last_optimizer_state"]["state"]
        assert saved and all(isinstance(st["kahan_comp"], torch.Tensor) for st in saved.values())


def test_fp16_with_dsr_is_refused_with_what_to_do(data: Path) -> None:
    with pytest.raises(ValueError, match="use --memory-efficient-fp16"):
        trainer(data, ["--fp16", "--sparsity", "0.9"])


@pytest.mark.slow
def test_update_freq_gives_the_gradients_of_one_large_batch(data: Path) -> None:
    """fairseq-train's --update-freq k hands k batches to Trainer.train_step; LayerNorm has no batch statistics,
    so with dropout off the gradients equal those of one batch holding all of them."""
    one, task = trainer(data, [*NO_DROPOUT, "--max-tokens", "4000"])
    two, _ = trainer(data, [*NO_DROPOUT, "--max-tokens", "2000", "--update-freq", "2"])
    idx = list(range(24))
    one.train_step([batch(task, idx)])
    two.train_step([batch(task, idx[:9]), batch(task, idx[9:])])  # unequal halves, padded differently
    pairs = list(zip(one.model.named_parameters(), two.model.named_parameters()))
    assert sum(p.grad is not None for (_, p), _ in pairs) > 10
    for (name, a), (_, b) in pairs:
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--precision", "mixed-bf16"], ["--precision", "half-bf16", "--optimizer", "lowmem_adamw", "--sparsity", "0.9"],
                                     ["--optimizer", "lowmem_adamw8bit", *WIDER], ["--precision", "half-bf16", "--optimizer", "lowmem_adamw_kahan"]],
                         ids=["fp32", "mixed-bf16", "all-bf16+sparse", "adamw-8bit", "all-bf16-kahan"])
def test_checkpointed_layers_give_identical_loss_and_gradients_with_dropout_on(data: Path, options: list[str]) -> None:
    """What makes DynamicConv's checkpointing exact in the combination study (quality_model.EXACT_DYNAMICCONV): the
    same loss and gradients, and so the same parameters after the optimizer's step."""
    plain, task = trainer(data, ["--dropout", "0.3", *options])
    ckpt, _ = trainer(data, ["--dropout", "0.3", "--checkpoint-activations", *options])
    grads: list[dict[str, torch.Tensor]] = []
    for t in (plain, ckpt):  # the gradients as the step receives them: optimi's Kahan step uses .grad as scratch
        def step(*args, _t=t, _step=t.optimizer.step, **kwargs):  # type: ignore[no-untyped-def]
            grads.append({n: p.grad.clone() for n, p in _t.model.named_parameters() if p.grad is not None})
            return _step(*args, **kwargs)
        t.optimizer.step = step
    sample = batch(task, list(range(16)))
    torch.manual_seed(1)
    out_a = plain.train_step([sample])
    torch.manual_seed(1)
    out_b = ckpt.train_step([sample])  # the recompute must draw the same dropout masks
    assert out_a["loss"] == out_b["loss"]
    assert len(grads) == 2 and grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    for (name, a), (_, b) in zip(plain.model.named_parameters(), ckpt.model.named_parameters()):
        if name in grads[0]:
            assert torch.equal(a, b), name
    if "lowmem_adamw8bit" in options:  # the step that was compared is the 8-bit one
        assert any(s["state1"].dtype == torch.uint8 for s in ckpt.optimizer.optimizer.state.values())
    if "lowmem_adamw_kahan" in options:  # and the compensated one
        assert all(s["kahan_comp"].dtype == torch.bfloat16 for s in ckpt.optimizer.optimizer.state.values())


@pytest.mark.slow
def test_mixed_bf16_checkpointed_layers_recompute_in_bf16_and_give_identical_gradients(data: Path) -> None:
    """fairseq's checkpoint recomputes a layer in the backward pass, outside the model's autocast; the plugin's
    layers carry their own, so the recomputation is the same bf16 computation, bit for bit."""
    plain, task = trainer(data, ["--dropout", "0.3", "--precision", "mixed-bf16"])
    ckpt, _ = trainer(data, ["--dropout", "0.3", "--precision", "mixed-bf16", "--checkpoint-activations"])
    fp32, _ = trainer(data, ["--dropout", "0.3"])
    sample = batch(task, list(range(16)))
    outs = []
    for t in (plain, ckpt, fp32):
        torch.manual_seed(1)
        outs.append(t.train_step([sample])["loss"])
    assert outs[0] == outs[1] and outs[0] != outs[2]  # bf16 is not fp32: autocast acted
    for (name, a), (_, b) in zip(plain.model.named_parameters(), ckpt.model.named_parameters()):
        assert a.dtype == torch.float32  # master weights stay fp32
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name


@pytest.mark.slow
def test_lowmem_adamw_takes_fairseqs_adam_step_in_fp32(data: Path) -> None:
    """The same update as fairseq's Adam except where eps enters (fairseq adds it before dividing by the second
    moment's bias correction, torch after; at the default 1e-8 that moves rarely used embedding rows by about 1% of
    a step): with a negligible eps, a few steps on the same batches agree to rounding."""
    ref, task = trainer(data, [*NO_DROPOUT, "--weight-decay", "0.0001", "--adam-eps", "1e-12"])
    ours, _ = trainer(data, [*NO_DROPOUT, "--weight-decay", "0.0001", "--adam-eps", "1e-12", "--optimizer", "lowmem_adamw"])
    for i in range(3):
        s = batch(task, list(range(8 * i, 8 * i + 8)))
        ref.train_step([s])
        ours.train_step([s])
    moved = 0
    for (name, a), (_, b) in zip(ref.model.named_parameters(), ours.model.named_parameters()):
        # The unused conv_bias is never initialized, so its garbage differs between models. A key projection's bias
        # adds the same to every score of a softmax, so its gradient is rounding noise, which Adam scales to steps.
        if a.grad is not None and not name.endswith("k_proj.bias"):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)  # 1% of a step (lr 1e-3)
    for a, b0 in zip(ref.model.parameters(), trainer(data, NO_DROPOUT)[0].model.parameters()):
        moved += not torch.equal(a, b0)
    assert moved > 10  # the steps moved the weights, so agreeing is not agreeing on nothing
    assert isinstance(ours.optimizer.optimizer, torch.optim.AdamW)


@pytest.mark.slow
def test_all_bf16_keeps_weights_gradients_and_adam_state_in_bf16_over_updates(data: Path) -> None:
    t, task = trainer(data, [*NO_DROPOUT, "--precision", "half-bf16", "--optimizer", "lowmem_adamw"])
    start = [p.detach().clone() for p in t.model.parameters()]
    losses = [t.train_step([batch(task, list(range(8 * i, 8 * i + 8)))])["loss"] for i in range(4)]
    assert all(math.isfinite(x) for x in losses)
    used = [p for p in t.model.parameters() if p.grad is not None]
    assert used and all(p.dtype == p.grad.dtype == torch.bfloat16 for p in t.model.parameters() if p.grad is not None)
    state = t.optimizer.optimizer.state
    assert all(state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.bfloat16 for p in used)
    assert sum(not torch.equal(a, b) for a, b in zip(start, t.model.parameters())) >= len(used) // 2  # moved (bf16 rounding can swallow a small step of a large weight, so not every one)


def test_bf16_cannot_be_combined_with_fairseqs_16_bit_flags(data: Path) -> None:
    with pytest.raises(ValueError, match="use one of them"):
        trainer(data, ["--precision", "half-bf16", "--memory-efficient-fp16"])


def test_a_sparse_linear_computes_the_masked_dense_linear() -> None:
    dense = torch.nn.Linear(12, 7)
    keep = torch.rand(7, 12) < 0.3
    sparse = sparse_linear.SparseLinear(copy.deepcopy(dense), keep)
    x = torch.randn(5, 3, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    w = (dense.weight * keep).detach().requires_grad_()
    y, y2 = sparse(x), F.linear(x2, w, dense.bias)
    torch.testing.assert_close(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(sparse.values.grad, w.grad.reshape(-1)[keep.reshape(-1)])
    assert sparse.nnz == int(keep.sum()) and torch.equal(sparse.dense_weight(), dense.weight.detach() * keep)


@pytest.mark.slow
def test_dsr_keeps_its_sparsity_and_moves_weights_over_many_updates(data: Path) -> None:
    t, task = trainer(data, ["--sparsity", "0.9", "--dsr-periods", "[3,3,3,3]", "--max-update", "60", "--max-tokens", "600"])
    model = t.model
    dense = {n: m.shape.numel() for n, m in sparse_linear.sparse_linears(model).items()}
    start = {n: m.nnz for n, m in sparse_linear.sparse_linears(model).items()}
    assert all(start[n] == round(0.1 * dense[n]) for n in dense)
    itr = t.get_train_iterator(epoch=1).next_epoch_itr(shuffle=True)
    steps = 0
    while steps < 50:
        for s in itr:
            t.train_step([s])
            steps += 1
            if steps == 50:
                break
        itr = t.get_train_iterator(epoch=2).next_epoch_itr(shuffle=True)
    layers = sparse_linear.sparse_linears(model)
    assert model.dsr.rewirings >= 10
    assert sum(m.nnz for m in layers.values()) == sum(start.values())  # the total never changes
    assert any(layers[n].nnz != start[n] for n in layers)  # but nonzeros moved between layers
    state = t.optimizer.optimizer.state
    for m in layers.values():
        idx = m.indices.long()
        assert idx.dtype == torch.long and bool((idx[1:] > idx[:-1]).all()) and 0 <= int(idx[0]) and int(idx[-1]) < m.shape.numel()
        assert state[m.values]["exp_avg"].shape == m.values.shape  # Adam's state follows the pattern
    # A checkpoint of the rewired model loads into a freshly built one (per-layer counts resized first).
    fresh = task.build_model(t.cfg.model)
    fresh.load_state_dict(model.state_dict())
    assert fresh.dsr.rewirings == model.dsr.rewirings
    assert all(torch.equal(fresh.get_submodule(n).indices, m.indices) for n, m in layers.items())


def test_the_plugin_without_options_is_fairseqs_model() -> None:
    plain, _ = translation_memory.build(FULL, 8848, 6632)
    plugged, _ = translation_memory.build([*FULL, *PLUGIN, "--arch", ARCH], 8848, 6632)
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [(n, p.shape) for n, p in plugged.named_parameters()]
    # A short batch is enough: the same model on the same batch (the full-size batch costs 20 s more to account).
    base = translation_memory.account(FULL, 8848, 6632, tokens=256, length=16)
    same = translation_memory.account([*FULL, *PLUGIN, "--arch", ARCH], 8848, 6632, tokens=256, length=16)
    assert (base.peak, base.at_peak) == (same.peak, same.at_peak)


def _used(args: list[str]) -> tuple[int, int]:
    """(parameters, parameters that get a gradient) of the full-size model: fairseq's scriptable DynamicConv has
    a conv_bias per layer that its forward never uses (7 + 6 of 512)."""
    model, _ = translation_memory.build(args, 8848, 6632)
    n = sum(p.numel() for p in model.parameters())
    return n, n - 13 * 512


BUFFERS = 2 * (1026 * 512 + 1)  # per side, sinusoidal positions for 1024 + 2 positions and a version number
LARGEST = 8848 * 512  # the German embedding table


def test_the_accountant_counts_sparse_layers_as_csr_at_full_size() -> None:
    args = [*FULL, *PLUGIN, "--arch", ARCH, "--sparsity", "0.9"]
    model, _ = translation_memory.build(args, 8848, 6632)
    layers = sparse_linear.sparse_linears(model)
    assert len(layers) == 7 * 5 + 6 * 9  # per layer: linear1, linear2, fc1, fc2, the kernel predictor (+4 attention projections)
    nnz = sum(m.nnz for m in layers.values())
    assert nnz == sum(round(0.1 * m.shape.numel()) for m in layers.values())
    n, used = _used(args)  # n counts the sparse layers' nonzeros
    csr = sum(4 * (m.nnz + m.rows + 1) for m in layers.values())
    other_buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if not name.endswith(".indices"))
    r = translation_memory.account(args, 8848, 6632, tokens=4000, length=32)
    assert r.category_max["model"] == 4 * n + csr + other_buffers
    assert r.category_max["optimizer"] == 2 * 4 * used
    assert r.category_max["gradients"] == 4 * used


def test_the_accountant_holds_fairseqs_fp16_tensors_at_their_real_width() -> None:
    n, used = _used(FULL)
    efficient = translation_memory.account([*FULL, "--memory-efficient-fp16"], 8848, 6632, tokens=4000, length=32)
    # fp16 weights and buffers; fairseq's Adam updates each fp16 weight through a transient fp32 copy of it, the
    # largest of which is the German embedding table. No lasting fp32 copy.
    assert efficient.category_max["model"] == 2 * n + 2 * BUFFERS + 4 * LARGEST
    assert efficient.category_max["gradients"] == 2 * used
    assert efficient.category_max["optimizer"] == 2 * 4 * used  # fairseq's Adam keeps fp32 state for fp16 weights
    mixed = translation_memory.account([*FULL, "--fp16"], 8848, 6632, tokens=4000, length=32)
    assert mixed.category_max["model"] == 2 * n + 2 * BUFFERS
    # FP16Optimizer: fp32 master weights and fp32 master gradients for every parameter, and Adam on them (the
    # unused conv_bias too: its master gradient is zeros, not None). For each unused conv_bias fairseq assigns a
    # new zero master gradient each step before the old one goes: 512 floats held twice for a moment.
    assert mixed.category_max["optimizer"] == 4 * n + 4 * n + 2 * 4 * n + 4 * 512


@pytest.mark.parametrize("options", [["--precision", "mixed-bf16"], ["--precision", "half-bf16", "--optimizer", "lowmem_adamw"]],
                         ids=["mixed-bf16", "all-bf16"])
def test_the_accountant_agrees_with_measurement_on_a_tiny_bf16_lightconv(options: list[str]) -> None:
    """Mixed is accounted on fake CPU tensors (autocast does not act on meta), all-16-bit on meta; both give the
    bytes of the same step on real tensors, but for one kernel: meta's layer norm saves its mean and 1/std in fp32,
    as CUDA's does, where the CPU's saves them in bf16 (2 bytes less for each, per token, per layer norm)."""
    args = ([*TINY_MODEL[2:], *PLUGIN, "--arch", ARCH, *options], 50, 40)
    shapes = translation_memory.account(*args, tokens=64, length=8)
    real = translation_memory.account(*args, tokens=64, length=8, device="cpu")
    model, _ = translation_memory.build(args[0], 50, 40)
    norms = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    stats = 2 * 2 * 64 * norms if "half-bf16" in options else 0  # all saved at the peak, in this model
    assert shapes.peak - real.peak == shapes.at_peak["activations"] - real.at_peak["activations"] == stats
    assert {c: v for c, v in shapes.at_peak.items() if c != "activations"} == {c: v for c, v in real.at_peak.items() if c != "activations"}
    measured, _ = translation_memory.measure(*args, tokens=64, length=8)
    assert abs(shapes.peak - measured) / measured < 0.03


def test_the_accountant_holds_the_plugins_bf16_tensors_at_their_real_width() -> None:
    plugin = [*FULL, *PLUGIN, "--arch", ARCH]
    model, _ = translation_memory.build(plugin, 8848, 6632)
    n, used = _used(plugin)
    tensors = sum(1 for _ in model.parameters()) - 13  # parameter tensors that get a gradient (13 unused conv_bias)
    half = translation_memory.account([*plugin, "--precision", "half-bf16"], 8848, 6632, tokens=4000, length=32)
    # bf16 weights and buffers; fairseq's Adam upcasts each weight to a transient fp32 copy for its update (the
    # largest is the German embedding table) and keeps fp32 state.
    assert half.category_max["model"] == 2 * n + 2 * BUFFERS + 4 * LARGEST
    assert half.category_max["gradients"] == 2 * used
    assert half.category_max["optimizer"] == 2 * 4 * used
    allbf16 = translation_memory.account([*plugin, "--precision", "half-bf16", "--optimizer", "lowmem_adamw"], 8848, 6632,
                                         tokens=4000, length=32)
    # torch's AdamW: bf16 moments and one fp32 step count per parameter tensor; no fp32 copy of any weight.
    assert allbf16.category_max["model"] == 2 * n + 2 * BUFFERS
    assert allbf16.category_max["optimizer"] == 2 * 2 * used + 4 * tensors
    fp32 = translation_memory.account(plugin, 8848, 6632, tokens=4000, length=32)
    mixed = translation_memory.account([*plugin, "--precision", "mixed-bf16"], 8848, 6632, tokens=4000, length=32)
    # Mixed: fp32 weights, gradients and Adam state as in fp32; activations saved in bf16, except the fp32 loss.
    assert mixed.category_max["gradients"] == fp32.category_max["gradients"] == 4 * used
    assert mixed.category_max["optimizer"] == fp32.category_max["optimizer"]
    assert half.at_peak["activations"] < 0.6 * fp32.at_peak["activations"]
    assert mixed.at_peak["activations"] < 0.75 * fp32.at_peak["activations"]


def test_the_accountant_sees_one_microbatch_of_activations_and_checkpointed_layers() -> None:
    base = translation_memory.account(FULL, 8848, 6632, tokens=4000, length=32)
    micro = translation_memory.account([*FULL, "--update-freq", "4", "--max-tokens", "1000"], 8848, 6632, tokens=4000, length=32)
    one = translation_memory.account(FULL, 8848, 6632, tokens=(4000 // 4 // 32) * 32, length=32)
    assert micro.at_peak["activations"] == one.at_peak["activations"]  # activations of one batch of 31 sentences
    assert micro.category_max["gradients"] == base.category_max["gradients"]
    ckpt = translation_memory.account([*FULL, *PLUGIN, "--arch", ARCH, "--checkpoint-activations"], 8848, 6632, tokens=4000, length=32)
    assert ckpt.at_peak["activations"] < base.at_peak["activations"] / 5
    assert ckpt.category_max["optimizer"] == base.category_max["optimizer"]


def test_technique_parameters_are_checked() -> None:
    with pytest.raises(ParamError, match="--max-tokens 1000"):
        TranslationTechniquesParams(max_tokens=4000, techniques={"baseline": [], "uf": ["--update-freq", "4"]})
    with pytest.raises(ParamError, match="unknown"):
        TranslationTechniquesParams(techniques={"baseline": []}, trained=["baseline", "nope"])
    with pytest.raises(ParamError, match="baseline"):
        TranslationTechniquesParams(techniques={"x": []})
    p = TranslationTechniquesParams(recipe_args=FULL, techniques={"baseline": [], "s": ["--sparsity", "0.5"]}, dsr_periods=[1, 2, 3, 4])
    args = translation_study.train_params(p, "s").scale_args
    assert args[-2:] == ["--sparsity", "0.5"] and "[1,2,3,4]" in args and ARCH in args
    # Microbatching's --max-tokens is the run's batch: the last --max-tokens on the fairseq-train command line.
    p = TranslationTechniquesParams(recipe_args=FULL, max_tokens=4000,
                                    techniques={"baseline": [], "uf": ["--update-freq", "4", "--max-tokens", "1000"]})
    cmd = translation.train_args(translation_study.train_params(p, "uf"), Path("bin"), Path("save"))
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--max-tokens") + 1] == "1000"
    assert cmd[cmd.index("--update-freq") + 1] == "4"


def _adamw8bit_state_bytes(numels: list[int]) -> int:
    """Both Adam moments in 8 bits from first principles: per parameter of at least 4096 elements a uint8 code per
    element and an fp32 maximum per block of 256, for each moment; fp32 moments below that size; two shared 256-entry
    fp32 code books (signed for the first moment, unsigned for the second)."""
    big = [n for n in numels if n >= 4096]
    return (sum(2 * (n + -(-n // 256) * 4) for n in big) + sum(2 * 4 * n for n in numels if n < 4096)
            + (2 * 256 * 4 if big else 0))


def test_the_accountant_counts_8bit_adam_moments_at_their_real_bytes() -> None:
    plugin = [*FULL, *PLUGIN, "--arch", ARCH]
    model, _ = translation_memory.build(plugin, 8848, 6632)
    used = [p.numel() for name, p in model.named_parameters() if not name.endswith("conv_bias")]
    fp32 = translation_memory.account([*plugin, "--optimizer", "lowmem_adamw"], 8848, 6632, tokens=4000, length=32)
    eight = translation_memory.account([*plugin, "--optimizer", "lowmem_adamw8bit"], 8848, 6632, tokens=4000, length=32)
    assert fp32.category_max["optimizer"] == 2 * 4 * sum(used) + 4 * len(used)  # fp32 moments and a step count each
    assert eight.category_max["optimizer"] == _adamw8bit_state_bytes(used)  # bitsandbytes keeps its step in Python
    assert {c: eight.at_peak[c] for c in ("model", "gradients", "activations")} == {c: fp32.at_peak[c] for c in ("model", "gradients", "activations")}


@pytest.mark.parametrize("lever", ["lowmem_adamw8bit", "lowmem_adamw_kahan"])
def test_an_optimizer_lever_without_its_savings_is_the_plugins_adamw_to_rounding(lever: str) -> None:
    """Without what each lever stores differently it is the plugin's fp32 AdamW, to rounding. 8-bit AdamW keeps fp32
    moments for parameters under 4096 elements (bitsandbytes' fp32 kernel folds the bias corrections into the step
    and eps, torch divides first); optimi's AdamW keeps no compensation for fp32 weights."""
    from lowmem.dynamicconv import plugin

    cls, config = {"lowmem_adamw8bit": (plugin.LowmemAdamW8bit, plugin.LowmemAdamW8bitConfig),
                   "lowmem_adamw_kahan": (plugin.LowmemAdamWKahan, plugin.LowmemAdamWKahanConfig)}[lever]
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    opts = [plugin.LowmemAdamW(plugin.LowmemAdamWConfig(lr=[1e-2], weight_decay=1e-2), a.parameters()),
            cls(config(lr=[1e-2], weight_decay=1e-2), b.parameters())]
    for i in range(20):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        for m, opt in zip((a, b), opts):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)  # 20 steps of lr 1e-2 moved them by about 0.2
    state = opts[1].optimizer.state[b.weight]
    if lever == "lowmem_adamw8bit":
        assert isinstance(state["state1"], torch.Tensor) and state["state1"].dtype == torch.float32
    else:
        assert state["kahan_comp"] is None


def test_each_8bit_adamw_step_is_fp32_adamw_from_the_moments_as_stored_and_stores_them_within_half_a_code() -> None:
    """An 8192-element weight over many steps: the new weight is exactly fp32 AdamW (decoupled weight decay, bias
    corrections) computed from the dequantized moments, and each stored moment is within half its code book's widest
    step, times its block's maximum, of the exact moment (1% slack: the CPU quantizer compares in fp32)."""
    from lowmem.dynamicconv.plugin import LowmemAdamW8bit, LowmemAdamW8bitConfig

    lr, wd, (b1, b2), eps = 1e-2, 1e-2, (0.9, 0.98), 1e-8
    w = torch.nn.Parameter(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    opt = LowmemAdamW8bit(LowmemAdamW8bitConfig(lr=[lr], weight_decay=wd, adam_betas=(b1, b2), adam_eps=eps), [w])

    def moments(s: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return optimizers.dequantized(s, 1), optimizers.dequantized(s, 2)

    def bound(s: dict, i: int) -> torch.Tensor:
        codes = s[f"qmap{i}"].sort().values
        return (s[f"absmax{i}"].repeat_interleave(256)[: w.numel()] * (codes[1:] - codes[:-1]).max() / 2).view_as(w) * 1.01

    for step in range(1, 31):
        g = torch.randn(64, 128, generator=torch.Generator().manual_seed(step)) * step
        s = opt.optimizer.state.get(w)
        m, v = moments(s) if s else (torch.zeros_like(w), torch.zeros_like(w))
        w0 = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        s = opt.optimizer.state[w]
        m_exact = m.mul(b1).add_(g, alpha=1 - b1)
        v_exact = v.mul(b2).addcmul_(g, g, value=1 - b2)
        denom = (v_exact.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
        assert torch.equal(w.detach(), w0.mul(1 - lr * wd).addcdiv_(m_exact, denom, value=-lr / (1 - b1**step)))
        m_got, v_got = moments(s)
        assert ((m_got - m_exact).abs() <= bound(s, 1)).all() and ((v_got - v_exact).abs() <= bound(s, 2)).all()


def test_the_accountant_counts_the_kahan_compensation_as_optimizer_state() -> None:
    """All-bf16 with optimi's AdamW: two bf16 moments and a bf16 compensation per weight, 6 bytes, and no step
    tensors (optimi counts steps per group); the plugin's all-bf16 AdamW keeps two bf16 moments and an fp32 step
    per parameter. Everything else is the same at full size."""
    plugin = [*FULL, *PLUGIN, "--arch", ARCH, "--precision", "half-bf16"]
    model, _ = translation_memory.build(plugin, 8848, 6632)
    used = [p.numel() for name, p in model.named_parameters() if not name.endswith("conv_bias")]
    plain = translation_memory.account([*plugin, "--optimizer", "lowmem_adamw"], 8848, 6632, tokens=4000, length=32)
    kahan = translation_memory.account([*plugin, "--optimizer", "lowmem_adamw_kahan"], 8848, 6632, tokens=4000, length=32)
    assert plain.category_max["optimizer"] == 2 * 2 * sum(used) + 4 * len(used)
    assert kahan.category_max["optimizer"] == 3 * 2 * sum(used)
    assert {c: kahan.category_max[c] for c in ("model", "gradients", "activations")} == {c: plain.category_max[c] for c in ("model", "gradients", "activations")}


def test_kahan_adamw_in_bf16_follows_fp32_where_bf16_adamw_loses_every_step() -> None:
    """Weights near 1 moved by about 1e-4 per step, under half of bf16's spacing there (2^-7): the plugin's all-bf16
    AdamW rounds every step away and never moves, and so does optimi's AdamW with the compensation off, while the
    compensated one stays within one bf16 spacing of the same AdamW in fp32 after 200 steps (which has moved by
    about 0.02, nearly three spacings). So what the lever adds to bf16 training is the compensation."""
    from lowmem.dynamicconv.plugin import LowmemAdamW, LowmemAdamWConfig, LowmemAdamWKahan, LowmemAdamWKahanConfig

    start = (1 + torch.rand(256, generator=torch.Generator().manual_seed(0)) / 8).to(torch.bfloat16)
    ws = [torch.nn.Parameter(start.float()), *(torch.nn.Parameter(start.clone()) for _ in range(3))]
    cfg = dict(lr=[1e-4], weight_decay=0.0)
    opts = [LowmemAdamW(LowmemAdamWConfig(**cfg), [ws[0]]), LowmemAdamW(LowmemAdamWConfig(**cfg), [ws[1]]),
            LowmemAdamWKahan(LowmemAdamWKahanConfig(**cfg), [ws[2]])]
    opts.append(optimizers.adamw_kahan([ws[3]], **opts[2].optimizer_config, kahan_sum=False))
    for step in range(200):
        g = torch.randn(256, generator=torch.Generator().manual_seed(step)).abs() + 0.5  # one sign: the moves add up
        for w, opt in zip(ws, opts):
            w.grad = g.to(w.dtype)
            opt.step()
    fp32, plain, kahan, uncompensated = (w.detach().float() for w in ws)
    spacing = 2.0 ** -7  # bf16's in [1, 2)
    assert (fp32 - start.float()).abs().min() > 2 * spacing  # fp32 moved by more than two spacings
    assert torch.equal(plain, start.float()) and torch.equal(uncompensated, start.float())  # never moved
    assert ((kahan - fp32).abs() <= spacing).all()


@pytest.mark.slow
def test_kahan_adamw_resumes_from_fairseqs_checkpoint_to_the_same_parameters(data: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """fairseq saves 16-bit optimizer state as fp32 and torch casts it back on load, and optimi counts steps per
    parameter group: two updates, a checkpoint, a new trainer and two more give the four-update run bit for bit."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # fairseq 0.12's checkpoints pickle its options
    options = [*NO_DROPOUT, "--precision", "half-bf16", "--optimizer", "lowmem_adamw_kahan"]
    straight, task = trainer(data, options)
    samples = [batch(task, list(range(8 * i, 8 * i + 8))) for i in range(4)]
    for s in samples:
        straight.train_step([s])
    first, _ = trainer(data, options)
    for s in samples[:2]:
        first.train_step([s])
    first.consolidate_optimizer()  # as fairseq's checkpoint_utils.save_checkpoint does first
    first.save_checkpoint(str(tmp_path / "checkpoint.pt"), {})
    resumed, _ = trainer(data, options)
    resumed.load_checkpoint(str(tmp_path / "checkpoint.pt"))
    assert resumed.get_num_updates() == 2
    for s in samples[2:]:
        resumed.train_step([s])
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        if a.grad is not None:
            assert torch.equal(a, b), name
    state = resumed.optimizer.optimizer.state
    assert state and all(s["kahan_comp"].dtype == torch.bfloat16 for s in state.values())


@pytest.mark.slow
def test_8bit_adamw_trains_with_fairseq_and_keeps_8bit_moments(data: Path) -> None:
    t, task = trainer(data, [*NO_DROPOUT, *WIDER, "--optimizer", "lowmem_adamw8bit", "--weight-decay", "0.0001"])
    start = [p.detach().clone() for p in t.model.parameters()]
    losses = [t.train_step([batch(task, list(range(8 * i, 8 * i + 8)))])["loss"] for i in range(4)]
    assert all(math.isfinite(x) for x in losses)
    state = t.optimizer.optimizer.state
    big = [p for p in t.model.parameters() if p.grad is not None and p.numel() >= 4096]
    assert big and all(state[p]["state1"].dtype == state[p]["state2"].dtype == torch.uint8 for p in big)
    assert all(not torch.equal(a, b) for a, b in zip(start, t.model.parameters()) if b.grad is not None and b.numel() >= 4096)


def test_run_only_trains_the_named_techniques_beside_the_baseline_and_says_on_which_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowmem.studies import quality

    p = TranslationTechniquesParams(techniques={"baseline": [], "a": ["--sparsity", "0.5"], "b": ["--checkpoint-activations"]},
                                    trained=["baseline", "a"], timed=["baseline", "a"])
    seen, accounted = [], []

    def memory(q: TranslationTechniquesParams) -> pd.DataFrame:  # the full-size accountant is tested above
        accounted.append(q.techniques)
        return pd.DataFrame([{"technique": n, **{f"{c}_mib": 1.0 for c in CATEGORIES}, "total_mib": 5.0 * (i + 1),
                              "peak_phase": "backward"} for i, n in enumerate(q.techniques)])

    monkeypatch.setattr(translation_study, "train_and_time", lambda q, data_dir: seen.append(q) or {"trained": []})
    monkeypatch.setattr(translation_study, "memory", memory)
    out = translation_study.run_only(p, ["b"])
    assert seen[0].trained == seen[0].timed == ["baseline", "b"]
    assert out["machine"] == quality.machine()
    # The memory of what it trained, not of every technique: "a" is neither trained nor accounted.
    assert accounted == [{"baseline": [], "b": ["--checkpoint-activations"]}]
    assert out["memory"]["b"]["total_mib"] == 10.0 and set(out["memory"]["b"]) == {*(f"{c}_mib" for c in CATEGORIES), "total_mib", "peak_phase"}
    with pytest.raises(ParamError, match=r"--only: unknown technique\(s\) \['c'\]; techniques: baseline, a, b"):
        translation_study.run_only(p, ["c"])
