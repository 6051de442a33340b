"""The trainer: it learns, it is deterministic, it resumes exactly, and microbatching keeps the maths."""

from pathlib import Path

import pytest
import torch

from lowmem import runs
from lowmem.config import ParamError
from lowmem.wrn.params import BaselineParams
from lowmem.wrn.train import Techniques, correct_per_example, store_run, train, train_step

TIMING = ("images_per_s", "step_s", "epoch_s", "peak_mem_mib")


def tiny(tmp_path: Path, **kw: object) -> BaselineParams:
    base = dict(dataset="synthetic", data_root=str(tmp_path / "raw"), model="wrn-10-1", epochs=2, batch_size=32, device="cpu")
    return BaselineParams(**{**base, **kw})  # type: ignore[arg-type]


def results(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in history]


def test_a_few_steps_reduce_the_loss(tmp_path: Path) -> None:
    from lowmem.wrn.data import load
    from lowmem.wrn.models import build_model

    d = load("synthetic", tmp_path, synthetic_size=(128, 16))
    x = torch.stack([d.train[i][0] for i in range(64)])
    y = torch.tensor([d.train[i][1] for i in range(64)])
    torch.manual_seed(0)
    model = build_model("wrn-10-1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = [train_step(model, opt, x, y).item() for _ in range(15)]
    assert losses[-1] < 0.6 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:]))


def test_same_seed_same_metrics_and_another_seed_differs(tmp_path: Path) -> None:
    p = tiny(tmp_path, epochs=1)
    a = train(p, 0, progress=False, root=tmp_path / "a")
    b = train(p, 0, progress=False, root=tmp_path / "b")
    c = train(p, 1, progress=False, root=tmp_path / "c")
    assert results(a) == results(b)
    assert results(a) != results(c)


def killed_after_epoch_then_resumed(p: BaselineParams, epoch: int, root: Path, tech: Techniques = Techniques()) -> list[dict]:
    """Seed 0 of ``p`` under ``tech`` killed just after ``epoch``'s checkpoint, then run again: the resumed run's
    history."""
    def interrupt(done: int, _: dict) -> None:
        if done == epoch:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(p, 0, tech, progress=False, on_epoch_end=interrupt, root=root)
    return train(p, 0, tech, progress=False, root=root)


def test_an_interrupted_run_resumes_to_the_same_final_metrics(tmp_path: Path) -> None:
    p = tiny(tmp_path, epochs=3)
    whole = train(p, 0, progress=False, root=tmp_path / "whole")
    resumed = killed_after_epoch_then_resumed(p, 2, tmp_path / "cut")
    assert len(resumed) == 3
    assert [e["event"] for e in runs.ledger(tmp_path / "cut")] == ["resumed at epoch 2", "trained"]
    assert results(resumed) == results(whole)


def test_another_configuration_is_another_run_and_a_finished_one_is_read_not_retrained(tmp_path: Path) -> None:
    first = train(tiny(tmp_path, epochs=1), 0, progress=False, root=tmp_path / "store")
    other = train(tiny(tmp_path, epochs=1, lr=0.05), 0, progress=False, root=tmp_path / "store")
    fresh = train(tiny(tmp_path, epochs=1, lr=0.05), 0, progress=False, root=tmp_path / "fresh")
    assert results(other) == results(fresh) and results(other) != results(first)
    again = train(tiny(tmp_path, epochs=1), 0, progress=False, root=tmp_path / "store")
    assert again == first  # timings included: read from the store, not trained again
    assert [e["event"] for e in runs.ledger(tmp_path / "store")] == ["trained", "trained", "reused"]
    assert len([d for d in (tmp_path / "store").iterdir() if d.is_dir()]) == 2


@pytest.mark.parametrize(
    "kw,name",
    [({"dataset": "imagenet"}, "dataset"), ({"epochs": 0}, "epochs"), ({"epochs": -3}, "epochs"), ({"lr": 0.0}, "lr"), ({"lr": -0.1}, "lr"), ({"batch_size": 0}, "batch_size")],
)
def test_bad_training_parameters_name_themselves(tmp_path: Path, kw: dict, name: str) -> None:
    with pytest.raises(ParamError, match=name):
        tiny(tmp_path, **kw)


