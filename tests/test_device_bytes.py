"""lowmem.cli.device_bytes: lowmem profile's op workspace, measured once per op call and kept on disk."""

import json
from pathlib import Path

import pytest

from lowmem.cli import device_bytes, main, profile
from lowmem.cli.profile import Request
from lowmem.memory.measure import CPUWorkspace

REQ = Request("torchvision:resnet18", 4, (3, 32, 32), "sgd-momentum")


def test_profile_prints_the_tensors_the_op_workspace_and_their_peak(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWMEM_CACHE", str(tmp_path))
    assert main.main(["profile", REQ.model, "--batch", "4", "--input", "3x32x32", "--json"]) == 0
    device = json.loads(capsys.readouterr().out)["device"]
    tensors, peak = profile.account(REQ).peak, profile.account(REQ, workspace=CPUWorkspace()).peak
    assert (device["tensors_bytes"], device["peak_bytes"], device["op_workspace_bytes"]) == (tensors, peak, peak - tensors)
    assert device["measured_now"] == device["calls"] > 0 and device["cpu"] in device_bytes.machine_key()
    assert main.main(["profile", REQ.model, "--batch", "4", "--input", "3x32x32", "--tensors-only"]) == 0
    assert "What this CPU holds" not in capsys.readouterr().out


def test_a_second_request_reads_every_measurement_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = device_bytes.DiskWorkspace(tmp_path / "w.json")
    peak = profile.account(REQ, workspace=first).peak
    first.save()

    def refuse(*_: object) -> int:
        raise AssertionError("measured again")

    monkeypatch.setattr(device_bytes.DiskWorkspace, "_measure", refuse)
    again = device_bytes.DiskWorkspace(tmp_path / "w.json")
    assert profile.account(REQ, workspace=again).peak == peak
    assert (again.new, again.cached) == (0, len(first.cache))


def test_another_machine_or_library_measures_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.json"
    first = device_bytes.DiskWorkspace(path)
    profile.account(REQ, workspace=first)
    first.save()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({"another CPU | torch 0 | oneDNN v0 (max ISA all) | ATen AVX2": data[first.machine]}))
    other = device_bytes.DiskWorkspace(path)
    profile.account(REQ, workspace=other)
    assert other.cached == 0 and other.new == len(first.cache)
    # oneDNN's allowed instruction set is part of the key: its kernels, and their scratch, differ by it.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "max ISA AVX2" in device_bytes.machine_key() and device_bytes.machine_key() != first.machine
