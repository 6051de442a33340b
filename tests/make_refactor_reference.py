"""Writes a JSON of smoke-size WRN runs of every lever a refactoring touched (the merged
model builder, DSR, the sparse-method and norm registries), trained by the code of the checkout it runs in.

    git worktree add /tmp/before <commit before the refactoring>
    cd /tmp/before && PYTHONPATH=/tmp/before python /work/main/tests/make_refactor_reference.py OUT.json [--cpu DATA | --registry]

tests/test_refactor_reproduces.py trains the same runs with today's code and asserts the same metrics, bit for bit.
It reads both layouts (flat lowmem/ before the subpackages, and after). ``--cpu DATA`` trains the same levers at the
cpu profile's size instead (params.yaml's baseline block: WRN-16-1, 10k/5k Fashion-MNIST, 3 epochs at batch 32;
DATA is a data_root both checkouts share): run it in both checkouts on one machine and compare the two files (bits
differ across CPUs, so a reference written elsewhere proves nothing). ``--registry`` trains the optimizer levers that
the lever registry's change touched (``REGISTRY``) at the smoke size.
"""

import json
import sys
import tempfile
from pathlib import Path

try:  # the subpackage layout
    from lowmem.wrn.params import BaselineParams
    from lowmem.wrn.train import Techniques, train
except ImportError:  # the flat layout before it
    from lowmem.config import BaselineParams  # type: ignore[no-redef]
    from lowmem.train import Techniques, train  # type: ignore[no-redef]

BASE = {"dataset": "synthetic", "model": "wrn-10-1", "epochs": 2, "batch_size": 32, "train_subset": 128,
        "test_subset": 64, "device": "cpu"}
CONFIGS = {
    "baseline": {},
    "dsr-0.9": {"sparsity": 0.9, "dsr_periods": (2, 2, 2, 2)},
    "static-0.9": {"sparsity": 0.9, "sparse_method": "static"},
    "half-bf16": {"precision": "half-bf16"},
    "mb8-group": {"microbatch": 8, "norm": "group"},
    "mb8-renorm": {"microbatch": 8, "norm": "renorm"},
}
# The lever registry (lowmem.techniques.registry): the WRN trainer takes its optimizer from the lever that declares it.
REGISTRY = {
    "baseline": {},
    "optimi-sgd": {"optimizer": "optimi-sgd"},
    "half-bf16+optimi-sgd": {"precision": "half-bf16", "optimizer": "optimi-sgd"},
    "bnb-sgd8bit": {"optimizer": "bnb-sgd8bit"},
    "activations-8": {"activation_bits": 8},
}
# The cpu profile's training size, as params.yaml's baseline block resolves it at cpu (one seed).
CPU = {"dataset": "fashion-mnist", "augment": False, "model": "wrn-16-1", "epochs": 3, "batch_size": 32,
       "train_subset": 10000, "test_subset": 5000, "device": "cpu"}
# What a run measures about the machine, not what it computes.
TIMING = ("images_per_s", "step_s", "epoch_s", "peak_mem_mib", "peak_mem_method")


def histories(root: Path, base: dict = BASE, configs: dict = CONFIGS) -> dict[str, list[dict]]:
    p = BaselineParams(**base)
    out = {}
    for name, tech in configs.items():
        rows = train(p, 0, Techniques(**tech), progress=False, root=root)
        out[name] = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    return out


if __name__ == "__main__":
    base = {**CPU, "data_root": sys.argv[3]} if sys.argv[2:3] == ["--cpu"] else BASE
    configs = REGISTRY if sys.argv[2:3] == ["--registry"] else CONFIGS
    with tempfile.TemporaryDirectory() as tmp:
        Path(sys.argv[1]).write_text(json.dumps(histories(Path(tmp), base, configs), indent=1) + "\n")
