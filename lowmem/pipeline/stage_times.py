"""``dvc repro`` with each stage's wall time recorded: what `make repro` runs.

    python -m lowmem.pipeline times [--all] [--out figures/stage_times] [-- dvc repro ARGS...]

``--all`` (``make repro-all``) also runs the stages that dvc.yaml marks ``frozen: true``, the ones left out of the
default pipeline to keep it within its time budget. DVC never runs a frozen stage and cannot unfreeze a matrix stage
(``dvc unfreeze`` refuses parametrized stages), so dvc.yaml is rewritten without the marks for that part of the run
and put back afterwards, whatever happens. And each ``dvc repro`` writes a frozen stage into dvc.lock as its deps
stand, so the lock calls a frozen stage up to date whatever made its outputs: ``--all`` therefore forces the left-out
stages (``dvc repro --force --single-item``), after the default pipeline and before what reads them. A forced stage
takes every run it needs from the run store, so it retrains only what the store lacks.

DVC prints ``Running stage 'NAME':`` as it starts each stage; a stage's time is from that line to the next stage's
(or the end), so it includes DVC's own hashing and caching of the stage's outputs. The table keeps the latest time
of every stage that has ever run, with the date it was measured and the profile; a run in which no stage ran leaves
it as it was. DVC has no timing report of its own (``dvc repro`` keeps none in ``dvc.lock``), hence this wrapper.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from lowmem import runs
from lowmem.cpu import cpu_class
from lowmem.pipeline import docs, outputs

STARTED = re.compile(r"^Running stage '([^']+)':")
FROZEN = re.compile(r"^    frozen: true\b.*\n", re.MULTILINE)
Done = Callable[[str, float], None]
FAILED = re.compile(r"^ERROR: failed to reproduce '([^']+)'")
FROZEN_WARNING = re.compile(r"^WARNING: stage: '[^']+' is frozen\. Its dependencies are not going to be reproduced\.$")


def left_out(dvc_yaml: Path = Path("dvc.yaml")) -> list[str]:
    """The stages ``make repro`` leaves out: those dvc.yaml marks ``frozen: true``."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return [n for n, s in stages.items() if s.get("frozen")]  # in dvc.yaml's order, upstream first


def repro_all(dvc_yaml: Path = Path("dvc.yaml")) -> tuple[list[list[str]], list[list[str]]]:
    """``make repro-all`` as (commands run as dvc.yaml stands, commands run with the frozen marks removed)."""
    return [["dvc", "repro"]], [["dvc", "repro", "--force", "--single-item", *left_out(dvc_yaml)], ["dvc", "repro"]]


