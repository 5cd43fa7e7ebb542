"""Every mlx-lm hybrid architecture, on a tiny random-weight fp32 instance.

``tools.support_table.check_architecture`` checks the layout against the model's own
``make_cache()`` and the engine's greedy tokens against mlx-lm generating each prompt alone
(staggered prompts crossing the window, page sizes 6 and 16, automatic and universal decode
paths), and prefix hits (``prefix_hits``: a shared start and a conversation's next turn
reuse cached tokens, state snapshots included, with mlx-lm's tokens), and speculative
decoding with partial acceptances (``speculative``). Each architecture
must keep the status recorded in ``architecture_support.json`` (``docs/architectures.md``'s table is
generated from the same run): a supported one that regresses fails, and so does a refused
one that starts working, until the table is regenerated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kv_testing import ZOO
from tools.support_table import SUPPORTED, check_architecture, hybrid_modules

RECORDED: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "architecture_support.json").read_text()
)


def test_the_zoo_covers_every_hybrid_module_of_mlx_lm() -> None:
    modules = {entry.module for entry in ZOO.values()}
    assert set(hybrid_modules()) <= modules
    assert set(RECORDED) == set(ZOO)


@pytest.mark.parametrize("name", list(ZOO))
def test_architecture_keeps_its_recorded_status(name: str) -> None:
    row = check_architecture(name)
    recorded = RECORDED[name]
    assert (row.status, row.reason) == (recorded["status"], recorded["reason"])
    if row.status == SUPPORTED:
        assert row.decode_paths == recorded["decode_paths"]
        assert row.layer_kinds == recorded["layer_kinds"]
        assert row.prefix_hits == recorded["prefix_hits"]
        assert row.speculative == recorded["speculative"]


def test_refusals_name_their_reason() -> None:
    for name, row in RECORDED.items():
        assert (row["status"] == SUPPORTED) == (row["reason"] == ""), name


def test_every_supported_architecture_reuses_prefixes() -> None:
    """State models included: their prefix hits resume from recurrent-state snapshots."""
    for name, row in RECORDED.items():
        if row["status"] == SUPPORTED:
            assert row["prefix_hits"] == "yes", name


def test_every_supported_architecture_speculates_with_mlx_lm_s_tokens() -> None:
    """Partial acceptances every step: pages trimmed, recurrent states put back and replayed."""
    for name, row in RECORDED.items():
        if row["status"] == SUPPORTED:
            assert row["speculative"].startswith("yes"), name
