"""The lever registry (lowmem.techniques.registry): every lever declared once, in its own module, with evidence that
exists; the training tables agree with the cards; a card retrains nothing, and a new lever retrains only its runs."""

import ast
import shutil
from pathlib import Path

import pytest

from lowmem import runs
from lowmem.techniques import checkpoint, compress, optimizers, precision, registry, sharding, short_names
from lowmem.techniques.step import Techniques
from lowmem.wrn.train import TRAIN_CODE

ROOT = Path(__file__).parents[1]
LEVERS = registry.levers()


def _tests_in(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@pytest.mark.parametrize("name", list(LEVERS))
def test_each_lever_names_a_test_that_exists_and_a_lossy_one_where_its_quality_was_measured(name: str) -> None:
    lever = LEVERS[name]
    path, _, test = lever.proof.partition("::")
    assert test in _tests_in(ROOT / path), f"{name}: {lever.proof} does not exist"
    # An exact lever may have been measured where it is not exact (microbatching with BatchNorm); a lossy one must.
    assert lever.quality or lever.exact != "lossy", f"{name} is lossy and names no measurement of its quality"
    assert not lever.quality or (ROOT / lever.quality).is_file(), f"{name}: no committed quality file {lever.quality!r}"


def test_the_training_tables_are_the_cards_settings() -> None:
    """Where the trainer keeps a table of its own (the plugin's code path reads it, and a card is not code), the
    card's settings are that table."""
    assert [s for lv in registry.on_field("optimizer") if lv.module.endswith(".optimizers") for s in lv.settings] == list(optimizers.OPTIMIZERS[1:])
    assert LEVERS["precision"].settings == precision.MODES
    assert LEVERS["checkpointing"].settings == checkpoint.STRATEGIES
    assert LEVERS["activation-bits"].settings == (0, *compress.BITS)
    assert LEVERS["sharding"].settings == tuple(sharding.MODES)
    assert registry.optimizers()[:3] == ("sgd", *optimizers.OPTIMIZERS[1:])  # the recipe's first, then the levers'


@pytest.mark.parametrize("field", ["precision", "activation_bits", "optimizer"])
def test_every_setting_of_a_lever_is_one_the_wrn_step_takes(field: str) -> None:
    for lever in registry.on_field(field):
        for setting in lever.settings:
            assert getattr(Techniques(**{field: setting}), field) == setting


def test_an_unknown_lever_or_optimizer_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="no lever 'dropout': the levers are checkpointing, activation-bits"):
        short_names.get("dropout")
    with pytest.raises(ValueError, match="optimizer='adam' is not one of sgd, optimi-sgd, bnb-sgd8bit"):
        Techniques(optimizer="adam")


def test_a_card_and_a_new_lever_change_no_digest_but_the_code_beside_a_card_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renaming a lever in its card (8-bit state's, on the fairseq plugin's path too) keeps every run's key, and so
    does a new lever's module (the registry finds it; no module of a path imports it); a change to the code beside a
    card does not."""
    dst = tmp_path / "lowmem"
    shutil.copytree(ROOT / "lowmem", dst, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(runs, "PACKAGE", dst)
    paths = {"wrn": TRAIN_CODE, "plugin": runs.closure("lowmem.dynamicconv.plugin")}
    before = {k: runs.code_digest(v) for k, v in paths.items()}
    card = dst / "techniques" / "optimizers.py"
    card.write_text(card.read_text().replace('name="8-bit-state"', 'name="state-8bit"'))
    (dst / "techniques" / "new_lever.py").write_text((dst / "techniques" / "fused_step.py").read_text().replace('"fused-step"', '"new"'))
    assert runs.closure("lowmem.wrn.train") == sorted([*TRAIN_CODE, "lowmem.config", "lowmem.wrn.params"])
    assert {k: runs.code_digest(v) for k, v in paths.items()} == before
    card.write_text(card.read_text().replace("BLOCK = 256", "BLOCK = 128"))
    assert all(runs.code_digest(v) != before[k] for k, v in paths.items())