def unfrozen(cmd: list[str], dvc_yaml: Path = Path("dvc.yaml"), done: Done | None = None,
             started: dict[str, float] | None = None) -> tuple[int, list[tuple[str, float]]]:
    """Runs ``timed(cmd)`` with dvc.yaml's frozen marks removed; dvc.yaml is restored even on an interrupt."""
    text = dvc_yaml.read_text()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` runs on a plain kill too
    dvc_yaml.write_text(FROZEN.sub("", text))
    try:
        return timed(cmd, done, started)
    finally:
        dvc_yaml.write_text(text)


def timed_all(dvc_yaml: Path = Path("dvc.yaml"), done: Done | None = None,
              started: dict[str, float] | None = None) -> tuple[int, list[tuple[str, float]]]:
    """Runs ``repro_all``'s commands in turn, stopping at the first that fails."""
    plain, thawed = repro_all(dvc_yaml)
    times: list[tuple[str, float]] = []
    for cmd, run in [*((c, lambda c: timed(c, done, started)) for c in plain),
                     *((c, lambda c: unfrozen(c, dvc_yaml, done, started)) for c in thawed)]:
        rc, t = run(cmd)
        times += t
        if rc != 0:
            return rc, times
    return 0, times


def timed(cmd: list[str], done: Done | None = None, started: dict[str, float] | None = None) -> tuple[int, list[tuple[str, float]]]:
    """Runs ``cmd``, echoing its output; returns its exit code and (stage, seconds) of the stages that finished, in
    the order they ran. ``done(stage, seconds)`` is called as each stage finishes (the next one starts), so that a
    run stopped midway keeps the times of the stages it finished. The stage DVC names as failed gets no time; DVC can
    fail a stage before it starts it (a missing dep), and then every stage that started finished. A run that stops
    without naming one (killed) did not finish the stage it was in. ``started`` gets each stage's wall-clock start."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    starts: list[tuple[str, float]] = []
    frozen = 0
    failed: str | None = None
    for line in proc.stdout:
        if FROZEN_WARNING.match(line):  # by design, once per left-out stage: a summary line below says it once
            frozen += 1
            continue
        sys.stdout.write(line)
        f = FAILED.match(line)
        failed = f.group(1) if f else failed
        m = STARTED.match(line)
        if m:
            if starts and done:
                done(starts[-1][0], round(time.monotonic() - starts[-1][1], 1))
            starts.append((m.group(1), time.monotonic()))
            if started is not None:
                started[m.group(1)] = time.time()
    rc = proc.wait()
    if frozen:
        print(f"{frozen} stage(s) left out of the default pipeline kept their committed results (`make repro-all` runs them)")
    end = time.monotonic()
    ends = [t for _, t in starts[1:]] + [end]
    times = [(name, round(e - t, 1)) for (name, t), e in zip(starts, ends)]
    if rc != 0 and times and failed is None:
        times = times[:-1]
    return rc, [(name, t) for name, t in times if name != failed]


def commit() -> str:
    """The checkout's commit, with ``+changes`` where tracked files differ from it: what made the figures."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "not a git checkout"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True).returncode != 0
    return head.stdout.strip() + ("+changes" if dirty else "")


def frozen_origins(dvc_yaml: Path = Path("dvc.yaml")) -> pd.DataFrame:
    """Each left-out stage with the commit that last wrote its committed outputs (``git log``): what made its results,
    since ``make repro`` never runs it. The CPU of those runs was not recorded before this table existed."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    rows = []
    for name in left_out(dvc_yaml):
        s = stages[name]
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in s.get("outs", []) + s.get("metrics", [])]
        outs = [o.replace("${item.slot}", "*") for o in outs]
        log = subprocess.run(["git", "log", "-1", "--format=%h %ad", "--date=short", "--", *outs], capture_output=True,
                             text=True).stdout.split()
        rows.append({"stage": name, "outputs": ", ".join(outs), "commit": log[0] if log else "not committed",
                     "committed": log[1] if log else ""})
    return pd.DataFrame(rows)


def write_frozen(out: Path) -> None:
    outputs.save_table(frozen_origins(), out, "The stages left out of `make repro` (frozen in dvc.yaml): their "
                       "results are committed, made by the commit that last wrote them (git log of their outputs); "
                       "`make repro-all` reruns them.")


def store_use(started: dict[str, float], ledger: list[dict[str, Any]]) -> dict[str, str]:
    """What each stage that ran took from the run store (``lowmem.runs``): 'trained N, reused M' from the store's
    ledger, each event given to the stage that had started last when it was logged (the ledger keeps whole seconds).
    A stage that reuses its runs does not train, and its time says nothing of training's."""
    order = sorted(started.items(), key=lambda kv: kv[1])
    counts: dict[str, dict[str, int]] = {}
    for e in ledger:
        t = time.mktime(time.strptime(e["time"], "%Y-%m-%dT%H:%M:%S"))
        owner = [name for name, start in order if int(start) <= t]
        if owner:
            c = counts.setdefault(owner[-1], {"trained": 0, "reused": 0})
            c[e["event"]] = c.get(e["event"], 0) + 1
    return {name: (", ".join(f"{k} {v}" for k, v in counts[name].items() if v) if name in counts else "none")
            for name in started}


def update(table: Path, times: list[tuple[str, float]], profile: str, cpu: str = "not recorded",
           made_by: str = "not recorded", store: dict[str, str] | None = None) -> pd.DataFrame:
    """The stage-time table with this run's times: one row per stage and CPU class, the latest of each kept;
    ``store``: each stage's runs from the run store (``store_use``)."""
    old = pd.read_csv(table.with_suffix(".csv")) if table.with_suffix(".csv").exists() else pd.DataFrame()
    for col in ("cpu", "commit", "store_runs"):
        if len(old) and col not in old:
            old[col] = "not recorded"  # rows from before the table named them
    today = time.strftime("%Y-%m-%d")
    new = pd.DataFrame([{"stage": s, "seconds": t, "measured": today, "profile": profile, "cpu": cpu, "commit": made_by,
                         "store_runs": (store or {}).get(s, "not recorded")} for s, t in times])
    if len(old) and len(new):
        old = old[~(old.stage.isin(new.stage) & (old.cpu == cpu))]
    return pd.concat([old, new], ignore_index=True)


def latest_run(state: Path, times: list[tuple[str, float]], profile: str, cpu: str, ok: bool) -> dict[str, Any]:
    """The latest ``make repro`` on ``cpu`` as {stages, minutes, profile, cpu, ok, resumed}, kept in ``state`` beside
    the latest run on each other CPU class. A run that follows a failed one on the same CPU and profile resumes it
    (DVC skips the stages that finished, and a failed stage has no time), so the two count as one run."""
    run = {"stages": len(times), "minutes": round(sum(t for _, t in times) / 60, 2), "profile": profile, "cpu": cpu,
           "ok": ok, "resumed": 0, "measured": time.strftime("%Y-%m-%d")}
    latest = latest_runs(state)
    prev = latest.get(cpu)
    if prev and not prev["ok"] and prev["profile"] == profile:
        run.update(stages=prev["stages"] + run["stages"], minutes=round(prev["minutes"] + run["minutes"], 2),
                   resumed=prev["resumed"] + 1)
    latest = {cpu: run, **{c: r for c, r in latest.items() if c != cpu}}  # the latest first
    state.write_text(json.dumps({"by_cpu": latest}, indent=2) + "\n")
    return run


def latest_runs(state: Path) -> dict[str, dict[str, Any]]:
    """The latest ``make repro`` on each CPU class, the most recent first (a file from before the classes were kept
    apart holds one run)."""
    data = json.loads(state.read_text()) if state.exists() else {}
    return data["by_cpu"] if "by_cpu" in data else ({data["cpu"]: data} if data else {})


def summary(runs: dict[str, dict[str, Any]]) -> str:
    """The latest run on each CPU class, for the README (embedded by ``lowmem.pipeline.docs``); the commits stay in the
    stage table, since the README holds no history."""
    def one(run: dict[str, Any]) -> str:
        resumed = f", resumed {run['resumed']} time(s) after a failure" if run["resumed"] else ""
        failed = " (failed)" if not run["ok"] else ""
        return (f"on {run['cpu']}{failed}: {run['stages']} stage(s) in {run['minutes']:.1f} min at profile "
                f"`{run['profile']}`{resumed}")

    return (f"Latest `make repro` on each CPU class measured, 2 cores: {'; '.join(one(r) for r in runs.values())} "
            "(the commit of each stage: figures/stage_times.md).\n")


def by_cpu(table: pd.DataFrame) -> pd.DataFrame:
    """The table as it is shown: one row per stage, its seconds on each CPU class measured, and the commit, date,
    profile and run-store use of its latest run."""
    order = list(dict.fromkeys(table.stage))
    seconds = table.pivot_table(index="stage", columns="cpu", values="seconds", aggfunc="last").reindex(order)
    if "store_runs" not in table:
        table = table.assign(store_runs="not recorded")
    latest = table.groupby("stage", sort=False).last()[["commit", "measured", "profile", "store_runs"]].reindex(order)
    return pd.concat([seconds.rename(columns=lambda c: f"seconds: {c}"), latest], axis=1).reset_index()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=Path("figures/stage_times"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--all", action="store_true", help="also the stages left out of the default (frozen in dvc.yaml)")


def run(args: argparse.Namespace) -> int:
    """``args.command``: what follows ``--`` on the command line (``lowmem.pipeline.commands``), else None."""
    cmd = args.command or ["dvc", "repro"]
    profile = yaml.safe_load(args.params.read_text())["base"]["profile"]
    t0 = time.monotonic()
    made_by = commit()  # before the run: what the stages ran from
    if args.all and args.command:
        ap.error("--all runs its own commands (the default pipeline, then the left-out stages forced); give no -- CMD")
    cmd = ["make", "repro-all"] if args.all else cmd
    cpu = cpu_class()

    started: dict[str, float] = {}

    def save(times: list[tuple[str, float]]) -> pd.DataFrame:
        # store_use gives no stage the events logged before this run's first stage started
        table = update(args.out, times, profile, cpu, made_by, store_use(started, runs.ledger()))
        outputs.save_table(by_cpu(table), args.out, f"Wall time of each DVC stage the last time it ran on each CPU class "
                           f"(`make repro`, {' '.join(cmd)}), 2 CPU cores; the time of a stage includes DVC's hashing "
                           f"of its outputs; commit: the checkout that made the stage's figures (+changes: with "
                           f"uncommitted changes); store runs: the runs its latest run trained, or took from the run "
                           f"store (data/runs) and so did not train. Latest run: {len(times)} stage(s), "
                           f"{sum(t for _, t in times) / 60:.1f} min, profile `{profile}`, on {cpu}.")
        table.to_csv(args.out.with_suffix(".csv"), index=False)  # the long table, one row per stage and CPU class
        return table

    finished: list[tuple[str, float]] = []

    def done(stage: str, seconds: float) -> None:  # a run stopped midway keeps its finished stages' times
        finished.append((stage, seconds))
        save(finished)

    rc, times = timed_all(done=done, started=started) if args.all else timed(cmd, done, started)
    if times:
        save(times)
        if args.all or cmd == ["dvc", "repro"]:  # the README's line is `make repro`'s; a rerun of named stages is not one
            state = Path(f"{args.out}_summary.json")
            latest_run(state, times, profile, cpu, rc == 0)
            Path(f"{args.out}_summary.md").write_text(summary(latest_runs(state)))
        write_frozen(Path(f"{args.out}_frozen"))
        print(f"{len(times)} stage(s) ran in {(time.monotonic() - t0) / 60:.1f} min; times in {args.out}.md")
    # The README's and docs/'s embedded tables follow the files the run just wrote (lowmem.pipeline.docs).
    changed = [p for p in docs.pages(Path(".")) if docs.refresh(p, Path("."))]
    if changed:
        print(f"embedded tables refreshed in {', '.join(map(str, changed))}")
    return rc

