"""``hf:`` specs (lowmem.cli.hf): transformers models from their config classes, with their heads' losses and LoRA,
accounted against the real step on this CPU. Small configs keep the suite short; full sizes belong in a notebook."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lowmem.cli import hf, models
from lowmem.cli.main import main
from lowmem.cli.models import SpecError
from lowmem.cli.profile import Request, account, measure
from lowmem.techniques.step import Techniques

pytest.importorskip("transformers")
pytest.importorskip("peft")

F32 = 4
GOAL_PCT = 2.0  # the accountant's goal against the measured CPU peak, as for every other model family
TINY = {  # each family at a few layers and a small width: the same code paths as the full model
    "gpt2": "hf:gpt2,n_layer=2,n_embd=64,n_head=4,vocab_size=1000,n_positions=128",
    "bert": "hf:bert,num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=1000",
    "t5": "hf:t5,num_layers=2,num_decoder_layers=2,d_model=64,d_kv=16,num_heads=4,d_ff=128,vocab_size=1000",
    "llama": "hf:llama,num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
             "intermediate_size=128,vocab_size=1000",
}
LORA = {"gpt2": "c_attn", "bert": "query+value", "t5": "q+v", "llama": "q_proj+v_proj"}


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_account_is_the_measured_cpu_peak(family: str, lora: bool) -> None:
    spec = TINY[family] + (f",lora_r=4,lora_targets={LORA[family]}" if lora else "")
    report, _ = measure(Request(spec, 2, (16,), "adamw"))
    print(f"{family}{' LoRA' if lora else ''}: accounted {report.peak}, measured {report.measured_peak}, gap {report.gap_pct:+.3f}%")
    assert abs(report.gap_pct) <= GOAL_PCT


@pytest.mark.parametrize("family", sorted(TINY))
def test_lora_leaves_gradients_and_adamw_state_to_the_adapters_alone(family: str) -> None:
    """From first principles: r x (in + out) weights per adapted linear layer, one fp32 gradient each, and AdamW's
    two moments plus an fp32 step count per adapter tensor."""
    spec = TINY[family] + f",lora_r=4,lora_targets={LORA[family]}"
    model = models.build(models.parse(spec), "meta")
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    adapted = [m for n, m in model.named_modules() if n.endswith(tuple(LORA[family].split("+"))) and hasattr(m, "lora_A")]
    weights = sum(4 * (m.lora_A["default"].in_features + m.lora_B["default"].out_features) for m in adapted)
    assert sum(p.numel() for p in adapters) == weights
    r = account(Request(spec, 2, (16,), "adamw"))
    assert r.category_max["gradients"] == weights * F32
    assert r.category_max["optimizer"] == 2 * weights * F32 + len(adapters) * F32


def test_the_causal_lm_step_takes_transformers_own_shifted_loss() -> None:
    """The head's logits against the next tokens give the loss transformers computes from labels."""
    name = TINY["llama"].removeprefix("hf:")
    make, vocab = hf.factory(name), hf.config(name)[0].vocab_size
    torch.manual_seed(0)
    head = make()
    ids = torch.randint(0, vocab, (2, 12))
    ours = F.cross_entropy(head(ids).movedim(-1, 1), ids[:, 1:])
    theirs = head.model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(("family", "head"), [("gpt2", "causal-lm"), ("llama", "causal-lm"), ("bert", "masked-lm"),
                                             ("t5", "seq2seq-lm")])
def test_each_family_has_its_stated_default_head(family: str, head: str) -> None:
    cfg, _ = hf.config(family)
    assert hf.default_head(cfg) == head


def test_another_head_is_accounted_as_measured() -> None:
    """A decoder's classifier: the last token's logits over two labels, no vocabulary-wide logits."""
    report, _ = measure(Request(TINY["gpt2"] + ",head=sequence-classification", 4, (32,), "adamw"))
    lm = account(Request(TINY["gpt2"], 4, (32,), "adamw"))
    assert abs(report.gap_pct) <= GOAL_PCT and report.peak < lm.peak


