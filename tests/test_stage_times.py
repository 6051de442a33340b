"""lowmem.pipeline.stage_times: the per-stage times of `make repro`, and `make repro-all`'s temporary unfreezing."""

import json
import sys
from pathlib import Path

import pandas as pd

from lowmem.pipeline import commands, stage_times

DVC_YAML = """stages:
  a:
    cmd: echo a
  m:
    matrix:
      slot: [0, 1]
    frozen: true  # left out
    cmd: echo ${item.slot}
"""


def _echo(lines: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.stdout.write({lines!r})"]


def test_a_stage_runs_from_its_start_line_to_the_next() -> None:
    rc, times = stage_times.timed(_echo("Running stage 'a':\nx\nRunning stage 'm@0':\n"))
    assert rc == 0
    assert [n for n, _ in times] == ["a", "m@0"]


def test_each_stage_is_reported_as_it_finishes_so_a_stopped_run_keeps_them(tmp_path: Path) -> None:
    # The command waits, after b starts, for the file that a's report writes: it exits 1 if a was reported only at
    # the end.
    flag = tmp_path / "a-reported"
    script = (f"import pathlib, sys, time; print(\"Running stage 'a':\", flush=True); print(\"Running stage 'b':\", flush=True)\n"
              f"for _ in range(100):\n    time.sleep(0.1)\n    if pathlib.Path({str(flag)!r}).exists(): sys.exit(0)\nsys.exit(1)")
    reported: list[str] = []

    def done(stage: str, seconds: float) -> None:
        reported.append(stage)
        flag.write_text(stage)

    rc, times = stage_times.timed([sys.executable, "-c", script], done)
    assert rc == 0 and reported == ["a"] and [n for n, _ in times] == ["a", "b"]


def _fail(lines: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.stdout.write({lines!r}); sys.exit(1)"]


def test_the_failed_stage_gets_no_time_and_older_times_are_kept(tmp_path: Path) -> None:
    # DVC names the stage that failed; it may be one that never started (a missing dep), so b finished here.
    assert [n for n, _ in stage_times.timed(_fail("Running stage 'a':\nRunning stage 'b':\nERROR: failed to reproduce 'c': x\n"))[1]] == ["a", "b"]
    assert [n for n, _ in stage_times.timed(_fail("Running stage 'a':\nRunning stage 'b':\nERROR: failed to reproduce 'b': x\n"))[1]] == ["a"]
    assert [n for n, _ in stage_times.timed(_fail("Running stage 'a':\nRunning stage 'b':\n"))[1]] == ["a"]  # killed in b
    table = tmp_path / "t"
    pd.DataFrame([{"stage": "old", "seconds": 5.0, "measured": "2026-01-01", "profile": "cpu"}]).to_csv(table.with_suffix(".csv"), index=False)
    merged = stage_times.update(table, [("a", 1.0)], "cpu")
    assert merged.stage.tolist() == ["old", "a"]


def test_a_run_after_a_failed_one_resumes_it_in_the_summary(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    first = stage_times.latest_run(state, [("a", 60.0), ("b", 120.0)], "cpu", "X (AVX2)", ok=False)
    assert (first["stages"], first["minutes"], first["resumed"]) == (2, 3.0, 0)
    assert "on X (AVX2) (failed): 2 stage(s) in 3.0 min at" in stage_times.summary(stage_times.latest_runs(state))
    second = stage_times.latest_run(state, [("c", 30.0)], "cpu", "X (AVX2)", ok=True)
    assert (second["stages"], second["minutes"], second["resumed"], second["ok"]) == (3, 3.5, 1, True)
    assert "3 stage(s) in 3.5 min at profile `cpu`, resumed 1 time(s) after a failure" in stage_times.summary(stage_times.latest_runs(state))
    # after a run that succeeded, or on another CPU, a run counts alone
    assert stage_times.latest_run(state, [("a", 6.0)], "cpu", "X (AVX2)", ok=False)["stages"] == 1
    assert stage_times.latest_run(state, [("b", 6.0)], "cpu", "Y (AVX-512)", ok=True)["stages"] == 1


def test_the_summary_keeps_the_latest_run_of_each_cpu_class_newest_first(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    # a file from before the classes were kept apart: one run, which stays as its class's
    state.write_text(json.dumps({"stages": 20, "minutes": 42.1, "profile": "cpu", "cpu": "X (AVX2)", "ok": True, "resumed": 0}))
    stage_times.latest_run(state, [("a", 600.0)], "cpu", "Y (AVX-512)", ok=True)
    runs = stage_times.latest_runs(state)
    assert list(runs) == ["Y (AVX-512)", "X (AVX2)"] and runs["X (AVX2)"]["minutes"] == 42.1
    text = stage_times.summary(runs)
    assert text.index("on Y (AVX-512): 1 stage(s) in 10.0 min") < text.index("on X (AVX2): 20 stage(s) in 42.1 min")
    stage_times.latest_run(state, [("a", 60.0)], "cpu", "X (AVX2)", ok=True)  # a newer run on a class replaces its old one
    assert [(c, r["minutes"]) for c, r in stage_times.latest_runs(state).items()] == [("X (AVX2)", 1.0), ("Y (AVX-512)", 10.0)]


def test_repro_all_runs_without_the_frozen_marks_and_puts_dvc_yaml_back(tmp_path: Path) -> None:
    dvc_yaml = tmp_path / "dvc.yaml"
    dvc_yaml.write_text(DVC_YAML)
    assert stage_times.left_out(dvc_yaml) == ["m"]
    # The default pipeline first; then the left-out stages forced (dvc.lock calls a frozen stage up to date whatever
    # made its outputs), and what reads them.
    assert stage_times.repro_all(dvc_yaml) == ([["dvc", "repro"]], [["dvc", "repro", "--force", "--single-item", "m"], ["dvc", "repro"]])
    seen = tmp_path / "seen"
    cmd = [sys.executable, "-c", f"import pathlib, sys; pathlib.Path({str(seen)!r}).write_text(pathlib.Path({str(dvc_yaml)!r}).read_text()); sys.exit(3)"]
    rc, _ = stage_times.unfrozen(cmd, dvc_yaml)
    assert rc == 3
    assert "frozen" not in seen.read_text() and "echo ${item.slot}" in seen.read_text()
    assert dvc_yaml.read_text() == DVC_YAML


def test_make_repro_refreshes_the_readme_and_docs_embedded_tables(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("base:\n  profile: smoke\n")
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "t.md").write_text("| a |\n|---|\n| 2 |\n")
    (tmp_path / "docs").mkdir()
    block = "<!-- lowmem:embed figures/t.md -->\n{}\n<!-- lowmem:embed:end -->\n"
    (tmp_path / "docs" / "p.md").write_text(block.format("| a |\n|---|\n| 1 |"))
    assert commands.main(["times", "--out", "figures/stage_times", "--", *_echo("Running stage 'a':\n")]) == 0
    assert (tmp_path / "docs" / "p.md").read_text() == block.format("| a |\n|---|\n| 2 |")
    # A command other than `make repro`'s (named stages, say) times its stages but is not the README's run.
    assert (tmp_path / "figures" / "stage_times.csv").exists() and not (tmp_path / "figures" / "stage_times_summary.md").exists()
    monkeypatch.setattr(stage_times, "timed", lambda cmd, done=None, started=None: (0, [("a", 60.0)]) if cmd == ["dvc", "repro"] else (1, []))
    assert commands.main(["times", "--out", "figures/stage_times"]) == 0
    assert f"on {stage_times.cpu_class()}: 1 stage(s) in 1.0 min" in (tmp_path / "figures" / "stage_times_summary.md").read_text()


def test_dvcs_warning_for_each_left_out_stage_becomes_one_line(capsys) -> None:
    out = "WARNING: stage: 'm@0' is frozen. Its dependencies are not going to be reproduced.\nRunning stage 'a':\n" \
          "WARNING: stage: 'm@1' is frozen. Its dependencies are not going to be reproduced.\nWARNING: something else\n"
    rc, times = stage_times.timed(_echo(out))
    printed = capsys.readouterr().out
    assert rc == 0 and [s for s, _ in times] == ["a"]
    assert "is frozen" not in printed and "WARNING: something else" in printed
    assert "2 stage(s) left out of the default pipeline kept their committed results" in printed


CPUINFO = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma\n"


def test_each_stage_keeps_its_time_per_cpu_class_with_the_commit_that_ran_it(tmp_path: Path) -> None:
    assert stage_times.cpu_class(CPUINFO) == "AMD EPYC 7B13 (AVX2)"
    assert stage_times.cpu_class(CPUINFO.replace("avx2", "avx2 avx512f avx512_bf16")) == "AMD EPYC 7B13 (AVX-512, bf16)"
    assert stage_times.cpu_class(CPUINFO.replace("avx2", "avx2 avx512f amx_bf16")) == "AMD EPYC 7B13 (AVX-512, AMX)"
    table = tmp_path / "t"
    pd.DataFrame([{"stage": "a", "seconds": 5.0, "measured": "2026-01-01", "profile": "cpu"}]).to_csv(table.with_suffix(".csv"), index=False)
    t = stage_times.update(table, [("a", 9.0), ("b", 2.0)], "cpu", cpu="X (AVX2)", made_by="abc1234")
    t.to_csv(table.with_suffix(".csv"), index=False)
    t = stage_times.update(table, [("a", 4.0)], "cpu", cpu="Y (AVX-512)", made_by="def5678")
    shown = stage_times.by_cpu(t)
    assert sorted(c for c in shown.columns if c.startswith("seconds")) == [
        "seconds: X (AVX2)", "seconds: Y (AVX-512)", "seconds: not recorded"]
    a = shown.set_index("stage").loc["a"]
    assert (a["seconds: X (AVX2)"], a["seconds: Y (AVX-512)"], a["seconds: not recorded"], a["commit"]) == (9.0, 4.0, 5.0, "def5678")
    b = shown.set_index("stage").loc["b"]
    assert b["seconds: X (AVX2)"] == 2.0 and pd.isna(b["seconds: Y (AVX-512)"]) and b["commit"] == "abc1234"
    line = stage_times.summary({
        "Y (AVX-512)": {"stages": 20, "minutes": 32.1, "profile": "cpu", "cpu": "Y (AVX-512)", "ok": True, "resumed": 0},
        "X (AVX2)": {"stages": 2, "minutes": 1.5, "profile": "cpu", "cpu": "X (AVX2)", "ok": False, "resumed": 1}})
    assert line == ("Latest `make repro` on each CPU class measured, 2 cores: on Y (AVX-512): 20 stage(s) in 32.1 min at "
                    "profile `cpu`; on X (AVX2) (failed): 2 stage(s) in 1.5 min at profile `cpu`, resumed 1 time(s) after "
                    "a failure (the commit of each stage: figures/stage_times.md).\n")


def test_each_stage_shows_the_runs_it_trained_and_the_ones_it_took_from_the_store(tmp_path: Path) -> None:
    # Events are given to the stage that had started last when they were logged; one logged before any stage of
    # this run started is another run's.
    import time as _time
    t0 = _time.mktime(_time.strptime("2026-12-07T10:00:00", "%Y-%m-%dT%H:%M:%S"))
    started = {"train": t0 + 0.4, "reuse": t0 + 30.7, "report": t0 + 60.2}
    at = lambda s: _time.strftime("%Y-%m-%dT%H:%M:%S", _time.localtime(t0 + s))  # noqa: E731
    ledger = [{"key": "k0", "event": "trained", "time": at(-5)},
              {"key": "k1", "event": "trained", "time": at(10)}, {"key": "k2", "event": "trained", "time": at(29)},
              {"key": "k1", "event": "reused", "time": at(30)},  # the second reuse started in: the store keeps seconds
              {"key": "k2", "event": "reused", "time": at(31)}, {"key": "k3", "event": "reused", "time": at(59)}]
    use = stage_times.store_use(started, ledger)
    assert use == {"train": "trained 2", "reuse": "reused 3", "report": "none"}
    table = tmp_path / "t"
    pd.DataFrame([{"stage": "train", "seconds": 300.0, "measured": "2026-01-01", "profile": "cpu", "cpu": "X (AVX2)",
                   "commit": "abc1234"}]).to_csv(table.with_suffix(".csv"), index=False)
    t = stage_times.update(table, [("reuse", 4.5)], "cpu", cpu="X (AVX2)", made_by="def5678", store=use)
    shown = stage_times.by_cpu(t).set_index("stage")
    assert shown.loc["train", "store_runs"] == "not recorded" and shown.loc["reuse", "store_runs"] == "reused 3"
