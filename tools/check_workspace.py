"""Check the workspace's dependency rule.

The rule: every toolkit package depends at run time on ``mlx`` and ``kv-protocol`` and on no
sibling, so the packages meet only where they are wired (in ``tools/``, ``tests/`` and the
user's code), and mlx-lm is never a run-time dependency of a toolkit package. Test support
lives in its own member, which the others use from their ``dev`` dependency group only.

Checked:

- No toolkit package's source imports a sibling package other than ``kv_protocol``, and none
  imports mlx-lm.
- Every member declares ``mlx`` and declares no sibling except ``kv-protocol``; a declared
  inter-member version range must admit the member's current version.
- A test-support member (``kv-testing``) may depend on mlx-lm; it may appear in a member's
  ``dev`` dependency group, never among a toolkit package's run-time dependencies or extras,
  and it is marked ``Private :: Do Not Upload``.
- A member's tests import nothing from ``tools`` (the repository root is not on their path) and
  no sibling the member does not declare (as a dependency or in its ``dev`` group), so
  ``uv run --package X pytest packages/X`` needs only that member's dependencies.
- The workspace root depends on every toolkit member, and on every test-support member in its
  ``dev`` dependency group.
- The composition root (``kv-serve``) is the one exception to the sibling rule: it may import
  and depend on every toolkit member and on mlx-lm (with version ranges that admit the
  members' versions), but never on a test-support member at run time.

Run ``uv run python tools/check_workspace.py``; exits non-zero and lists each violation.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

__all__ = [
    "COMPOSITION_ROOTS",
    "TEST_SUPPORT_MEMBERS",
    "Member",
    "check_workspace",
    "find_members",
    "main",
]

ALLOWED_SHARED_IMPORT = "kv_protocol"
FORBIDDEN_RUNTIME_IMPORTS = ("mlx_lm",)
#: Members that hold test support (model builders for tests), not toolkit code.
TEST_SUPPORT_MEMBERS = frozenset({"kv-testing"})
#: Members that wire the toolkit together (may depend on every toolkit member and mlx-lm).
COMPOSITION_ROOTS = frozenset({"kv-serve"})
PRIVATE_CLASSIFIER = "Private :: Do Not Upload"
#: Top-level modules of the repository root that members' tests must not import.
ROOT_ONLY_IMPORTS = ("tools",)


@dataclass(frozen=True, kw_only=True)
class Member:
    """One workspace member: distribution name, import name, version, declared requirements."""

    dist: str
    import_name: str
    version: str
    root: Path
    requirements: tuple[Requirement, ...]
    optional_requirements: tuple[Requirement, ...] = ()
    dev_requirements: tuple[Requirement, ...] = ()
    classifiers: tuple[str, ...] = ()

    @property
    def test_support(self) -> bool:
        """True for a test-support member (allowed in dev groups only)."""
        return self.dist in TEST_SUPPORT_MEMBERS

    @property
    def composition_root(self) -> bool:
        """True for the member that wires the toolkit (may use every sibling and mlx-lm)."""
        return self.dist in COMPOSITION_ROOTS


def _requirements(entries: Iterable[Any]) -> tuple[Requirement, ...]:
    # Dependency groups may hold ``{include-group = ...}`` tables besides requirement strings.
    return tuple(Requirement(entry) for entry in entries if isinstance(entry, str))


def find_members(root: Path) -> list[Member]:
    """Every member under ``packages/`` with its pyproject metadata."""
    members = []
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        dist = str(project["name"])
        extras = project.get("optional-dependencies", {})
        members.append(
            Member(
                dist=dist,
                import_name=dist.replace("-", "_"),
                version=str(project["version"]),
                root=pyproject.parent,
                requirements=_requirements(project.get("dependencies", [])),
                optional_requirements=_requirements(r for rs in extras.values() for r in rs),
                dev_requirements=_requirements(data.get("dependency-groups", {}).get("dev", [])),
                classifiers=tuple(str(c) for c in project.get("classifiers", [])),
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


def _check_sources(root: Path, member: Member, by_import: dict[str, Member]) -> list[str]:
    problems: list[str] = []
    import_names = set(by_import)
    for source in sorted((member.root / "src").rglob("*.py")):
        rel = source.relative_to(root)
        for name in sorted(_imported_top_levels(source)):
            sibling = by_import.get(name)
            if (
                sibling is not None
                and name not in (member.import_name, ALLOWED_SHARED_IMPORT)
                and not (member.composition_root and not sibling.test_support)
            ):
                problems.append(f"{rel}: imports sibling package {name!r}")
            if name in FORBIDDEN_RUNTIME_IMPORTS and not (
                member.test_support or member.composition_root
            ):
                problems.append(f"{rel}: imports {name!r}, which is not a run-time dependency")
    available = {r.name for r in (*member.requirements, *member.dev_requirements)}
    for source in sorted((member.root / "tests").rglob("*.py")):
        rel = source.relative_to(root)
        imported = _imported_top_levels(source)
        for name in sorted(imported & set(ROOT_ONLY_IMPORTS)):
            problems.append(
                f"{rel}: imports {name!r} from the repository root; a member's tests use only "
                "its dependencies (test support belongs in a test-support member)"
            )
        for name in sorted(imported & import_names):
            sibling = by_import[name]
            if sibling is not member and sibling.dist not in available:
                problems.append(
                    f"{rel}: imports {name!r} but {member.dist} lists {sibling.dist} neither as a "
                    "dependency nor in its dev dependency group"
                )
    return problems


def _check_declared(member: Member, by_dist: dict[str, Member]) -> list[str]:
    problems: list[str] = []
    declared = {req.name: req for req in member.requirements}
    if "mlx" not in declared:
        problems.append(f"{member.dist}: does not declare its run-time dependency on mlx")
    if not (member.test_support or member.composition_root):
        for name in FORBIDDEN_RUNTIME_IMPORTS:
            if name.replace("_", "-") in declared:
                problems.append(f"{member.dist}: declares {name} as a run-time dependency")
    for name, req in declared.items():
        sibling = by_dist.get(name)
        if sibling is None:
            continue
        if sibling.test_support:
            problems.append(
                f"{member.dist}: depends at run time on test-support member {name} "
                "(list it in the dev dependency group)"
            )
            continue
        if name != ALLOWED_SHARED_IMPORT.replace("_", "-") and not member.composition_root:
            problems.append(f"{member.dist}: depends on sibling {name}")
        if not str(req.specifier):
            problems.append(f"{member.dist}: dependency on {name} has no version range")
        elif not req.specifier.contains(sibling.version, prereleases=True):
            problems.append(
                f"{member.dist}: requires {name}{req.specifier} but the workspace has "
                f"{name} {sibling.version}"
            )
    for req in member.optional_requirements:
        sibling = by_dist.get(req.name)
        if sibling is not None and sibling.test_support:
            problems.append(f"{member.dist}: an extra depends on test-support member {req.name}")
    if member.test_support and PRIVATE_CLASSIFIER not in member.classifiers:
        problems.append(f"{member.dist}: a test-support member must be marked {PRIVATE_CLASSIFIER}")
    return problems


def check_workspace(root: Path) -> list[str]:
    """All violations of the dependency rule under ``root`` (empty when the rule holds)."""
    members = find_members(root)
    by_dist = {m.dist: m for m in members}
    by_import = {m.import_name: m for m in members}
    problems: list[str] = []
    for member in members:
        problems += _check_sources(root, member, by_import)
        problems += _check_declared(member, by_dist)
    root_data = tomllib.loads((root / "pyproject.toml").read_text())
    root_deps = {r.name for r in _requirements(root_data["project"].get("dependencies", []))}
    root_dev = {
        r.name for r in _requirements(root_data.get("dependency-groups", {}).get("dev", []))
    }
    for member in members:
        if member.test_support:
            if member.dist not in root_dev:
                problems.append(
                    f"workspace root's dev group does not include test-support member {member.dist}"
                )
        elif member.dist not in root_deps:
            problems.append(f"workspace root does not depend on member {member.dist}")
    return problems


def main() -> int:
    """Print the violations under the repository root; the exit status is their count (capped)."""
    root = Path(__file__).resolve().parent.parent
    problems = check_workspace(root)
    for problem in problems:
        print(problem)
    if not problems:
        members = find_members(root)
        support = sum(m.test_support for m in members)
        roots = sum(m.composition_root for m in members)
        print(
            f"workspace dependency rule holds for {len(members)} members "
            f"({len(members) - support - roots} toolkit, {roots} composition root, "
            f"{support} test support)"
        )
    return min(len(problems), 100)


if __name__ == "__main__":
    sys.exit(main())