@pytest.mark.parametrize(("spec", "says"), [
    ("hf:meta-llama/Llama-3.2-1B", "a hub id"),
    ("hf:nosuchmodel", "not a model type"),
    ("hf:gpt2,n_layers=2", "no config key 'n_layers'"),
    ("hf:gpt2,n_layer=two", "'two' is not a int"),
    ("hf:llama,lora_r=4,lora_targets=q_proj+nothing", "match no layer with weights"),
    ("hf:gpt2,head=regression", "not one of"),
    ("hf:gpt2,lora_r=four", "LoRA's rank and alpha are numbers: lora_r=four"),
])
def test_bad_specs_say_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(SpecError, match=says):
        models.build(models.parse(spec), "meta")


def test_a_length_above_the_position_limit_is_refused_with_the_limit() -> None:
    with pytest.raises(SpecError, match="limit of 128 positions"):
        Request(TINY["gpt2"], 1, (129,), "adamw")


def test_the_cli_writes_its_options_into_the_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "hf:llama", "--config", "num_hidden_layers=1", "--config", "hidden_size=32",
                 "--config", "num_attention_heads=2", "--config", "num_key_value_heads=1", "--config", "intermediate_size=64",
                 "--config", "vocab_size=500", "--lora-r", "2", "--lora-targets", "q_proj", "--batch", "2", "--input", "16",
                 "--optimizer", "adamw", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"model": "hf:llama,num_hidden_layers=1,hidden_size=32' in out and "lora_r=2,lora_targets=q_proj" in out
    assert main(["profile", "wrn:wrn-10-1", "--head", "causal-lm", "--input", "3x32x32"]) == 2


def test_other_models_do_not_import_transformers() -> None:
    code = ("import sys; from lowmem.cli.profile import Request; "
            "Request('wrn:wrn-10-1', 2, (3, 32, 32)); print('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_checkpointing_is_accounted_as_measured_and_lowers_the_peak(family: str) -> None:
    req = Request(TINY[family] + f",lora_r=4,lora_targets={LORA[family]}", 4, (64,), "adamw")
    report, _ = measure(req, Techniques(checkpoint="block"))
    print(f"{family} LoRA + checkpointing: accounted {report.peak}, measured {report.measured_peak}, gap {report.gap_pct:+.3f}%")
    assert abs(report.gap_pct) <= GOAL_PCT
    assert report.category_max["activations"] < account(req).category_max["activations"]
    with pytest.raises(SpecError, match="use checkpoint-block"):
        account(req, Techniques(checkpoint="sqrt"))


def test_the_plan_checkpoints_a_transformers_models_layers_and_borrows_no_measured_risk() -> None:
    from lowmem.cli import plan

    req = Request(TINY["llama"], 4, (64,), "adamw")
    plain = account(req).peak
    levers = plan.Levers(precision=("fp32", "half-bf16"), activation_bits=(0,), optimizer_state=("given",), step=("plain",),
                         microbatch_steps=1)
    p = plan.make_plan(req, plain - 1, levers=levers, progress=False)
    layers = p.rows[p.rows.checkpoint == "layers"]
    fp32 = layers[layers.precision == "fp32"].iloc[0]
    assert fp32.peak_bytes == account(req, Techniques(checkpoint="block")).peak < plain
    assert fp32.time > 1 and fp32.quality_risk == "exact" and "gradient_checkpointing_enable" in fp32.how_to_apply
    bf16 = p.rows[p.rows.precision == "half-bf16"]
    assert len(bf16) and bf16.predicted_change.isna().all() and (bf16.quality_risk == "precision=half-bf16: unmeasured").all()


def test_a_local_config_json_or_its_folder_builds_that_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, '
                                          '"vocab_size": 100, "n_positions": 64}')
    for spec in (f"hf:{tmp_path / 'config.json'}", f"hf:{tmp_path},n_layer=3"):
        model = models.build(models.parse(spec), "meta")
        gpt2 = next(m for m in model.modules() if type(m).__name__ == "GPT2Model")
        assert tuple(gpt2.wte.weight.shape) == (100, 32) and len(gpt2.h) == (3 if spec.endswith("=3") else 1)
    with pytest.raises(SpecError, match="limit of 64 positions"):
        Request(f"hf:{tmp_path}", 1, (65,), "adamw")
