"""build_engine wiring, pool sizing, text streaming and the command line on tiny models."""

from __future__ import annotations

from typing import Any

import pytest

from kv_pool import HybridKVPool, required_bytes
from kv_protocol import KVCacheError, LayoutError, RequestStateError, layout_from_model
from kv_serve import TextStream, build_engine, build_pool
from kv_serve._cli import main, parser
from kv_serve._server_worker import pool_pages
from kv_testing import build_tiny_model, mlx_lm_greedy

VOCAB = 64


PROMPTS = [[(3 * i + 7 * j + 1) % VOCAB for j in range(n)] for i, n in enumerate((1, 9, 23, 40))]


@pytest.mark.parametrize("fused_rope", ["off", "reference"])
@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text", "cohere2"])
def test_build_engine_equals_mlx_lm(arch: str, fused_rope: str) -> None:
    model = build_tiny_model(arch, window=8, num_layers=4, vocab_size=VOCAB)
    want = [mlx_lm_greedy(model, p, 12) for p in PROMPTS]
    engine = build_engine(
        model, max_running=3, max_context=64, page_size=4, prefill_chunk=16, fused_rope=fused_rope
    )
    ids = [engine.submit(p, 12) for p in PROMPTS]
    out = engine.run()
    assert [out[i] for i in ids] == want
    assert all(n == 0 for n in (engine.memory_report().pages_used or {}).values())


def test_build_pool_sizes_for_the_workload() -> None:
    layout = layout_from_model(build_tiny_model("gpt_oss", window=8, num_layers=4))
    sized = build_pool(layout, max_running=3, max_context=40, page_size=4, prefill_chunk=8)
    need = required_bytes(layout, max_context=40, concurrency=3, page_size=4, prefill_chunk=8)
    assert sum(s.num_pages * s.bytes_per_page for s in sized.sub_pools) == need
    budget = build_pool(layout, kv_budget_bytes=2 * need, max_context=40, page_size=4)
    assert sum(s.num_pages * s.bytes_per_page for s in budget.sub_pools) <= 2 * need
    paged = build_pool(layout, num_pages=10, page_size=4)
    assert {s.num_pages for s in paged.sub_pools} == {10}
    with pytest.raises(RequestStateError, match="not both"):
        build_pool(layout, kv_budget_bytes=need, num_pages=10)
    for bad in ({"page_size": 0}, {"max_running": 1.5}, {"num_pages": 1}, {"max_context": "9"}):
        with pytest.raises(KVCacheError):
            build_pool(layout, **bad)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="slots per layer buffer"):
        build_pool(layout, num_pages=2**30, page_size=4)


