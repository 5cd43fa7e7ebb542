"""The served model's settings: one ServerConfig from the command line, passed whole.

The ``serve`` command line is checked against the configs: each of its options is a field of
``ServerConfig``, ``PoolConfig`` or ``kv_batching.EngineConfig`` (some in MiB) or one of the
process's own options, so a new setting cannot be threaded by hand beside them; and a command
line that sets every one gives a config holding exactly those values.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kv_batching import EngineConfig
from kv_protocol import RequestStateError
from kv_serve import PoolConfig, ServerConfig
from kv_serve._cli import SERVE_MIB_OPTIONS, SERVE_PROCESS_OPTIONS, parser, server_config


def _serve_options() -> dict[str, argparse.Action]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return {a.dest: a for a in serve._actions if a.dest != "help"}


def _fields() -> set[str]:
    kinds = (ServerConfig, PoolConfig, EngineConfig)
    return {f.name for kind in kinds for f in dataclasses.fields(kind)} - {"engine", "pool"}


def test_every_serve_option_is_a_config_field_or_the_processes_own() -> None:
    options = set(_serve_options())
    stray = options - _fields() - set(SERVE_MIB_OPTIONS) - SERVE_PROCESS_OPTIONS
    assert stray == set(), f"serve options that are no config field: {sorted(stray)}"
    assert set(SERVE_MIB_OPTIONS.values()) <= _fields()
    assert SERVE_PROCESS_OPTIONS - options <= {"command"}


def test_the_command_line_builds_the_config_it_says() -> None:
    argv = [
        "serve", "--model", "m", "--served-model-name", "served", "--max-running", "3",
        "--max-queued", "7", "--max-tokens-default", "40", "--max-context", "96",
        "--prefill-chunk", "24",
        "--prefill-stall", "1.5", "--page-size", "8", "--seed", "5", "--kv-budget-mib", "3",
        "--kv-slab-mib", "0", "--no-prefix-caching", "--state-snapshot-interval", "16",
        "--state-cache-mib", "2", "--kv-bits", "8", "--kv-group-size", "32",
        "--kv-quantize", "full",
    ]  # fmt: skip
    config = server_config(parser().parse_args(argv))
    assert config == ServerConfig(
        model_name="served",
        max_queued=7,
        max_tokens_default=40,
        engine=EngineConfig(
            max_running=3,
            prefill_chunk=24,
            prefill_stall=1.5,
            seed=5,
            prefix_caching=False,
            state_snapshot_interval=16,
            state_cache_bytes=2 * 2**20,
        ),
        pool=PoolConfig(
            max_context=96,
            page_size=8,
            kv_budget_bytes=3 * 2**20,
            kv_slab_bytes=None,
            kv_bits=8,
            kv_group_size=32,
            kv_quantize="full",
        ),
    )
    plain = parser().parse_args(["serve", "--model", "m"])
    # The command line's own default: a prompt's prefill holds the streams up by at most
    # about that many decode steps.
    stall = plain.prefill_stall
    assert stall is not None
    assert server_config(plain) == ServerConfig(
        model_name="m", engine=EngineConfig(prefix_caching=True, prefill_stall=stall)
    )


def test_settings_route_to_their_config_and_bad_ones_are_refused_once() -> None:
    config = ServerConfig.from_settings(
        None, {"model_name": "x", "max_running": 2, "page_size": 4, "max_queued": 0}
    )
    assert (config.engine.max_running, config.pool.page_size, config.max_queued) == (2, 4, 0)
    again = ServerConfig.from_settings(config, {"seed": 9})
    assert again.engine.seed == 9 and again.engine.max_running == 2
    with pytest.raises(TypeError, match="unknown setting\\(s\\) max_runing"):
        ServerConfig.from_settings(None, {"model_name": "x", "max_runing": 2})
    with pytest.raises(TypeError, match="model_name"):
        ServerConfig.from_settings(None, {})
    with pytest.raises(RequestStateError, match="max_running"):
        EngineConfig(max_running=0)
    with pytest.raises(RequestStateError, match="max_queued"):
        ServerConfig(model_name="x", max_queued=-1)
    with pytest.raises(RequestStateError, match="max_tokens_default"):
        ServerConfig(model_name="x", max_tokens_default=0)
    with pytest.raises(RequestStateError, match="max_context"):
        PoolConfig(max_context=0)
    with pytest.raises(ValueError, match="kv_bits"):
        PoolConfig(kv_bits=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_queued = 3  # type: ignore[misc]
