"""A notebook stage publishes its results only when it has succeeded, and readers get a clean executed notebook."""

import json
import subprocess
import sys
from pathlib import Path

from lowmem.pipeline import outputs

ROOT = Path(__file__).parents[1]


def _stage(tmp_path: Path) -> tuple[Path, Path]:
    root, staging = tmp_path / "repo", tmp_path / "repo/data/staging/s"
    (root / "figures").mkdir(parents=True)
    (root / "figures/x.md").write_text("old table\n")
    (root / "metrics").mkdir()
    (root / "metrics/s.json").write_text('{"old": 1}\n')
    return root, staging


def test_publishing_moves_each_staged_file_over_the_committed_one(tmp_path: Path) -> None:
    root, staging = _stage(tmp_path)
    (staging / "figures").mkdir(parents=True)
    (staging / "figures/x.md").write_text("new table\n")
    (staging / "metrics").mkdir()
    (staging / "metrics/s.json").write_text('{"new": 1}\n')
    published = outputs.publish(staging, root)
    assert sorted(p.relative_to(root).as_posix() for p in published) == ["figures/x.md", "metrics/s.json"]
    assert (root / "figures/x.md").read_text() == "new table\n" and json.loads((root / "metrics/s.json").read_text()) == {"new": 1}
    assert not [p for p in staging.rglob("*") if p.is_file()]


def test_a_stage_that_fails_before_publishing_leaves_the_results_as_they_were(tmp_path: Path) -> None:
    root, staging = _stage(tmp_path)
    # What a notebook stage runs: clear the staging folder, the notebook (here it writes one file, then fails),
    # then publish, which the shell's && never reaches.
    script = (f"{sys.executable} -m lowmem.pipeline outputs clear {staging} && "
              f"{sys.executable} -c \"import pathlib; p = pathlib.Path('{staging}/figures'); p.mkdir(); "
              f"(p / 'x.md').write_text('half'); raise SystemExit(1)\" && "
              f"{sys.executable} -m lowmem.pipeline outputs publish {staging} --root {root}")
    r = subprocess.run(script, shell=True, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1
    assert (root / "figures/x.md").read_text() == "old table\n" and (root / "metrics/s.json").read_text() == '{"old": 1}\n'
    # The next attempt starts from an empty staging folder: nothing of the failed one is published.
    subprocess.run([sys.executable, "-m", "lowmem.pipeline", "outputs", "clear", str(staging)], cwd=ROOT, check=True)
    assert outputs.publish(staging, root) == []


def test_the_readers_copy_keeps_tables_and_figures_and_drops_logs_and_timings(tmp_path: Path) -> None:
    image = {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}, "metadata": {}}
    table = {"output_type": "execute_result", "data": {"text/html": "<table/>"}, "metadata": {}, "execution_count": 1}
    log = {"output_type": "stream", "name": "stderr", "text": "epoch 1/3: 100%|####|\n"}
    printed = {"output_type": "stream", "name": "stdout", "text": "3 runs\n"}
    nb = {"cells": [{"cell_type": "code", "source": "x", "outputs": [image, table, log, printed],
                     "metadata": {"papermill": {"duration": 1.5}, "execution": {"iopub.status.busy": "t"}}}],
          "metadata": {"papermill": {"parameters": {}}, "kernelspec": {"name": "lowmem"}}, "nbformat": 4, "nbformat_minor": 5}
    src = tmp_path / "run.ipynb"
    src.write_text(json.dumps(nb))
    out = json.loads(outputs.reader_copy(src, tmp_path / "figures/notebooks/run.ipynb").read_text())
    assert out["cells"][0]["outputs"] == [image, table, printed]
    assert out["cells"][0]["metadata"] == {} and out["metadata"] == {"kernelspec": {"name": "lowmem"}}
