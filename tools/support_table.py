"""Which mlx-lm architectures the engine serves: every hybrid module, checked on a tiny model.

For each architecture of :data:`kv_testing.ZOO` (one per mlx-lm model module whose
``make_cache()`` builds sliding-window or recurrent state caches, plus plain full-attention
ones) a tiny random-weight fp32 instance is built and checked: the layout equals the
model's ``make_cache()`` layer by layer, and the engine's greedy tokens equal mlx-lm
generating each prompt alone, for staggered prompts shorter than, equal to and past the
window, at page sizes 6 (not a power of two) and 16, on the automatic per-layer decode
paths and with every layer forced onto the universal path. The status is ``supported`` only
when every one of those runs agrees token for token.

A supported architecture is also checked for prefix hits (``prefix_hits``): a prompt, then a
prompt sharing part of it and the next turn of its conversation (prompt, answer, more),
with prefix caching at page sizes 6 and 5 (state snapshots every 12 tokens, then at the
default interval, which 5 does not divide a power of two of); ``yes`` when the later prompts
reuse cached tokens and every token equals mlx-lm's. And for speculative decoding
(``speculative``): the staggered prompts decode together with proposals of 4 tokens right for
2 and wrong after (every step a partial acceptance: pages trimmed, states put back and
replayed); ``yes`` when every token equals mlx-lm's.

    uv run python -m tools.support_table --markdown        # docs/architectures.md's table
    uv run python -m tools.support_table --json tests/architecture_support.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["SupportRow", "check_architecture", "hybrid_modules", "main"]

VOCAB = 128
MAX_TOKENS = 8
PAGE_SIZES = (6, 16)
#: Staggered prompts: one token, just under, at and well past the zoo's window of 8.
PROMPT_LENGTHS = (1, 7, 8, 19, 33)
SUPPORTED = "supported"
MLX_LM_CANNOT_RUN = "mlx-lm cannot run it here"
#: Statuses that say nothing about this toolkit: mlx-lm (or the zoo) fails first.
NOT_OURS = frozenset({MLX_LM_CANNOT_RUN, "zoo cannot build"})


@dataclass(frozen=True, kw_only=True)
class SupportRow:
    """One architecture's result: what its layers are, how each kind decodes, and the status."""

    name: str
    module: str
    layer_kinds: str
    decode_paths: str
    mlx_lm_batchable: bool
    status: str
    reason: str = ""
    prefix_hits: str = ""
    speculative: str = ""


