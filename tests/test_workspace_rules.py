from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tools.check_workspace import check_workspace, find_members

ROOT = Path(__file__).resolve().parent.parent


def test_the_repository_obeys_the_dependency_rule() -> None:
    assert check_workspace(ROOT) == []
    assert {m.dist for m in find_members(ROOT)} == {
        "kv-protocol",
        "kv-caches",
        "kv-pool",
        "kv-metal-kernels",
        "kv-batching",
    }


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
    assert "dependency rule holds for 5 members" in result.stdout
