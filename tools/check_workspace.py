"""Check the workspace's dependency rule (DESIGN.md section 2).

- No package imports a sibling package other than ``kv_protocol``, and none imports mlx-lm.
- Every member declares ``mlx`` and declares no sibling except ``kv-protocol``; a declared
  inter-member version range must admit the member's current version.
- The workspace root depends on every member.

Run ``uv run python tools/check_workspace.py``; exits non-zero and lists each violation.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

__all__ = ["Member", "check_workspace", "find_members", "main"]

ALLOWED_SHARED_IMPORT = "kv_protocol"
FORBIDDEN_RUNTIME_IMPORTS = ("mlx_lm",)


@dataclass(frozen=True, kw_only=True)
class Member:
    """One workspace member: distribution name, import name, version, declared requirements."""

    dist: str
    import_name: str
    version: str
    root: Path
    requirements: tuple[Requirement, ...]


def find_members(root: Path) -> list[Member]:
    """Every member under ``packages/`` with its pyproject metadata."""
    members = []
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        dist = str(project["name"])
        members.append(
            Member(
                dist=dist,
                import_name=dist.replace("-", "_"),
                version=str(project["version"]),
                root=pyproject.parent,
                requirements=tuple(Requirement(r) for r in project.get("dependencies", [])),
            )
        )
    return members


def _imported_top_levels(source: Path) -> set[str]:
    tree = ast.parse(source.read_text(), filename=str(source))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def check_workspace(root: Path) -> list[str]:
    """All violations of the dependency rule under ``root`` (empty when the rule holds)."""
    members = find_members(root)
    by_dist = {m.dist: m for m in members}
    import_names = {m.import_name for m in members}
    problems: list[str] = []
    for member in members:
        for source in sorted((member.root / "src").rglob("*.py")):
            rel = source.relative_to(root)
            for name in sorted(_imported_top_levels(source)):
                if name in import_names and name not in (member.import_name, ALLOWED_SHARED_IMPORT):
                    problems.append(f"{rel}: imports sibling package {name!r}")
                if name in FORBIDDEN_RUNTIME_IMPORTS:
                    problems.append(f"{rel}: imports {name!r}, which is not a run-time dependency")
        declared = {req.name: req for req in member.requirements}
        if "mlx" not in declared:
            problems.append(f"{member.dist}: does not declare its run-time dependency on mlx")
        for name in FORBIDDEN_RUNTIME_IMPORTS:
            if name.replace("_", "-") in declared:
                problems.append(f"{member.dist}: declares {name} as a run-time dependency")
        for name, req in declared.items():
            sibling = by_dist.get(name)
            if sibling is None:
                continue
            if name != ALLOWED_SHARED_IMPORT.replace("_", "-"):
                problems.append(f"{member.dist}: depends on sibling {name}")
            if not str(req.specifier):
                problems.append(f"{member.dist}: dependency on {name} has no version range")
            elif not req.specifier.contains(sibling.version, prereleases=True):
                problems.append(
                    f"{member.dist}: requires {name}{req.specifier} but the workspace has "
                    f"{name} {sibling.version}"
                )
    root_project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    root_deps = {Requirement(r).name for r in root_project.get("dependencies", [])}
    for member in members:
        if member.dist not in root_deps:
            problems.append(f"workspace root does not depend on member {member.dist}")
    return problems


def main() -> int:
    """Print the violations under the repository root; the exit status is their count (capped)."""
    root = Path(__file__).resolve().parent.parent
    problems = check_workspace(root)
    for problem in problems:
        print(problem)
    if not problems:
        print(f"workspace dependency rule holds for {len(find_members(root))} members")
    return min(len(problems), 100)


if __name__ == "__main__":
    sys.exit(main())
