"""Greedy decode steps take their tokens from the quantized head's screen, with mlx-lm's tokens.

Where every row of a batched decode is greedy and asks nothing else of the logits, the engine
asks the head (``kv_protocol.GreedyHeadProjection``; kv-metal-kernels' CPU kernel with
AVX-512 VNNI) for the rows' argmax without projecting the whole vocabulary. The oracle is
mlx-lm's own generation with the same quantized model; the counters and a recording head
show which steps took which path: a row that samples, asks for logprobs, has a penalty or a
grammar makes the step project its logits as before, and its greedy rows keep mlx-lm's
tokens too.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kv_batching import SamplingParams
from kv_metal_kernels import CpuQuantizedHead
from kv_serve import build_engine
from kv_testing import build_tiny_model, mlx_lm_greedy

_handle = CpuQuantizedHead().library.handle
needs_screen = pytest.mark.skipif(
    _handle is None or not _handle.kv_qhead_screen_supported(),
    reason="the greedy screen needs the native CPU kernel built with AVX-512 VNNI",
)

VOCAB = 65536
HIDDEN = 256


def quantized_model(bits: int) -> nn.Module:
    model = build_tiny_model(
        "gemma3_text", window=8, num_layers=6, vocab_size=VOCAB, hidden_size=HIDDEN
    )
    nn.quantize(model, group_size=64, bits=bits)
    return model


PROMPTS = [
    [(97 * i + 31 * j + 5) % VOCAB for j in range(n)] for i, n in enumerate((3, 9, 14, 20, 6))
]


class Recording:
    """Counts the head's full projections and greedy picks (rows each) after the build."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.projected: list[int] = []
        self.picked: list[int] = []
        prepare = CpuQuantizedHead.prepare
        recording = self

        class Counted:
            def __init__(self, project: Any) -> None:
                self._project = project

            def __call__(self, rows: mx.array) -> mx.array:
                recording.projected.append(rows.size // rows.shape[-1])
                out: mx.array = self._project(rows)
                return out

            def greedy(self, rows: mx.array) -> mx.array | None:
                recording.picked.append(rows.size // rows.shape[-1])
                out: mx.array | None = self._project.greedy(rows)
                return out

        def counted(self: CpuQuantizedHead, *args: Any, **kwargs: Any) -> Any:
            project = prepare(self, *args, **kwargs)
            return None if project is None else Counted(project)

        monkeypatch.setattr(CpuQuantizedHead, "prepare", counted)

    def clear(self) -> None:
        self.projected.clear()
        self.picked.clear()


@needs_screen
@pytest.mark.parametrize("bits", [8, 4])
def test_all_greedy_steps_pick_mlx_lms_tokens_without_the_logits(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = Recording(monkeypatch)
    model = quantized_model(bits)
    want = [mlx_lm_greedy(model, p, 10) for p in PROMPTS]
    with build_engine(model, max_running=8, max_context=64, page_size=4) as engine:
        record.clear()
        ids = [engine.submit(p, 10) for p in PROMPTS]
        out = engine.run()
        steps = engine.stats.greedy_head_steps
        decodes = engine.stats.decode_steps
    assert [out[i] for i in ids] == want
    assert steps > 0 and max(record.picked) > 1  # batched rows picked by the screen
    # The only full projections are the prompts' last positions (one row each).
    assert record.projected and set(record.projected) == {1}
    assert steps == len(record.picked) <= decodes


@needs_screen
@pytest.mark.parametrize(
    "other",
    [
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(logprobs=2),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(logit_bias={7: 5.0}),
    ],
    ids=["sampled", "logprobs", "penalty", "bias"],
)
def test_a_row_that_needs_the_logits_makes_its_steps_project_them(
    other: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = Recording(monkeypatch)
    model = quantized_model(8)
    want = [mlx_lm_greedy(model, p, 8) for p in PROMPTS[:3]]
    with build_engine(model, max_running=8, max_context=64, page_size=4) as engine:
        record.clear()
        ids = [engine.submit(p, 8) for p in PROMPTS[:3]]
        engine.submit(PROMPTS[3], 4, sampling=other)
        out = engine.run()
        steps = engine.stats.greedy_head_steps
    assert [out[i] for i in ids] == want
    # While the other request runs (its 4 tokens: 3 decode steps) every step projects the
    # logits of all its rows; after it, the greedy rows are picked again.
    assert sum(1 for n in record.projected if n == 4) == 3
    assert steps == len(record.picked) > 0 and max(record.picked) == 3


@needs_screen
def test_without_the_screen_the_logits_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head whose greedy declines (``None``) leaves the step to the argmax of the logits."""
    monkeypatch.setattr(
        "kv_metal_kernels._quantized_head.QuantizedHeadProjection.greedy",
        lambda self, rows: None,
    )
    model = quantized_model(8)
    want = [mlx_lm_greedy(model, p, 8) for p in PROMPTS]
    with build_engine(model, max_running=8, max_context=64, page_size=4) as engine:
        ids = [engine.submit(p, 8) for p in PROMPTS]
        out = engine.run()
        assert engine.stats.greedy_head_steps == 0
    assert [out[i] for i in ids] == want


@needs_screen
def test_verifying_steps_pick_their_rows_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Proposals verified inside the shared step: every row (each request's last token and
    its proposal) picked by the head, and the tokens stay mlx-lm's."""
    from kv_batching import NgramProposer, SpeculationConfig

    record = Recording(monkeypatch)
    model = quantized_model(8)
    # Repetitive prompts: the n-gram proposer finds proposals in them.
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 6, [40, 41] * 8]
    want = [mlx_lm_greedy(model, p, 12) for p in prompts]
    config = SpeculationConfig(
        shadow=False, compare_rates=False, proposer=NgramProposer(min_ngram=1), num_tokens=3
    )
    with build_engine(
        model, max_running=4, max_context=96, page_size=4, speculative=config
    ) as engine:
        record.clear()
        ids = [engine.submit(p, 12) for p in prompts]
        out = engine.run()
        stats = engine.stats
    assert [out[i] for i in ids] == want
    assert stats.speculative_steps > 0 and stats.decode_fallbacks == 0
    assert max(record.picked) > len(prompts)  # a step with proposals' rows, picked
    assert set(record.projected) == {1}  # only the prompts' last positions projected
