"""``POST /v1/completions``: OpenAI's (legacy) completions, with ``echo`` of the prompt."""

from __future__ import annotations

from typing import Any

from kv_batching import TokenLogprob

from ._server_requests import PreparedRequest
from ._server_stream import RequestSequence
from ._server_text import completion_logprobs
from ._serving_openai import Delta, OpenAIServing

__all__ = ["Completions"]


class Completions(OpenAIServing):
    """OpenAI's completions: prompts (text or token ids) in, their continuations out."""

    chat = False
    path = "/v1/completions"
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def carries_output(self, choice: dict[str, Any]) -> bool:
        """Whether the ``text`` is not empty."""
        return bool(choice.get("text"))

    def empty_output(self) -> dict[str, Any]:
        """An empty ``text``."""
        return {"text": ""}

    def write_output(
        self, choice: dict[str, Any], prepared: PreparedRequest, sequence: RequestSequence
    ) -> None:
        """The ``text``: the prompt's (with ``echo``) and the completion's."""
        echo = sequence.prompt.echo_text if prepared.request.echo else ""
        choice["text"] = echo + sequence.text.text

    def write_delta(
        self, choice: dict[str, Any], prepared: PreparedRequest, sequence: RequestSequence, d: Delta
    ) -> None:
        """The ``text`` of a piece, the echoed prompt before the first."""
        echo = sequence.prompt.echo_text if d.first and prepared.request.echo else ""
        choice["text"] = echo + d.piece

    def token_logprobs(
        self, prepared: PreparedRequest, sequence: RequestSequence, span: slice, *, prompt: bool
    ) -> dict[str, Any]:
        """Tokens, text offsets and logprobs, the echoed prompt's first with ``prompt``."""
        text = sequence.text
        echo = prepared.request.echo
        entries: list[TokenLogprob | None] = list(sequence.entries[span])
        tokens = text.pieces[span]
        shift = len(sequence.prompt.echo_text) if echo else 0
        offsets = [o + shift for o in text.offsets[span]]
        if prompt and echo:
            prompt_tokens, prompt_offsets = sequence.prompt.pieces(self.runner.tokenizer)
            found = sequence.prompt_entries
            prompt_entries: list[TokenLogprob | None] = (
                list(found) if found is not None else [None] * len(prompt_tokens)
            )
            tokens = prompt_tokens + tokens
            offsets = prompt_offsets + offsets
            entries = prompt_entries + entries
        k = prepared.request.logprobs or 0
        return completion_logprobs(tokens, offsets, entries, self.runner.texts, k)
