"""Importing is cheap and honest: each check runs in a fresh interpreter and inspects ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded_after(code: str) -> set[str]:
    """Top-level package names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import omnibal_compile",
        "import omnibal_compile.planning",
        "import omnibal_compile.sim",
        "import omnibal_compile.ir.costs",
        "import omnibal_compile.ir.plan",
        "from omnibal_compile.planning import solve, problem_from_costs",
        "import omnibal_compile.planning.layout",
        "from omnibal_compile.cli import build_parser; build_parser()",  # what `omnibal-compile --help` runs
    ],
)
def test_torch_free_imports(code):
    loaded = _loaded_after(code)
    assert "torch" not in loaded, f"`{code}` imports torch"
    assert "networkx" not in loaded, f"`{code}` imports networkx"


def test_lazy_public_names_resolve():
    loaded = _loaded_after("import omnibal_compile as oc; oc.Plan; oc.simulate")
    assert "torch" not in loaded  # the plan and the simulator are torch-free
    loaded = _loaded_after("import omnibal_compile as oc; assert callable(oc.optimize)")
    assert "torch" in loaded


def test_devices_is_a_public_module_reachable_from_the_package():
    # The docs write oc.devices.A100_80G; it must resolve without importing torch.
    loaded = _loaded_after("import omnibal_compile as oc; assert oc.devices.A100_80G.name == 'a100-80gb'")
    assert "torch" not in loaded


def test_compiler_modules_do_not_import_networkx():
    # torch.export itself may load networkx while it traces; our modules load it only to draw graphs.
    loaded = _loaded_after(
        "import omnibal_compile.api, omnibal_compile.costs.annotate, omnibal_compile.compile.recompute, "
        "omnibal_compile.runtime.pipeline, omnibal_compile.cli.plan"
    )
    assert "networkx" not in loaded


def test_every_public_name_is_importable():
    import omnibal_compile as oc

    for name in oc.__all__:
        assert getattr(oc, name) is not None
    assert set(oc.__all__) <= set(dir(oc))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        oc.nope  # noqa: B018