@pytest.mark.parametrize(
    "kw",
    [{"sparsity": 1.0}, {"sparsity": -0.5}, {"sparse_method": "rigl"}, {"sparse_format": "coo"}, {"precision": "bf16"},
     {"checkpoint": "every-block"}, {"microbatch": -1}],
)
def test_misspelled_techniques_fail_clearly(kw: dict) -> None:
    with pytest.raises(ValueError, match="sparsity must be in|dsr, static|csr32, csr16|microbatch|unknown checkpoint strategy|not one of fp32, mixed-bf16"):
        Techniques(**kw)  # type: ignore[arg-type]


def test_a_run_keeps_its_per_example_correctness_even_when_resumed_after_its_last_epoch(tmp_path: Path) -> None:
    """The bits behind paired per-example statistics: they reproduce the run's accuracy exactly, and a run killed
    between its last checkpoint and its result (the loop then has nothing left to run) still gets them."""
    p = tiny(tmp_path, epochs=2)
    whole = train(p, 0, progress=False, root=tmp_path / "whole")
    bits = correct_per_example(store_run(p, 0, root=tmp_path / "whole"), whole[-1]["test_examples"])
    assert bits is not None and bits.dtype == bool and len(bits) == whole[-1]["test_examples"]
    assert bits.sum() / len(bits) == whole[-1]["test_acc"]

    resumed = killed_after_epoch_then_resumed(p, 2, tmp_path / "cut")
    assert results(resumed) == results(whole)
    assert (correct_per_example(store_run(p, 0, root=tmp_path / "cut"), len(bits)) == bits).all()


def test_a_kahan_run_resumes_with_its_compensation_and_is_not_the_recipes_run(tmp_path: Path) -> None:
    """torch-optimi's SGD in half-bf16: its momentum and Kahan buffers go into the checkpoint and come back, so a
    resumed run ends where an uninterrupted one does; the optimizer is part of the run's key."""
    # An eighth of the synthetic set: bf16 steps are emulated, and slow, on a CPU without bf16 instructions.
    p, tech = tiny(tmp_path, epochs=2, train_subset=64, test_subset=32), Techniques(precision="half-bf16", optimizer="optimi-sgd")
    whole = train(p, 0, tech, progress=False, root=tmp_path / "whole")
    resumed = killed_after_epoch_then_resumed(p, 1, tmp_path / "cut", tech)
    assert results(resumed) == results(whole)
    assert store_run(p, 0, tech).key != store_run(p, 0, Techniques(precision="half-bf16")).key
    assert store_run(p, 0, Techniques(optimizer="sgd")).key == store_run(p, 0, Techniques()).key


def test_an_8bit_momentum_run_with_dsr_resumes_exactly_and_is_its_own_run(tmp_path: Path) -> None:
    """bitsandbytes' 8-bit momentum under DSR rewiring (which requantizes it) and half-bf16: its codes, block maxima
    and code book go into the checkpoint and come back, so a resumed run ends where an uninterrupted one does."""
    p, tech = tiny(tmp_path, epochs=2, train_subset=64, test_subset=32), Techniques(sparsity=0.5, precision="half-bf16", optimizer="bnb-sgd8bit",
                                                   dsr_periods=(1, 1, 1, 1))
    whole = train(p, 0, tech, progress=False, root=tmp_path / "whole")
    cut = tmp_path / "cut"

    def check_checkpoint_then_interrupt(done: int, _: dict) -> None:
        saved = torch.load(store_run(p, 0, tech, root=cut).dir / "checkpoint.pt", weights_only=False)
        # bitsandbytes nests each parameter's state tensors under one key of its state dict.
        states = [st["__bnb_optimizer_quant_state__"] for st in saved["optimizer"]["state"].values()]
        assert any(st["state1"].dtype == torch.uint8 and "absmax1" in st for st in states)
        assert saved["dsr"]["rewirings"] > 0  # DSR requantized 8-bit momentum before this checkpoint
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(p, 0, tech, progress=False, on_epoch_end=check_checkpoint_then_interrupt, root=cut)
    resumed = train(p, 0, tech, progress=False, root=cut)
    assert results(resumed) == results(whole)
    assert store_run(p, 0, tech).key != store_run(p, 0, Techniques(sparsity=0.5, precision="half-bf16", dsr_periods=(1, 1, 1, 1))).key
