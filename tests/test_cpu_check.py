"""lowmem.studies.cpu_check: the headline's WRN configurations measured on the CPU, at a tiny size here."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from lowmem.pipeline import commands
from lowmem.studies import cpu_check, gpu_memory
from lowmem.techniques.step import Techniques
from lowmem.wrn import memory as wrn_memory

TINY = gpu_memory.Check(torch.device("cpu"), wrn_memory.Shape("wrn-10-1", 16, 10, 3, 32), [], False)


def test_the_configurations_are_the_baseline_and_each_wrn_row_of_the_comparison_once() -> None:
    rows = [r["our_config"] for r in csv.DictReader(cpu_check.COMPARISON.open()) if r["task"] == "wrn"]
    configs = cpu_check.configurations(TINY)
    assert [n for n, _ in configs] == ["baseline", *dict.fromkeys(rows)]
    grid = {r["name"]: json.loads(r["config"]) for r in csv.DictReader(cpu_check.SWEEP.open())}
    for name, tech in configs[1:]:  # the sweep's levers, as the GPU check runs them
        assert tech == gpu_memory._named(TINY, grid[name])
    assert dict(configs)["baseline"] == Techniques()


def test_a_comparison_row_the_sweep_lacks_is_refused_with_what_to_run(tmp_path: Path) -> None:
    comparison = tmp_path / "c.csv"
    comparison.write_text("task,our_config,our_reduction\nwrn,checkpoint-everything,3.0\n")
    with pytest.raises(ValueError, match=r"checkpoint-everything.*dvc repro combinations"):
        cpu_check.configurations(TINY, comparison)
    comparison.write_text("task,our_config,our_reduction\nwrn,none trained within the budget,\nwrn,checkpoint-block,2.85\n")
    assert [n for n, _ in cpu_check.configurations(TINY, comparison)] == ["baseline", "checkpoint-block"]


def test_each_row_is_measured_against_the_accountant_and_the_baseline(tmp_path: Path) -> None:
    params = tmp_path / "memory_profile.yaml"
    params.write_text(yaml.safe_dump({"model": "wrn-10-1", "reference_batch_size": 16, "num_classes": 10,
                                      "in_channels": 3, "image_size": 32}))
    comparison = tmp_path / "comparison.csv"
    comparison.write_text("task,our_config\nwrn,microbatch-8+checkpoint-block\ndynamicconv,checkpoint\n"
                          "wrn,checkpoint-block\nwrn,microbatch-8+checkpoint-block\n")
    out, table = tmp_path / "cpu_check.json", tmp_path / "00_cpu_check"
    assert commands.main(["cpu-check", "--params", str(params), "--out", str(out), "--table", str(table), "--comparison", str(comparison)]) == 0
    res = json.loads(out.read_text())
    rows = {r["configuration"]: r for r in res["rows"]}
    assert list(rows) == ["baseline", "microbatch-8+checkpoint-block", "checkpoint-block"]
    base = rows["baseline"]
    for r in rows.values():
        assert r["measured_reduction"] == base["measured_mib"] / r["measured_mib"]
        assert r["accounted_reduction"] == base["accounted_mib"] / r["accounted_mib"]
        assert abs(r["gap_with_workspace_pct"]) < 1.0, r  # the CPU's op workspace is what the tensors leave out
    # Checkpointing and microbatching shrink the activations, so each measured peak is below the baseline's.
    assert rows["microbatch-8+checkpoint-block"]["measured_mib"] < rows["checkpoint-block"]["measured_mib"] < base["measured_mib"]
    md = table.with_suffix(".md").read_text()
    assert res["cpu"] in md and "wrn-10-1 at batch 16" in md and "Not a profile's result" in md
