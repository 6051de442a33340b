"""lowmem.studies.gpu_check: its dry mode here (the same code paths, tiny, on the CPU); the CUDA assertions where a GPU is."""

import csv
import json
from pathlib import Path

import pytest
import torch

from lowmem.studies import gpu_check, gpu_memory

ROOT = Path(__file__).parents[1]
DEBIAN = Path("/usr/share/datasets/fashion-mnist")
FILES = {"gpu_check.json", "gpu_check.log", "gpu_check_memory.csv", "gpu_check_memory.md", "gpu_check_memory.png",
         "gpu_check_training.csv", "gpu_check_training.md"}


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu")
    assert gpu_check.main(["--out", str(out), "--dry", "--data", str(DEBIAN)]) == 0
    return out, json.loads((out / "gpu_check.json").read_text())


def test_the_dry_run_writes_its_files_flat_and_says_it_is_not_a_gpu_result(dry: tuple[Path, dict]) -> None:
    out, result = dry
    assert {p.name for p in out.iterdir()} == FILES  # at most 8, no subfolders: what the device tool brings back
    assert result["dry"] is True and "DRY RUN" in (out / "gpu_check_memory.md").read_text()
    assert "fairseq" in result["dynamicconv"]  # says why DynamicConv is not checked


def test_every_code_path_ran_and_the_accountant_with_cpu_workspace_meets_the_cpu_peak(dry: tuple[Path, dict]) -> None:
    _, result = dry
    rows = result["memory"]
    assert not [r for r in rows if "error" in r]
    kinds = {(r["role"], r["precision"].split("-")[0]) for r in rows}
    assert {("baseline", "fp32"), ("precision", "mixed"), ("precision", "half"), ("microbatching", "fp32"),
            ("checkpointing", "fp32"), ("sparsity", "fp32")} <= kinds
    # Every WRN configuration of the committed headline and budget table runs, under the sweep's name, so that the
    # headline's GPU column can read what a GPU measured for it.
    headline = {r["our configuration"] for r in csv.DictReader((ROOT / "figures/00_headline_full.csv").open()) if r["task"] == "wrn"}
    budgets = {r["name"] for r in csv.DictReader((ROOT / "figures/09_wrn_budgets.csv").open())}
    assert headline | budgets <= {r["configuration"] for r in rows}
    for r in rows:
        # The accountant alone misses op workspace on the CPU; with it, it meets the profiler's peak.
        assert r["accounted_mib"] < r["measured_mib"], r
        assert abs(r["gap_with_workspace_pct"]) < 1.0, r


@pytest.mark.skipif(not DEBIAN.exists(), reason="Debian's dataset-fashion-mnist is not installed (make setup installs it)")
def test_each_mode_trains_from_the_idx_files(dry: tuple[Path, dict]) -> None:
    _, result = dry
    assert [r["mode"] for r in result["training"]] == ["fp32", "mixed-bf16", "half-bf16"]
    assert all(r["epoch"] == r["epochs_planned"] == 1 for r in result["training"])


def test_missing_data_skips_training_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="copy Debian's"):
        gpu_check.fashion_mnist(tmp_path, torch.device("cpu"))


def test_idx_files_read_as_numpy_match_their_header(tmp_path: Path) -> None:
    images = (torch.arange(2 * 3 * 4) % 256).to(torch.uint8).reshape(2, 3, 4).numpy()
    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in images.shape)
    (tmp_path / "x").write_bytes(header + images.tobytes())
    assert (gpu_check._idx(tmp_path, "x") == images).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_accountant_with_workspace_and_library_memory_is_within_two_percent() -> None:
    c = gpu_memory.load_check(dry=False)
    row = gpu_memory.memory_row(c, "baseline", "baseline", gpu_memory.Techniques(), gpu_memory._Real(gpu_memory.CUDAWorkspace()))
    assert abs(row["gap_full_pct"]) < 2.0, row


def test_redraw_remakes_the_same_tables_from_the_json_and_reductions_divide_the_baseline(dry: tuple[Path, dict], tmp_path: Path) -> None:
    out, result = dry
    assert gpu_check.main(["--out", str(tmp_path), "--redraw", str(out / "gpu_check.json")]) == 0
    for name in ("gpu_check_memory.md", "gpu_check_memory.csv", "gpu_check_training.md", "gpu_check_training.csv"):
        assert (tmp_path / name).read_text() == (out / name).read_text(), name
    rows = {r["configuration"]: r for r in gpu_check.reductions(result["memory"])}
    base = next(r for r in result["memory"] if r["role"] == "baseline")
    for r in result["memory"]:
        assert rows[r["configuration"]]["reduction_measured"] == base["measured_mib"] / r["measured_mib"]
        assert rows[r["configuration"]]["reduction_accounted"] == base["accounted_mib"] / r["accounted_mib"]
    assert rows["baseline"]["reduction_full_model"] == 1.0


def test_a_failed_configuration_keeps_its_error_in_the_tables_beside_the_others(dry: tuple[Path, dict], tmp_path: Path) -> None:
    _, result = dry
    failed = {"configuration": "broken", "role": "checkpointing", "error": "TypeError: boom"}
    gpu_check.write_files({**result, "memory": [*result["memory"], failed]}, tmp_path)
    with (tmp_path / "gpu_check_memory.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows[-1]["error"] == "TypeError: boom" and rows[-1]["measured_mib"] == "" and rows[0]["error"] == ""
    assert "| broken | checkpointing |" in (tmp_path / "gpu_check_memory.md").read_text()
    assert "broken" not in {r["configuration"] for r in gpu_check.reductions([*result["memory"], failed])}


def test_a_combination_is_checked_with_its_optimizer_and_compressed_activations() -> None:
    c = gpu_memory.load_check(dry=True)
    t = gpu_memory._named(c, {"precision": "half-fp16", "activation_bits": 4, "optimizer": "bnb-sgd8bit"})
    assert (t.precision, t.activation_bits, t.optimizer) == ("half-bf16", 4, "bnb-sgd8bit")  # a dry run's bf16
    k = gpu_memory._named(c, {"precision": "half-bf16-kahan", "microbatch": 8})
    assert (k.precision, k.optimizer, k.microbatch) == ("half-bf16", "optimi-sgd", 8)
