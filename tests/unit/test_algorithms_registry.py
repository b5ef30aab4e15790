"""Registry lookups by name, and the algorithms package importing nothing but torch and the stdlib."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import m2flow.algorithms as alg
from m2flow.algorithms import (ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, get_advantage_fn,
                               get_kl_estimator, get_policy_loss)

PKG = pathlib.Path(alg.__file__).parent


def test_registry_names_and_lookup():
    assert set(ADVANTAGES) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "embodied_grpo"}
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "mse", "k3", "low_var_kl"}
    assert get_advantage_fn("gae") is alg.gae
    assert get_policy_loss("ppo") is alg.policy_loss
    assert get_kl_estimator("mse") is alg.kl_k2
    # every reasoning estimator takes (scores, mask, groups) and returns mask-shaped advantages
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        adv = get_advantage_fn(name)(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.ones(4, 3), 2)
        assert adv.shape == (4, 3) and torch.isfinite(adv).all()
    loss, metrics = get_policy_loss("gspo")(torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3),
                                            torch.ones(2, 3), torch.ones(2, 3))
    assert loss.dim() == 0 and "clipfrac_high" in metrics


@pytest.mark.parametrize("getter,kind,valid", [
    (get_advantage_fn, "advantage estimator", "dr_grpo, embodied_grpo, gae, grpo, reinforce_pp, rloo"),
    (get_policy_loss, "policy loss", "gspo, ppo"),
    (get_kl_estimator, "KL estimator", "k1, k2, k3, low_var_kl, mse"),
])
def test_unknown_name_lists_valid_names(getter, kind, valid):
    with pytest.raises(ValueError) as e:
        getter("nope")
    assert str(e.value) == f"unknown {kind} 'nope'; valid: {valid}"


def test_imports_parse_to_torch_stdlib_and_own_package_only():
    allowed = set(sys.stdlib_module_names) | {"torch"}
    for path in sorted(PKG.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    continue                                  # a sibling module of this package
                assert node.level == 0, f"{path.name}: relative import leaves the package"
                roots = [node.module.split(".")[0]]
            else:
                continue
            bad = [r for r in roots if r not in allowed]
            assert not bad, f"{path.name} imports {bad}: algorithms may import only torch and the stdlib"


def test_importing_the_package_loads_no_third_party_module_beyond_torch():
    code = (
        "import sys, json\n"
        "import torch\n"
        "before = set(sys.modules)\n"
        "import m2flow.algorithms\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    new = json.loads(out.stdout.strip().splitlines()[-1])
    stdlib = set(sys.stdlib_module_names)
    bad = [m for m in new if m.split(".")[0] not in stdlib | {"torch"}
           and m not in ("m2flow", "m2flow.algorithms") and not m.startswith("m2flow.algorithms.")]
    assert not bad, f"importing m2flow.algorithms loaded {bad}"
