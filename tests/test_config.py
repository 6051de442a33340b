from pathlib import Path

import pytest
import yaml

from lowmem import config
from lowmem.config import PROFILES, STAGES, ParamError, load, resolve
from lowmem.dynamicconv import params as _dynamicconv_params  # noqa: F401  (registers the translation stages)
from lowmem.pipeline import stage_params as _every_stage  # noqa: F401  (registers every stage, as the params stage does)
from lowmem.pipeline.commands import main
from lowmem.studies import params as _study_params  # noqa: F401  (registers the WRN stages)

PARAMS = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())


def with_(base: dict | None = None, **block: object) -> dict:
    p = {"base": {**PARAMS["base"], **(base or {})}, "memory_profile": {**PARAMS["memory_profile"], **block}}
    return p


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_keyed_values_are_picked_for_the_active_profile(profile: str) -> None:
    r = resolve("memory_profile", with_({"profile": profile}))
    assert r["profile"] == profile
    assert r["measured_batch_sizes"] == PARAMS["memory_profile"]["measured_batch_sizes"][profile]
    assert r["accounted_batch_sizes"] == PARAMS["memory_profile"]["accounted_batch_sizes"]


@pytest.mark.parametrize(
    "params,name",
    [
        (with_({"profile": "fast"}), "base.profile"),
        (with_(accounted_batch_sizes=[1, 0, 4]), "accounted_batch_sizes"),
        (with_(measured_batch_sizes=[-2]), "measured_batch_sizes"),
        (with_(model="resnet-50"), "model"),
        (with_(device="tpu"), "device"),
        (with_(reference_batch_size=3), "reference_batch_size"),
        (with_(batch=4), "unknown parameter"),
    ],
)
def test_bad_parameters_name_the_parameter_and_what_is_allowed(params: dict, name: str) -> None:
    with pytest.raises(ParamError, match=name):
        resolve("memory_profile", params)


def test_cli_stops_before_writing_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(with_({"profile": "huge"})))
    out = tmp_path / "resolved.yaml"
    assert main(["params", "--params", str(bad), "--out", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "base.profile" in err and "smoke, cpu, paper" in err


def test_one_resolver_serves_every_stage_of_both_tracks() -> None:
    assert set(STAGES) == {"memory_profile", "baseline", "checkpointing", "microbatching", "precision", "sparsity",
                           "translation_data", "translation_train", "translation_evaluate", "translation_memory",
                           "translation_techniques", "proxy_noise", "planner", "sharding", "combinations_wrn",
                           "combinations_dynamicconv"}
    cpu = {**PARAMS, "base": {**PARAMS["base"], "profile": "cpu"}}
    techniques = resolve("translation_techniques", cpu)
    # FROM: read from the translation_train block; INHERITS: the baseline block resolved whole.
    assert techniques["max_tokens"] == config.pick(PARAMS["translation_train"]["max_tokens"], "cpu")
    sparsity = resolve("sparsity", cpu)
    assert sparsity["train"] == resolve("baseline", cpu)
    # derived: the combination study's recipe, DSR schedule and shape are stage sparsity's; DynamicConv's runs are
    # stage translation_techniques'.
    wrn = resolve("combinations_wrn", cpu)
    assert (wrn["task"], wrn["train"], wrn["dsr"]["dsr_periods"], wrn["wrn"]["model"]) == (
        "wrn", sparsity["train"], sparsity["dsr_periods"], sparsity["model"])
    assert resolve("combinations_dynamicconv", cpu)["translation"] == techniques
    with pytest.raises(ParamError, match="combinations_wrn.task must be wrn"):
        resolve("combinations_wrn", {**cpu, "combinations_wrn": {**PARAMS["combinations_wrn"], "task": "dynamicconv"}})


def test_an_unknown_stage_lists_the_known_ones() -> None:
    with pytest.raises(ParamError, match="translation_train"):
        resolve("translation", PARAMS)


def test_load_without_a_source_is_the_smoke_profile_of_params_yaml(tmp_path: Path) -> None:
    p = load("sparsity")
    assert p.profile == "smoke"
    smoke = {**PARAMS, "base": {**PARAMS["base"], "profile": "smoke"}}
    assert p.__dict__ == type(p)(**resolve("sparsity", smoke)).__dict__
    resolved = tmp_path / "sparsity.yaml"
    resolved.write_text(yaml.safe_dump(resolve("sparsity", {**PARAMS, "base": {**PARAMS["base"], "profile": "cpu"}})))
    assert load("sparsity", resolved).profile == "cpu"
    assert load("sparsity", resolved, device="cpu").device == "cpu"