def _prompts() -> list[list[int]]:
    return [[(5 * i + 3 * j + 2) % VOCAB for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


def _cache_kinds(caches: Sequence[Any]) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per cache of mlx-lm's ``make_cache()``, named as the layout names them.

    A ``CacheList`` counts as the caches it holds, in order, as the layout flattens it.
    """
    from kv_protocol import flatten_caches

    out: list[tuple[str, int | None]] = []
    for cache in flatten_caches(caches):
        name = type(cache).__name__
        if name == "KVCache":
            out.append(("full", None))
        elif name == "RotatingKVCache":
            out.append(("sliding", int(getattr(cache, "max_size"))))  # noqa: B009
        elif name in ("ArraysCache", "MambaCache"):
            out.append(("state", None))
        else:
            out.append((name, None))
    return out


def _count(kinds: Sequence[str]) -> str:
    counts = Counter(kinds)
    return ", ".join(f"{kind} {counts[kind]}" for kind in sorted(counts))


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


def check_architecture(name: str) -> SupportRow:
    """Build zoo architecture ``name`` and check layout and engine against mlx-lm."""
    from mlx_lm.models.cache import make_prompt_cache

    from kv_batching import DecodeEngine
    from kv_protocol import layout_from_model
    from kv_serve import build_engine
    from kv_testing import ZOO, build_zoo_model, mlx_lm_greedy

    module = ZOO[name].module
    row: dict[str, Any] = {"name": name, "module": module, "decode_paths": ""}
    try:
        model = build_zoo_model(name)
        caches = make_prompt_cache(model)
    except Exception as error:
        return SupportRow(
            **row,
            layer_kinds="?",
            mlx_lm_batchable=False,
            status="zoo cannot build",
            reason=_short(error),
        )
    expected = _cache_kinds(caches)
    row["layer_kinds"] = _count([kind for kind, _ in expected])
    row["mlx_lm_batchable"] = all(hasattr(c, "merge") for c in caches)
    prompts = _prompts()
    try:
        want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in prompts]
    except Exception as error:
        return SupportRow(**row, status=MLX_LM_CANNOT_RUN, reason=_short(error))
    try:
        layout = layout_from_model(model)
    except Exception as error:
        return SupportRow(**row, status="refused", reason=_short(error))
    got = [(spec.kind.value, spec.window) for spec in layout.specs]
    if got != expected:
        return SupportRow(
            **row, status="layout differs", reason=f"make_cache() {expected}, layout {got}"
        )
    kind_of = {spec.layer_id: spec.kind.value for spec in layout.specs}
    paths_seen: dict[str, set[str]] = {}
    for page_size in PAGE_SIZES:
        for decode_path in ("auto", "universal"):
            try:
                engine: DecodeEngine = build_engine(
                    model,
                    max_running=4,
                    max_context=64,
                    page_size=page_size,
                    prefill_chunk=16,
                    decode_path=decode_path,
                )
            except Exception as error:
                return SupportRow(**row, status="refused", reason=_short(error))
            with engine:
                for layer_id, path in engine.decode_plan.paths.items():
                    paths_seen.setdefault(kind_of[layer_id], set()).add(path)
                ids = [engine.submit(p, MAX_TOKENS) for p in prompts]
                out = engine.run()
                fast = bool(engine.decode_plan.fast_layers)
                fallbacks = engine.stats.decode_fallbacks
            if [out[i] for i in ids] != want:
                return SupportRow(
                    **row,
                    status="tokens differ",
                    reason=f"page_size={page_size}, decode_path={decode_path}",
                )
            if fallbacks:
                return SupportRow(
                    **row,
                    status="decode falls back",
                    reason=f"{fallbacks} batched decode steps failed and ran request by "
                    f"request (page_size={page_size}, decode_path={decode_path})",
                )
            if decode_path == "auto" and not fast:
                break  # auto was already all universal
    if layout.state_layer_ids:
        paths_seen["state"] = {"state cache"}
    row["decode_paths"] = "; ".join(
        f"{kind}: {'/'.join(sorted(paths))}" for kind, paths in sorted(paths_seen.items())
    )
    return SupportRow(
        **row,
        status=SUPPORTED,
        prefix_hits=check_prefix_hits(model),
        speculative=check_speculation(model),
    )


#: (page size, state snapshot interval or None for the default) of the prefix-hit check.
PREFIX_CONFIGS = ((6, 12), (5, None))


def check_prefix_hits(model: Any) -> str:
    """``yes`` when prompts sharing a prefix reuse it with mlx-lm's tokens; else ``no: why``.

    A 40-token prompt runs first; then, together, a prompt sharing its first 26 tokens and
    the next turn of its conversation (the prompt, its answer and one more token). The next
    turn must reuse cached tokens at every configuration, the shared-start prompt where
    snapshots are taken within it (every 12 tokens).
    """
    from kv_serve import build_engine
    from kv_testing import mlx_lm_greedy

    first = [(7 * j + 1) % VOCAB for j in range(40)]
    answer = mlx_lm_greedy(model, first, MAX_TOKENS)
    shared = [*first[:26], 9, 9, 1]
    turn = [*first, *answer, 3]
    want = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in (shared, turn)]
    for page_size, interval in PREFIX_CONFIGS:
        where = f"page_size={page_size}, state_snapshot_interval={interval}"
        try:
            with build_engine(
                model,
                max_running=4,
                max_context=96,
                page_size=page_size,
                prefill_chunk=16,
                state_snapshot_interval=interval,
            ) as engine:
                rid = engine.submit(first, MAX_TOKENS)
                if engine.run()[rid] != answer:
                    return f"no: the first prompt's tokens differ ({where})"
                ids = [engine.submit(p, MAX_TOKENS) for p in (shared, turn)]
                out = engine.run()
                reused = engine.stats.prefix_hit_tokens
        except Exception as error:
            return f"no: {_short(error)} ({where})"
        if [out[i] for i in ids] != want:
            return f"no: tokens differ after a prefix hit ({where})"
        least = len(first) if interval is None else len(first) + 24
        if reused < least:
            return f"no: {reused} tokens reused, expected at least {least} ({where})"
    return "yes"


class _HalfRightProposer:
    """Proposes mlx-lm's continuation of a known prompt, right for 2 tokens, wrong after."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.proposed = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for prompt, truth in self.continuations.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                out = [t if i < 2 else (t + 1) % VOCAB for i, t in enumerate(truth[done:][:k])]
                self.proposed += len(out)
                return out
        return []


def check_speculation(model: Any) -> str:
    """``yes`` when speculative decoding keeps mlx-lm's tokens; else ``no: why``.

    The staggered prompts, then the next turn of the longest one's conversation (its prompt,
    its answer and more: a prefix hit reaching into the verified output) beside a prompt
    that is preempted while it decodes and readmitted; every token must be mlx-lm's.

    On a model with recurrent state layers ``yes`` says how proposals verify: in the shared
    decode step with each mixer running its requests' rows right-padded in one call (``state:
    padded rows``) or one call per group of requests with as many rows (``state: rows grouped
    by length``), or by a forward per request (``state: a forward per request``: a mixer that
    cannot run a step's rows).
    """
    from kv_batching import SpeculationConfig
    from kv_serve import build_engine
    from kv_testing import mlx_lm_greedy

    prompts = _prompts()
    truth = {tuple(p): mlx_lm_greedy(model, p, MAX_TOKENS + 4) for p in prompts}
    proposer = _HalfRightProposer(truth)
    # Verified from the first proposal on (no shadowing): every request's verifications,
    # partial acceptances and rollbacks run beside the others from the start.
    config = SpeculationConfig(
        proposer=proposer, num_tokens=4, max_batch=len(prompts), shadow=False, compare_rates=False
    )
    longest = max(prompts, key=len)
    # The next turn of the longest prompt's conversation (a prefix hit that reaches into the
    # verified output) and a prompt preempted while it decodes.
    turn = [*longest, *truth[tuple(longest)][:MAX_TOKENS], 3]
    later = [turn, prompts[0]]
    for prompt in later:
        truth[tuple(prompt)] = mlx_lm_greedy(model, prompt, MAX_TOKENS + 4)
    try:
        with build_engine(model, page_size=6, max_context=96, speculative=config) as engine:
            ids = [engine.submit(p, MAX_TOKENS) for p in prompts]
            out = engine.run()
            ids += [engine.submit(p, MAX_TOKENS) for p in later]
            while len(engine._core.scheduler.running) < len(later) and engine.has_work:
                engine.step()
            for _ in range(2):
                engine.step()
            if engine._core.scheduler.running:
                engine._core.scheduler.preempt(engine._core.scheduler.running[-1])
            out.update(engine.run())
            prompts = [*prompts, *later]
            steps = engine.stats.speculative_steps
            hits, preemptions = engine.stats.prefix_hit_tokens, engine.stats.preemptions
            runner = engine._core.runner
            if not runner.state_layer_ids:
                how = ""
            elif runner.ragged_state_mixers is None:
                how = " (state: a forward per request)"
            else:
                modes = set(runner.ragged_state_mixers.modes)
                how = (
                    " (state: padded rows)"
                    if modes == {"padded"}
                    else " (state: rows grouped by length)"
                )
    except Exception as error:
        return f"no: {_short(error)}"
    if any(out[i] != truth[tuple(p)][:MAX_TOKENS] for i, p in zip(ids, prompts, strict=True)):
        return "no: tokens differ from mlx-lm's"
    if not steps:
        return "no: nothing was speculated"
    if not hits or not preemptions:
        return f"no: {hits} prefix-hit tokens, {preemptions} preemptions (expected both)"
    return "yes" + how


def hybrid_modules() -> list[str]:
    """mlx-lm model modules whose source builds sliding-window or recurrent state caches."""
    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    pattern = re.compile(r"\b(RotatingKVCache|ArraysCache|MambaCache)\(")
    return sorted(
        f.stem for f in folder.glob("*.py") if f.stem != "cache" and pattern.search(f.read_text())
    )


def markdown(rows: Sequence[SupportRow]) -> str:
    """The support table in Markdown, with the count of supported architectures."""
    lines = [
        "| architecture | mlx-lm module | layers | decode path per kind | BatchGenerator "
        "| prefix hits | speculative | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r.status if not r.reason else f"{r.status}: {r.reason}"
        status = status.replace("|", "\\|")
        batch = "yes" if r.mlx_lm_batchable else "no"
        lines.append(
            f"| {r.name} | `{r.module}` | {r.layer_kinds} | {r.decode_paths or '-'} | {batch} "
            f"| {r.prefix_hits or '-'} | {r.speculative or '-'} | {status} |"
        )
    modules = set(hybrid_modules())
    # One row per hybrid mlx-lm module (variants such as plain llama are extra rows).
    hybrid = [r for r in rows if r.name == r.module and r.module in modules]
    # What mlx-lm itself cannot run here is not counted as ours, supported or not.
    countable = [r for r in hybrid if r.status not in NOT_OURS]
    ok = sum(r.status == SUPPORTED for r in countable)
    lines.append("")
    lines.append(
        f"{ok} of {len(countable)} hybrid mlx-lm modules that mlx-lm runs here are supported "
        f"({100 * ok / max(len(countable), 1):.0f}%; {len(hybrid) - len(countable)} more that "
        f"mlx-lm itself cannot run here are listed, not counted); "
        f"{sum(r.status == SUPPORTED for r in rows)} of {len(rows)} rows in all."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Check the architectures (all of the zoo by default) and print or write the table."""
    from kv_testing import ZOO

    parser = argparse.ArgumentParser(prog="python -m tools.support_table", description=__doc__)
    parser.add_argument("names", nargs="*", help="zoo architectures (default: all)")
    parser.add_argument("--json", type=Path, help="write {name: row} to this file")
    parser.add_argument("--markdown", action="store_true", help="print the Markdown table")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in ZOO]
    if unknown:
        parser.error(f"unknown architectures {unknown}; expected some of {sorted(ZOO)}")
    rows = []
    for name in args.names or list(ZOO):
        rows.append(check_architecture(name))
        if not args.markdown:
            print(f"{name}: {rows[-1].status} {rows[-1].reason}", flush=True)
    if args.json is not None:
        table = {r.name: asdict(r) for r in rows}
        args.json.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
