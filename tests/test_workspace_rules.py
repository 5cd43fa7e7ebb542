from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tools.check_workspace import (
    ORACLE_HOME,
    QUANTILE_HOME,
    check_single_copies,
    check_workspace,
    find_members,
)

ROOT = Path(__file__).resolve().parent.parent


def test_the_repository_obeys_the_dependency_rule() -> None:
    assert check_workspace(ROOT) == []
    assert {m.dist for m in find_members(ROOT)} == {
        "kv-protocol",
        "kv-caches",
        "kv-pool",
        "kv-metal-kernels",
        "kv-batching",
        "kv-testing",
        "kv-serve",
    }
    assert [m.dist for m in find_members(ROOT) if m.test_support] == ["kv-testing"]
    assert [m.dist for m in find_members(ROOT) if m.composition_root] == ["kv-serve"]


def test_only_the_composition_root_may_wire_siblings(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    wiring = (
        "from kv_pool import HybridKVPool\nfrom kv_batching import DecodeEngine\nimport mlx_lm\n"
    )
    (ws / "packages" / "kv-serve" / "src" / "kv_serve" / "_engine.py").write_text(wiring)
    assert check_workspace(ws) == []
    (ws / "packages" / "kv-serve" / "src" / "kv_serve" / "_t.py").write_text("import kv_testing\n")
    assert check_workspace(ws) == [
        "packages/kv-serve/src/kv_serve/_t.py: imports sibling package 'kv_testing'"
    ]
    (ws / "packages" / "kv-serve" / "src" / "kv_serve" / "_t.py").unlink()
    pyproject = ws / "packages" / "kv-serve" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"numpy>=2",', '"numpy>=2", "kv-testing",'))
    problems = check_workspace(ws)
    assert any("depends at run time on test-support member kv-testing" in p for p in problems)
    (ws / "packages" / "kv-pool" / "src" / "kv_pool" / "_x.py").write_text(wiring)
    assert any(
        "kv_pool/_x.py: imports sibling package 'kv_batching'" in p for p in check_workspace(ws)
    )


def _copy_skeleton(tmp_path: Path) -> Path:
    dest = tmp_path / "ws"
    dest.mkdir()
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for member in find_members(ROOT):
        target = dest / "packages" / member.root.name
        (target / "src" / member.import_name).mkdir(parents=True)
        shutil.copy(member.root / "pyproject.toml", target / "pyproject.toml")
        (target / "src" / member.import_name / "__init__.py").write_text("import mlx.core\n")
    return dest


def test_sibling_and_mlx_lm_imports_are_reported(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    assert check_workspace(ws) == []
    bad = ws / "packages" / "kv-batching" / "src" / "kv_batching" / "_engine.py"
    bad.write_text("from kv_pool import HybridKVPool\nimport mlx_lm.models.cache\n")
    problems = check_workspace(ws)
    assert any("imports sibling package 'kv_pool'" in p for p in problems)
    assert any("imports 'mlx_lm'" in p for p in problems)


def test_version_ranges_must_admit_the_members_version(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    pyproject = ws / "packages" / "kv-pool" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("kv-protocol>=0.1.0,<0.2", "kv-protocol>=9"))
    problems = check_workspace(ws)
    assert problems == ["kv-pool: requires kv-protocol>=9 but the workspace has kv-protocol 0.1.0"]


def test_sibling_dependency_and_missing_mlx_are_reported(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    pyproject = ws / "packages" / "kv-caches" / "pyproject.toml"
    text = pyproject.read_text().replace('"mlx>=0.32.4",', '"kv-pool>=0.1,<0.2", "mlx-lm",')
    pyproject.write_text(text)
    problems = check_workspace(ws)
    assert "kv-caches: depends on sibling kv-pool" in problems
    assert "kv-caches: does not declare its run-time dependency on mlx" in problems
    assert "kv-caches: declares mlx_lm as a run-time dependency" in problems


def test_the_check_runs_as_a_script() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_workspace.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = "rule holds for 7 members (5 toolkit, 1 composition root, 1 test support)"
    assert summary in result.stdout


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def test_test_support_member_is_allowed_in_dev_groups_only(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    support = ws / "packages" / "kv-testing" / "src" / "kv_testing" / "__init__.py"
    support.write_text("import mlx.core\nfrom mlx_lm.models import llama\n")
    # The skeleton already lists kv-testing in member dev groups, and kv-testing uses mlx-lm.
    assert check_workspace(ws) == []
    kv_pool = ws / "packages" / "kv-pool" / "pyproject.toml"
    _edit(kv_pool, '"mlx>=0.32.4",', '"mlx>=0.32.4", "kv-testing",')
    _edit(
        kv_pool,
        "[project.optional-dependencies]\n",
        '[project.optional-dependencies]\nx = ["kv-testing"]\n',
    )
    problems = check_workspace(ws)
    assert problems == [
        "kv-pool: depends at run time on test-support member kv-testing (list it in the dev "
        "dependency group)",
        "kv-pool: an extra depends on test-support member kv-testing",
    ]


def test_test_support_member_must_be_private_and_in_the_root_dev_group(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    _edit(ws / "packages" / "kv-testing" / "pyproject.toml", '"Private :: Do Not Upload"', "")
    _edit(ws / "pyproject.toml", '    "kv-testing",\n', "")
    assert check_workspace(ws) == [
        "kv-testing: a test-support member must be marked Private :: Do Not Upload",
        "workspace root's dev group does not include test-support member kv-testing",
    ]


def test_member_tests_import_only_what_the_member_declares(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    tests = ws / "packages" / "kv-pool" / "tests"
    tests.mkdir()
    (tests / "test_ok.py").write_text("import kv_pool\nfrom kv_protocol import LayerKind\n")
    assert check_workspace(ws) == []
    (tests / "test_bad.py").write_text(
        "from tools.reference import first_divergence\nfrom kv_testing import build_tiny_model\n"
    )
    assert check_workspace(ws) == [
        "packages/kv-pool/tests/test_bad.py: imports 'tools' from the repository root; a "
        "member's tests use only its dependencies (test support belongs in a test-support "
        "member)",
        "packages/kv-pool/tests/test_bad.py: imports 'kv_testing' but kv-pool lists kv-testing "
        "neither as a dependency nor in its dev dependency group",
    ]
    # Listing it in the dev group is what makes the kv_testing import legitimate.
    _edit(
        ws / "packages" / "kv-pool" / "pyproject.toml", '"numpy>=2",', '"numpy>=2", "kv-testing",'
    )
    assert len(check_workspace(ws)) == 1


def test_the_repository_has_one_quantile_rule_and_one_greedy_oracle() -> None:
    assert check_single_copies(ROOT) == []
    assert (ROOT / QUANTILE_HOME).is_file() and (ROOT / ORACLE_HOME).is_file()


SECOND_QUANTILES = {
    "tools/bench_x.py": (
        "def p99(values):\n"
        "    ordered = sorted(values)\n"
        "    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]\n"
    ),
    "tests/test_x.py": "import statistics\n\ndef test_x():\n    statistics.median([1.0])\n",
    "packages/kv-pool/src/kv_pool/_stats.py": "def step_percentile(xs, q):\n    return xs\n",
    "conftest.py": "from numpy import percentile\n",
    "tools/bench_y.py": "def mid(xs):\n    return sorted(xs)[len(xs) // 2]\n",
}


def test_a_second_quantile_rule_is_reported(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    # The home of the rule may define it; ordinary uses of sorted() are not a rank.
    (ws / "tools").mkdir()
    (ws / QUANTILE_HOME).write_text(
        "import math\n\ndef quantile(values, q):\n"
        "    ordered = sorted(values)\n"
        "    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]\n"
    )
    (ws / "tools" / "ok.py").write_text(
        "from tools.harness import quantile\n\n"
        "def worst(xs):\n    return sorted(xs)[-1], sorted(xs)[: len(xs) // 2], quantile(xs, 0.5)\n"
    )
    assert check_workspace(ws) == []
    (ws / "tests").mkdir()
    for rel, source in SECOND_QUANTILES.items():
        (ws / rel).write_text(source)
    problems = check_workspace(ws)
    assert problems == [
        "conftest.py:1: imports numpy.percentile; use tools.harness.quantile (the one quantile "
        "rule)",
        "tools/bench_x.py:3: indexes a sorted sequence at a computed rank "
        "(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]); use tools.harness.quantile "
        "(the one quantile rule)",
        "tools/bench_y.py:2: indexes a sorted sequence at a computed rank "
        "(sorted(xs)[len(xs) // 2]); use tools.harness.quantile (the one quantile rule)",
        "tests/test_x.py:4: calls statistics.median(); use tools.harness.quantile (the one "
        "quantile rule)",
        "packages/kv-pool/src/kv_pool/_stats.py:1: defines step_percentile(); use "
        "tools.harness.quantile (the one quantile rule)",
    ]


GREEDY_LOOP = (
    "    cache = make_prompt_cache(model)\n"
    "    logits = model(mx.array([prompt]), cache=cache)\n"
    "    out = []\n"
    "    for _ in range(n):\n"
    "        out.append(int(mx.argmax(logits[0, -1])))\n"
    "        logits = model(mx.array([[out[-1]]]), cache=cache)\n"
)


def test_a_second_greedy_oracle_is_reported(tmp_path: Path) -> None:
    ws = _copy_skeleton(tmp_path)
    home = ws / ORACLE_HOME
    home.write_text(f"def mlx_lm_greedy(model, prompt, n):\n{GREEDY_LOOP}    return out\n")
    tests = ws / "tests"
    tests.mkdir()
    # A test may drive the model inline (a lockstep comparison), also in a nested helper.
    (tests / "test_lockstep.py").write_text(
        f"def test_lockstep(model, prompt, n):\n{GREEDY_LOOP}\n"
        "    def tokens(caches):\n"
        "        return list(generate_step(prompt, model, prompt_cache=caches))\n"
    )
    assert check_workspace(ws) == []
    (tests / "helpers.py").write_text(
        f"def mlx_lm_alone(model, prompt, n):\n{GREEDY_LOOP}    return out\n"
    )
    (ws / "packages" / "kv-serve" / "tests").mkdir()
    (ws / "packages" / "kv-serve" / "tests" / "test_y.py").write_text(
        "from mlx_lm.generate import generate_step\n\n"
        "def reference(model, prompt):\n"
        "    return [t for t, _ in generate_step(prompt, model, max_tokens=8)]\n"
    )
    # The product may decode (a draft model's proposals); test support may not.
    product = ws / "packages" / "kv-serve" / "src" / "kv_serve"
    product.mkdir(parents=True, exist_ok=True)
    (product / "_draft.py").write_text(f"def propose(model, prompt, n):\n{GREEDY_LOOP}")
    use = "use kv_testing.mlx_lm_greedy (the one mlx-lm greedy oracle)"
    assert check_workspace(ws) == [
        "tests/helpers.py:1: mlx_lm_alone() decodes greedily (an argmax in a loop that calls a "
        f"model with cache=); {use}",
        f"packages/kv-serve/tests/test_y.py:3: reference() calls mlx-lm's generate_step; {use}",
    ]
