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

One copy of each measuring rule and of the oracle, anywhere in ``tools/``, ``tests/``,
``packages/`` and the root ``conftest.py`` (found by reading each file's syntax tree):

- The one quantile rule is ``tools/harness.py``'s ``quantile``. Elsewhere: no function
  named like ``*quantile*``, ``*percentile*`` or ``*median*`` (tests, ``test_*``, aside);
  no call of a library's ``median``, ``quantile(s)`` or ``percentile``
  (``statistics.median``, ``np.percentile``, ...) nor an import of one; no index into a
  sorted sequence computed with ``*``, ``/`` or ``//`` (a rank such as
  ``ordered[int(q * len(ordered))]``).
- The one mlx-lm greedy oracle is ``kv_testing.mlx_lm_greedy`` (``greedy_continue`` for a
  continuation), in ``packages/kv-testing/src/kv_testing/_oracle.py``. Elsewhere no helper
  function decodes greedily through a model: a loop that takes an ``argmax`` and calls
  something with ``cache=``, or a call of mlx-lm's ``generate_step`` / ``stream_generate``.
  Test functions (``test_*``, and functions defined inside one) may drive a model inline:
  a lockstep comparison of two cache implementations step by step is a test, not an oracle.
  The product's own sources (``packages/*/src`` of every member but the test support) may
  decode too: a draft model proposing tokens is a feature, not an oracle.

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
    "ORACLE_HOME",
    "QUANTILE_HOME",
    "TEST_SUPPORT_MEMBERS",
    "Member",
    "check_single_copies",
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
#: The file holding the one quantile rule, and the one holding the one greedy oracle.
QUANTILE_HOME = "tools/harness.py"
ORACLE_HOME = "packages/kv-testing/src/kv_testing/_oracle.py"
#: Words that name a quantile function, and the names of libraries' quantile functions.
_QUANTILE_WORDS = ("quantile", "percentile", "median")
_LIBRARY_QUANTILES = frozenset(
    {
        "median",
        "median_low",
        "median_high",
        "median_grouped",
        "quantile",
        "quantiles",
        "percentile",
        "nanmedian",
        "nanquantile",
        "nanpercentile",
    }
)
#: mlx-lm's own generation loops.
_MLX_LM_GENERATORS = frozenset({"generate_step", "stream_generate"})


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


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_sorted_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _call_name(node) == "sorted"


def _rank_arithmetic(index: ast.AST) -> bool:
    return any(
        isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult | ast.Div | ast.FloorDiv)
        for n in ast.walk(index)
    )


def _greedy_loop(function: ast.AST) -> bool:
    """Whether a loop of ``function`` takes an argmax and calls something with ``cache=``."""
    for loop in ast.walk(function):
        if not isinstance(loop, ast.For | ast.AsyncFor | ast.While):
            continue
        calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call)]
        if any(_call_name(c) == "argmax" for c in calls) and any(
            k.arg == "cache" for c in calls for k in c.keywords
        ):
            return True
    return False


def _second_rank_rules(rel: str, tree: ast.AST) -> list[str]:
    """A second quantile rule in ``tree``: a definition, a library call, a rank index."""
    problems: list[str] = []
    use = "use tools.harness.quantile (the one quantile rule)"
    sorted_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_sorted_call(node.value):
            sorted_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and not node.name.startswith("test_")
            and any(word in node.name.lower() for word in _QUANTILE_WORDS)
        ):
            problems.append(f"{rel}:{node.lineno}: defines {node.name}(); {use}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _LIBRARY_QUANTILES
        ):
            problems.append(f"{rel}:{node.lineno}: calls {ast.unparse(node.func)}(); {use}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("statistics", "numpy"):
            for alias in node.names:
                if alias.name in _LIBRARY_QUANTILES:
                    problems.append(
                        f"{rel}:{node.lineno}: imports {node.module}.{alias.name}; {use}"
                    )
        elif isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            ordered = _is_sorted_call(node.value) or (
                isinstance(node.value, ast.Name) and node.value.id in sorted_names
            )
            if ordered and _rank_arithmetic(node.slice):
                problems.append(
                    f"{rel}:{node.lineno}: indexes a sorted sequence at a computed rank "
                    f"({ast.unparse(node)}); {use}"
                )
    return problems


def _second_oracles(rel: str, tree: ast.AST) -> list[str]:
    """A second greedy oracle in ``tree``: a helper function decoding greedily."""
    problems: list[str] = []
    use = "use kv_testing.mlx_lm_greedy (the one mlx-lm greedy oracle)"

    def visit(node: ast.AST, in_test: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                test = in_test or child.name.startswith("test_")
                if not test:
                    body = ast.Module(body=child.body, type_ignores=[])
                    generators = {
                        _call_name(n)
                        for n in ast.walk(body)
                        if isinstance(n, ast.Call) and _call_name(n) in _MLX_LM_GENERATORS
                    }
                    if generators:
                        problems.append(
                            f"{rel}:{child.lineno}: {child.name}() calls mlx-lm's "
                            f"{', '.join(sorted(generators))}; {use}"
                        )
                    elif _greedy_loop(body):
                        problems.append(
                            f"{rel}:{child.lineno}: {child.name}() decodes greedily (an argmax "
                            f"in a loop that calls a model with cache=); {use}"
                        )
                visit(child, test)
            else:
                visit(child, in_test)

    visit(tree, False)
    return problems


def _python_sources(root: Path) -> list[Path]:
    sources = [root / "conftest.py"] if (root / "conftest.py").is_file() else []
    for top in ("tools", "tests", "packages"):
        sources += [
            path
            for path in sorted((root / top).rglob("*.py"))
            if not any(part.startswith(".") or part == "__pycache__" for part in path.parts)
        ]
    return sources


def _is_product_source(rel: str) -> bool:
    """Whether ``rel`` is a product source file (a member's ``src``, test support aside)."""
    parts = rel.split("/")
    return (
        len(parts) > 3
        and parts[0] == "packages"
        and parts[2] == "src"
        and (parts[1] != "kv-testing")
    )


def check_single_copies(root: Path) -> list[str]:
    """A second quantile rule or a second mlx-lm greedy oracle anywhere under ``root``."""
    problems: list[str] = []
    for source in _python_sources(root):
        rel = source.relative_to(root).as_posix()
        tree = ast.parse(source.read_text(), filename=str(source))
        if rel != QUANTILE_HOME:
            problems += _second_rank_rules(rel, tree)
        if rel != ORACLE_HOME and not _is_product_source(rel):
            problems += _second_oracles(rel, tree)
    return problems


def check_workspace(root: Path) -> list[str]:
    """All violations of the dependency rule under ``root`` (empty when the rule holds).

    The single-copy rule (:func:`check_single_copies`) is part of it.
    """
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
    return problems + check_single_copies(root)


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
            f"{support} test support); one quantile rule and one greedy oracle"
        )
    return min(len(problems), 100)


if __name__ == "__main__":
    sys.exit(main())
