import pytest
import torch
from torch import nn

from lowmem.wrn.models import build_model, parse_model_name


def wrn_params_from_first_principles(depth: int, k: int, in_ch: int, classes: int) -> int:
    """Convs without bias, BN with weight and bias, 1x1 shortcut where width or stride changes, final BN + Linear."""
    n = (depth - 4) // 6
    widths = [16, 16 * k, 32 * k, 64 * k]
    total = 9 * in_ch * widths[0]  # stem conv
    for s in range(3):
        for i in range(n):
            cin, cout = (widths[s] if i == 0 else widths[s + 1]), widths[s + 1]
            total += 2 * cin + 9 * cin * cout + 2 * cout + 9 * cout * cout
            if cin != cout or (i == 0 and s > 0):
                total += cin * cout
    return total + 2 * widths[3] + widths[3] * classes + classes


def count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_wrn_28_2_has_the_published_parameter_count() -> None:
    m = build_model("wrn-28-2")
    assert count(m) == wrn_params_from_first_principles(28, 2, 3, 10)
    assert count(m) == 1_467_610  # paper notes [computed]; the acceptance value


@pytest.mark.parametrize("name,in_ch,classes", [("wrn-16-2", 1, 10), ("wrn-28-2", 1, 10), ("wrn-22-4", 3, 100), ("wrn-10-1", 3, 7)])
def test_depth_width_channels_and_classes_are_parameters(name: str, in_ch: int, classes: int) -> None:
    depth, k = parse_model_name(name)
    with torch.device("meta"):
        m = build_model(name, num_classes=classes, in_channels=in_ch)
    assert count(m) == wrn_params_from_first_principles(depth, k, in_ch, classes)
    out = m(torch.empty(2, in_ch, 32, 32, device="meta"))
    assert out.shape == (2, classes)


def test_3x3_block_convs_hold_almost_all_weights() -> None:
    m = build_model("wrn-28-2")
    block3x3 = sum(
        mod.weight.numel() for name, mod in m.named_modules() if isinstance(mod, nn.Conv2d) and mod.kernel_size == (3, 3) and name.startswith("blocks")
    )
    n = (28 - 4) // 6
    widths = [16, 32, 64, 128]
    expected = sum(9 * ((widths[s] if i == 0 else widths[s + 1]) + widths[s + 1]) * widths[s + 1] for s in range(3) for i in range(n))
    assert block3x3 == expected
    assert 0.985 < block3x3 / count(m) < 0.995


@pytest.mark.parametrize("bad", ["resnet-18", "wrn-27-2", "wrn-28", "wrn-28-0", "wrn-4-2"])
def test_bad_model_names_say_what_is_allowed(bad: str) -> None:
    with pytest.raises(ValueError, match="wrn-"):
        build_model(bad)
