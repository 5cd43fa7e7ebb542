"""``POST /v1/chat/completions``: OpenAI's chat completions, tool calls and reasoning included."""

from __future__ import annotations

from typing import Any

from ._server_requests import PreparedRequest
from ._server_stream import RequestSequence
from ._server_text import chat_logprobs
from ._server_tools import split_piece
from ._serving_openai import Delta, OpenAIServing, stream_index

__all__ = ["ChatCompletions"]


class ChatCompletions(OpenAIServing):
    """OpenAI's chat completions: messages in, an assistant message (or its deltas) out."""

    chat = True
    path = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening_choices(
        self, prepared: PreparedRequest, sequences: list[RequestSequence]
    ) -> list[dict[str, Any]]:
        """Each choice's first delta: the assistant's role, no text yet."""
        empty: dict[str, Any] | None = None
        if prepared.request.logprobs is not None:
            empty = {"content": [], "refusal": None}
        return [
            {
                "index": stream_index(prepared, sequence),
                "delta": {"role": "assistant", "content": ""},
                "logprobs": empty,
                "finish_reason": None,
            }
            for sequence in sequences
        ]

    def carries_output(self, choice: dict[str, Any]) -> bool:
        """Whether the ``delta`` holds anything (content, reasoning, tool calls)."""
        return any(choice.get("delta", {}).values())

    def empty_output(self) -> dict[str, Any]:
        """An empty ``delta``."""
        return {"delta": {}}

    def write_output(
        self, choice: dict[str, Any], prepared: PreparedRequest, sequence: RequestSequence
    ) -> None:
        """The assistant ``message``: content, reasoning and tool calls split apart."""
        text = sequence.text.text
        choice["message"] = {"role": "assistant", "content": text}
        splitter = sequence.tools
        if splitter is not None:
            split_piece(splitter, text, last=True)
            message: dict[str, Any] = {"role": "assistant", "content": splitter.content}
            if splitter.reasoning:
                message["reasoning_content"] = splitter.reasoning
            if splitter.calls:
                message["content"] = splitter.content or None
                message["tool_calls"] = [call.openai() for call in splitter.calls]
            choice["message"] = message

    def write_delta(
        self, choice: dict[str, Any], prepared: PreparedRequest, sequence: RequestSequence, d: Delta
    ) -> None:
        """The ``delta``: new content, reasoning and whole tool calls as they complete."""
        new_tokens = len(sequence.text.tokens) > d.seen
        choice["delta"] = {"content": d.piece} if d.piece or new_tokens else {}
        splitter = sequence.tools
        if splitter is None:
            return
        shown, calls = split_piece(splitter, d.piece, last=d.last)
        delta: dict[str, Any] = {"content": shown} if shown or new_tokens else {}
        thought = splitter.take_reasoning()
        if thought:
            delta["reasoning_content"] = thought
        if calls:
            first_index = len(splitter.calls) - len(calls)
            delta["tool_calls"] = [call.openai(first_index + k) for k, call in enumerate(calls)]
        choice["delta"] = delta

    def token_logprobs(
        self, prepared: PreparedRequest, sequence: RequestSequence, span: slice, *, prompt: bool
    ) -> dict[str, Any]:
        """``{"content": [...], "refusal": None}`` for the generated tokens ``span``."""
        text = sequence.text
        content = chat_logprobs(
            text.pieces[span],
            text.raw[span],
            sequence.entries[span],
            self.runner.texts,
            prepared.request.logprobs or 0,
        )
        return {"content": content, "refusal": None}
