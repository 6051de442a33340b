"""``dvc repro`` with each stage's wall time recorded: what `make repro` runs.

    python -m lowmem.stage_times [--out figures/stage_times] [-- dvc repro ARGS...]

DVC prints ``Running stage 'NAME':`` as it starts each stage; a stage's time is from that line to the next stage's
(or the end), so it includes DVC's own hashing and caching of the stage's outputs. The table keeps the latest time
of every stage that has ever run, with the date it was measured and the profile; a run in which no stage ran leaves
it as it was. DVC has no timing report of its own (``dvc repro`` keeps none in ``dvc.lock``), hence this wrapper.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from lowmem import outputs

STARTED = re.compile(r"^Running stage '([^']+)':")


def timed(cmd: list[str]) -> tuple[int, list[tuple[str, float]]]:
    """Runs ``cmd``, echoing its output; returns its exit code and (stage, seconds) in the order they ran."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    starts: list[tuple[str, float]] = []
    for line in proc.stdout:
        sys.stdout.write(line)
        m = STARTED.match(line)
        if m:
            starts.append((m.group(1), time.monotonic()))
    rc = proc.wait()
    end = time.monotonic()
    ends = [t for _, t in starts[1:]] + [end]
    return rc, [(name, round(e - t, 1)) for (name, t), e in zip(starts, ends)]


def update(table: Path, times: list[tuple[str, float]], profile: str, ok: bool) -> pd.DataFrame:
    old = pd.read_csv(table.with_suffix(".csv")) if table.with_suffix(".csv").exists() else pd.DataFrame()
    today = time.strftime("%Y-%m-%d")
    new = pd.DataFrame([{"stage": s, "seconds": t, "measured": today, "profile": profile} for s, t in times])
    if not ok and len(new):
        new = new.iloc[:-1]  # the stage that failed did not finish: its time is not a stage time
    merged = pd.concat([old[~old.stage.isin(new.stage)] if len(old) else old, new], ignore_index=True)
    return merged


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else ["dvc", "repro"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("figures/stage_times"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    profile = yaml.safe_load(args.params.read_text())["base"]["profile"]
    t0 = time.monotonic()
    rc, times = timed(cmd)
    if times:
        table = update(args.out, times, profile, rc == 0)
        total = sum(t for _, t in times)
        outputs.save_table(table, args.out, f"Wall time of each DVC stage the last time it ran (`make repro`, "
                                             f"{' '.join(cmd)}), 2 CPU cores unless stated; the time of a stage includes "
                                             f"DVC's hashing of its outputs. Latest run: {len(times)} stage(s), "
                                             f"{total / 60:.1f} min, profile `{profile}`.")
        print(f"{len(times)} stage(s) ran in {(time.monotonic() - t0) / 60:.1f} min; times in {args.out}.md")
    return rc


if __name__ == "__main__":
    sys.exit(main())