class ByteTokenizer:
    """Each token is one UTF-8 byte: decoding a prefix can end inside a character."""

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def test_text_stream_never_splits_a_character() -> None:
    text = "héllo wörld — 東京 🙂!"
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push(b) for b in text.encode()]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "m", "--prompt", "p", "--max-tokens", "0"],
        ["generate", "--model", "m", "--prompt", "p", "--max-tokens", "2.5"],
        ["generate", "--model", "m", "--prompt", "p", "--temperature", "nan"],
        ["generate", "--model", "m", "--prompt", "p", "--temperature", "-1"],
        ["generate", "--model", "m", "--prompt", "p", "--top-p", "0"],
        ["generate", "--model", "m", "--prompt", "p", "--top-p", "1.5"],
        ["generate", "--model", "m", "--prompt", "p", "--seed", "-1"],
        ["generate", "--model", "m", "--prompt", "p", "--seed", str(2**64)],
        ["generate", "--model", "m", "--prompt", "p", "--dtype", "int8"],
        ["generate", "--model", "m", "--prompt", "p", "--top-k", "-1"],
        ["generate", "--model", "m", "--prompt", "p", "--min-p", "1.5"],
        ["generate", "--model", "m", "--prompt", "p", "--repetition-penalty", "0"],
        ["generate", "--model", "m", "--prompt", "p", "--presence-penalty", "3"],
        ["generate", "--model", "m", "--prompt", "p", "--frequency-penalty", "x"],
        ["generate", "--model", "m", "--prompt", "p", "--logprobs", "21"],
        ["generate", "--model", "m", "--prompt", "p", "--n", "0"],
        ["generate", "--model", "m", "--prompt", "p", "--n", "129"],
        ["generate", "--prompt", "p"],
        ["generate", "--model", "m", "--prompt", "p", "--kv-bits", "6"],
        ["generate", "--model", "m", "--prompt", "p", "--kv-bits", "8", "--kv-group-size", "48"],
        ["serve", "--model", "m", "--kv-bits", "4", "--kv-quantize", "state"],
        ["serve-nothing"],
    ],
)
def test_cli_bad_values_are_one_error_line(argv: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err


@pytest.mark.parametrize("kind", ["missing", "not-gguf", "no-config"])
def test_cli_bad_models_are_one_error_line(kind: str, tmp_path: Any, capsys: Any) -> None:
    target = tmp_path / "model"
    if kind == "not-gguf":
        target = tmp_path / "weights.bin"
        target.write_bytes(b"x")
    elif kind == "no-config":
        target.mkdir()
    code = main(["generate", "--model", str(target), "--prompt", "p", "--cache-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err


@pytest.mark.parametrize(
    ("args", "expected"),
    [([], 3.0), (["--prefill-stall", "1.5"], 1.5), (["--prefill-stall", "off"], None)],
)
def test_serve_parses_the_prefill_stall(args: list[str], expected: float | None) -> None:
    parsed = parser().parse_args(["serve", "--model", "m", *args])
    assert parsed.prefill_stall == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], (None, 64, "all")),
        (["--kv-bits", "8"], (8, 64, "all")),
        (["--kv-bits", "4", "--kv-group-size", "32", "--kv-quantize", "full"], (4, 32, "full")),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_parses_the_kv_quantization(
    command: str, args: list[str], expected: tuple[int | None, int, str]
) -> None:
    extra = ["--prompt", "p"] if command == "generate" else []
    parsed = parser().parse_args([command, "--model", "m", *extra, *args])
    assert (parsed.kv_bits, parsed.kv_group_size, parsed.kv_quantize) == expected


def test_build_engine_quantizes_the_pool_it_builds_and_reports_it() -> None:
    model = build_tiny_model("gpt_oss", window=8, head_dim=32)
    engine = build_engine(
        model, max_running=4, max_context=64, kv_bits=8, kv_group_size=32, kv_quantize="full"
    )
    plain = build_engine(model, max_running=4, max_context=64)
    assert isinstance(engine.pool, HybridKVPool) and isinstance(plain.pool, HybridKVPool)
    quantized, unquantized = engine.pool.memory_report(), plain.pool.memory_report()
    assert {s.kind: s.kv_bits for s in quantized.sub_pools} == {"sliding": None, "full": 8}
    # The sliding sub-pool is plain in both; a full row of 32 fp32 values (128 bytes) is
    # stored as 32 bytes of 8-bit data plus one fp32 scale and one bias (40 bytes).
    assert quantized.sub_pools[0].bytes_per_page == unquantized.sub_pools[0].bytes_per_page
    assert pool_pages(engine.pool.memory_report())[2] == {
        "sliding-w8": 0,
        "full": 8,
    }  # what /metrics reports
    assert quantized.sub_pools[1].bytes_per_page * 128 == (
        unquantized.sub_pools[1].bytes_per_page * 40
    )
    engine.close()
    plain.close()
    pool = HybridKVPool(layout_from_model(model), num_pages=8)
    with pytest.raises(RequestStateError, match="give a pool or kv_bits"):
        build_engine(model, pool=pool, kv_bits=8)
    with pytest.raises(LayoutError, match="head_dim 32 is not a multiple of kv_group_size 64"):
        build_engine(model, max_running=1, max_context=16, kv_bits=8)
