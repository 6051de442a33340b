"""What `lowmem plan` prints and answers: a table that fits a terminal, a row in full with Python that really applies
it, JSON, `--check`, `--max-batch`, and budgets by GPU name."""

import json

import pytest
import yaml

from lowmem.cli import fits, main, plan, plan_output, profile
from lowmem.cli.profile import Request
from lowmem.memory import devices
from lowmem.memory.accounting import account_step
from lowmem.techniques import precision
from lowmem.techniques import step as step_module
from lowmem.techniques.step import Techniques

REQ = Request("wrn:wrn-10-1", 8, (3, 16, 16), "sgd-momentum")
LEVERS = plan.Levers(precision=("fp32", "half-bf16"), checkpoint=("none", "planned"), activation_bits=(0,),
                     optimizer_state=("given", "8-bit"), step=("plain", "fused"), microbatch_steps=3)
SMALL = Request("wrn:wrn-10-1", 2, (3, 8, 8), "sgd-momentum")
TRAIN_STEP = step_module.train_step  # the project's step; the pasted code's is stubbed to see what it trains


@pytest.fixture(scope="module")
def tight() -> plan.Plan:
    """A plan at half the plain step's peak: microbatches, planned checkpoints, 16 bits and 8-bit state all in play."""
    return plan.make_plan(REQ, profile.account(REQ).peak // 2, progress=False, levers=LEVERS)


def test_the_table_fits_a_terminal_at_its_longest_row_and_numbers_the_rows(tight):
    # The longest lever names the planner can put in one row, for a batch of 4,096 examples, with the longest
    # optimizer swap: microbatches and 16 bits, or the fused step (whole batch, fp32; lowmem.techniques.fused_step).
    swap = max((o for s in plan.STATE.values() for o, _ in s.values()), key=len)
    rows = [plan_output.levers(Techniques(precision=max(plan.PRECISIONS, key=len), microbatch=2048, activation_bits=8),
                               [[(0, 1, True)]], swap, "sgd-momentum", "plain"),
            plan_output.levers(Techniques(activation_bits=8), [[(0, 1, True)]], swap, "sgd-momentum", "fused")]
    worst = tight.fitting.head(1).assign(levers=max(rows, key=len), peak_bytes=2**40, time=10.0, predicted_low=-100.0,
                                         quality_risk="lossy")
    assert max(len(line) for line in plan_output.table(worst).splitlines()) <= plan_output.WIDTH
    lines = plan_output.table(tight.fitting).splitlines()
    assert [int(line.split("|")[1]) for line in lines[2:]] == list(range(1, len(tight.fitting) + 1))
    for line, r in zip(lines[2:], tight.fitting.itertuples()):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[2] == r.levers and cells[4] == ("exact" if r.quality_risk == "exact" else f"lossy {r.predicted_low:+.2f}")


def test_each_rows_levers_name_what_it_applies(tight):
    for r in tight.fitting.itertuples():
        names = r.levers.split("+")
        assert (r.tech.precision in names) == (r.tech.precision != "fp32")
        assert (f"microbatch-{r.tech.microbatch}" in names) == (r.tech.microbatch != 0)
        assert ("checkpoint" in names) == bool(r.segments)
        assert (r.optimizer in names) == (r.optimizer != REQ.optimizer)
        assert ("fused-step" in names) == (r.step == "fused")
    assert {"plain"} != set(tight.fitting.levers)  # at half the plain peak some lever is needed


def test_explain_gives_each_lossy_levers_measurement_and_python_that_applies_the_row(tight, monkeypatch):
    """The Python of --explain, run on a fresh model, trains the very step the row accounted: same peak, to the byte."""
    seen = []
    monkeypatch.setattr(step_module, "train_step", lambda *args, **kw: seen.append((args, kw)))
    for n, r in enumerate(tight.fitting.itertuples(), start=1):
        text = plan_output.explain(tight.fitting, n, REQ, tight.budget)
        assert text.startswith(f"Row {n} of {len(tight.fitting)}: {r.levers}")
        for part in r.quality_risk.split("; ") if r.quality_risk != "exact" else ["exact: every lever"]:
            assert part in text
        x, y = profile.models.batch(profile.models.build(REQ.spec, "cpu"), REQ.batch, REQ.input, None, "cpu")
        scope = {"model": profile.models.build(REQ.spec, "cpu"), "batches": [(x, y)]}
        exec(plan_output.how_to_apply(r, REQ), scope)
        (model, opt, xb, yb, tech), kw = seen.pop()
        assert tech == r.tech
        scaler = precision.make_scaler(precision.parse(tech.precision), "cpu", sync=False) if kw["scaler"] else None
        got = account_step(lambda mark: TRAIN_STEP(model, opt, xb, yb, tech, mark, scaler), model, opt, (xb, yb)).peak
        assert got == r.peak_bytes, (n, r.levers)
    with pytest.raises(ValueError, match=f"rows 1 to {len(tight.fitting)}"):
        plan_output.explain(tight.fitting, len(tight.fitting) + 1, REQ, tight.budget)


def test_json_holds_every_row_and_its_python(tight):
    out = json.loads(plan_output.as_json(tight.fitting, REQ, tight.budget))
    assert [r["row"] for r in out["rows"]] == list(range(1, len(tight.fitting) + 1))
    for got, r in zip(out["rows"], tight.fitting.itertuples()):
        assert (got["peak_bytes"], got["levers"], got["segments"]) == (r.peak_bytes, r.levers, json.loads(json.dumps(r.segments)))
        assert got["how_to_apply"] == plan_output.how_to_apply(r, REQ)


def test_check_exits_0_when_the_plain_step_fits_and_1_when_it_does_not(capsys):
    peak = fits.peak(SMALL)
    argv = ["plan", SMALL.model, "--batch", "2", "--input", "3x8x8", "--check", "--budget"]
    assert main.main([*argv, f"{peak}B"]) == 0
    assert capsys.readouterr().out.startswith("fits:")
    assert main.main([*argv, f"{peak - 1}B"]) == 1
    assert capsys.readouterr().out.startswith("does not fit:")
    with pytest.raises(SystemExit) as e:  # --check without --budget: argparse refuses it, exit 2
        main.main(argv[:-1])
    assert e.value.code == 2


def test_max_batch_is_the_largest_that_fits(capsys):
    limit = (fits.peak(SMALL) + fits.peak(Request(SMALL.model, 9, SMALL.input))) // 2  # between batch 2 and batch 9
    r = fits.max_batch(SMALL, limit)
    assert fits.peak(Request(SMALL.model, r.batch, SMALL.input)) == r.peak <= limit
    assert fits.peak(Request(SMALL.model, r.batch + 1, SMALL.input)) > limit and not r.capped
    tech = Techniques(precision="half-bf16", checkpoint="block")
    under = fits.max_batch(SMALL, limit, tech)
    assert under.batch > r.batch and fits.peak(Request(SMALL.model, under.batch + 1, SMALL.input), tech) > limit
    assert fits.parse_levers("half-bf16+checkpoint-block") == tech and fits.parse_levers("plain") == Techniques()
    capped = fits.max_batch(SMALL, 2**40, cap=8)
    assert (capped.batch, capped.capped) == (8, True)
    argv = ["plan", SMALL.model, "--input", "3x8x8", "--max-batch", "--budget"]
    assert main.main([*argv, f"{limit}B"]) == 0
    assert f"largest batch: {r.batch}," in capsys.readouterr().out
    assert main.main([*argv, f"{r.smallest_peak - 1}B"]) == 1  # not even one example: says so, with its peak
    assert f"peaks at {r.smallest_peak / 2**20:,.1f} MiB" in capsys.readouterr().out


def test_a_gpu_name_is_its_nvidia_smi_memory_less_what_was_measured_of_its_libraries():
    table = yaml.safe_load(devices.TABLE.read_text())["devices"]
    t4 = fits.budget("t4")
    assert t4[0] == table["t4"]["total_mib"] * 2**20 and any("not deducted" in n for n in t4[1])
    # The H200 is the GPU this project's check ran on: its total and library memory come from that run's files.
    folder = devices.ROOT / table["h200"]["measured"]
    total = int((folder / "nvidia_smi.txt").read_text().splitlines()[1].split(",")[2].strip().removesuffix(" MiB")) * 2**20
    base = next(r for r in json.loads((folder / "gpu_check.json").read_text())["memory"] if r["configuration"] == "baseline")
    assert fits.budget("h200")[0] == total - round(base["persistent_library_mib"] * 2**20)


@pytest.mark.parametrize("argv,says", [
    (["--budget", "t5"], "nor a device: one of t4, l4"),
    (["--budget", "1GiB", "--levers", "bf16", "--max-batch"], "'bf16' is none of the levers' short names"),
    (["--budget", "1GiB", "--levers", "half-bf16+optimi-sgd", "--max-batch"], "not optimizer"),
    (["--budget", "1GiB", "--check", "--json"], "leave out --explain and --json"),
])
def test_bad_plan_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main.main(["plan", SMALL.model, "--batch", "2", "--input", "3x8x8", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
