"""What OpenAI's chat completions and completions APIs share: the request, the answer, the chunks.

Both take a body, answer it whole or as a stream of chunks, rank ``best_of`` sequences, and
report usage alike; they differ in how a choice carries its text and logprobs, which
:class:`OpenAIServing`'s subclasses (:mod:`._serving_chat`, :mod:`._serving_completions`) say.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ._server_protocol import OpenAIError, parse_json_body
from ._server_requests import PreparedRequest, RequestPreparer
from ._server_stream import ClientGone, RequestRunner, RequestSequence, StreamFormat, sse
from ._server_warnings import ignored_headers

__all__ = ["Delta", "OpenAIServing", "error_response", "stream_index"]


@dataclass(frozen=True)
class Delta:
    """A streamed step of one sequence: its new text, and where the stream stands."""

    piece: str
    #: Tokens of the sequence already sent before this step.
    seen: int
    #: The sequence's first chunk.
    first: bool
    #: The sequence's last chunk (it ended).
    last: bool


def error_response(error: OpenAIError) -> JSONResponse:
    """``error`` in OpenAI's JSON shape, with its status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def cached_prompt_tokens(sequences: Iterable[RequestSequence]) -> int:
    """Prompt tokens the prefix cache served, each prompt counted once (its ``n`` share it)."""
    per_prompt: dict[int, int] = {}
    for s in sequences:
        per_prompt[s.prompt_index] = max(per_prompt.get(s.prompt_index, 0), s.cached_tokens)
    return sum(per_prompt.values())


def _usage(prepared: PreparedRequest, sequences: list[RequestSequence]) -> dict[str, Any]:
    prompt = prepared.prompt_tokens
    completion = sum(s.text.completion_tokens for s in sequences)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached_prompt_tokens(sequences)},
    }


class OpenAIServing(ABC):
    """One of OpenAI's generating endpoints: checks, runs and answers its requests."""

    #: Whether the body is a chat (``messages``) rather than a completion (``prompt``).
    chat: ClassVar[bool]
    #: The endpoint's path (for the log).
    path: ClassVar[str]
    #: The answer's ``id`` prefix and its ``object``, whole and streamed.
    id_prefix: ClassVar[str]
    object_name: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, requests: RequestPreparer, runner: RequestRunner) -> None:
        self.requests = requests
        self.runner = runner

    async def create(self, http: Request) -> Response:
        """Answer one request: the whole answer, a stream, or an error in OpenAI's shape."""
        try:
            body = parse_json_body(await http.body())
            prepared = self.requests.prepare(body, chat=self.chat)
            self.requests.ignored_log.note(self.path, prepared.ignored)
            headers = ignored_headers(prepared.ignored)
            if prepared.request.stream:
                return await self.runner.stream(
                    prepared, http, lambda sequences: _Chunks(self, prepared, sequences), headers
                )
            return await self._complete(prepared, http, headers)
        except OpenAIError as err:
            self.runner.metrics.reject(err.status)
            return error_response(err)
        except ClientGone:
            self.runner.metrics.reject(499)
            return error_response(OpenAIError(499, "the client disconnected", code="client_gone"))

    async def _complete(
        self, prepared: PreparedRequest, http: Request, headers: dict[str, str]
    ) -> Response:
        sequences = await self.runner.collect(prepared, http)
        body = {
            "id": f"{self.id_prefix}-{uuid.uuid4().hex[:24]}",
            "object": self.object_name,
            "created": int(time.time()),
            "model": self.requests.model_name,
            "choices": self._choices(prepared, sequences),
            "usage": _usage(prepared, sequences),
        }
        return JSONResponse(body, headers=headers)

    def _choices(
        self, prepared: PreparedRequest, sequences: list[RequestSequence]
    ) -> list[dict[str, Any]]:
        n = prepared.request.n
        choices = []
        for p in range(len(prepared.prompts)):
            mine = [s for s in sequences if s.prompt_index == p]
            if len(mine) > n:  # best_of: the n with the highest mean logprob
                mine = sorted(mine, key=lambda s: -s.score())[:n]
            choices += [self._choice(prepared, s, p * n + j) for j, s in enumerate(mine)]
        return choices

    def _choice(
        self, prepared: PreparedRequest, sequence: RequestSequence, index: int
    ) -> dict[str, Any]:
        request = prepared.request
        text = sequence.text
        choice: dict[str, Any] = {"index": index}
        self.write_output(choice, prepared, sequence)
        choice["logprobs"] = self._logprobs(
            prepared, sequence, slice(0, len(text.tokens)), prompt=True
        )
        choice["finish_reason"] = sequence.tool_finish()
        if request.return_token_ids:
            choice["token_ids"] = list(text.tokens)
            choice["prompt_token_ids"] = list(sequence.prompt.tokens)
        return choice

    def chunk_choice(
        self, prepared: PreparedRequest, sequence: RequestSequence, piece: str, seen: int, end: bool
    ) -> dict[str, Any]:
        """One streamed choice: ``piece``, and the logprobs and ids of tokens ``seen:``."""
        request = prepared.request
        first = not sequence.started
        sequence.started = True
        choice: dict[str, Any] = {"index": stream_index(prepared, sequence)}
        now = len(sequence.text.tokens)
        self.write_delta(choice, prepared, sequence, Delta(piece, seen, first, end))
        choice["logprobs"] = self._logprobs(prepared, sequence, slice(seen, now), prompt=first)
        choice["finish_reason"] = sequence.tool_finish() if end else None
        if request.return_token_ids:
            choice["token_ids"] = sequence.text.tokens[seen:now]
            if first:
                choice["prompt_token_ids"] = list(sequence.prompt.tokens)
        return choice

    def _logprobs(
        self, prepared: PreparedRequest, sequence: RequestSequence, span: slice, *, prompt: bool
    ) -> dict[str, Any] | None:
        if prepared.request.logprobs is None:
            return None
        return self.token_logprobs(prepared, sequence, span, prompt=prompt)

    def opening_choices(
        self, prepared: PreparedRequest, sequences: list[RequestSequence]
    ) -> list[dict[str, Any]]:
        """The choices a stream sends before any text, one chunk each (none by default)."""
        return []

    @abstractmethod
    def carries_output(self, choice: dict[str, Any]) -> bool:
        """Whether a streamed ``choice`` brings output (text, reasoning, calls)."""

    @abstractmethod
    def empty_output(self) -> dict[str, Any]:
        """A streamed choice's output fields when it brings nothing (its last chunk's)."""

    @abstractmethod
    def write_output(
        self, choice: dict[str, Any], prepared: PreparedRequest, sequence: RequestSequence
    ) -> None:
        """Put a finished sequence's output into its ``choice``."""

    @abstractmethod
    def write_delta(
        self, choice: dict[str, Any], prepared: PreparedRequest, sequence: RequestSequence, d: Delta
    ) -> None:
        """Put a streamed step into its ``choice``."""

    @abstractmethod
    def token_logprobs(
        self, prepared: PreparedRequest, sequence: RequestSequence, span: slice, *, prompt: bool
    ) -> dict[str, Any]:
        """A choice's ``logprobs`` for its tokens ``span`` (``prompt``: the echo's too)."""


def stream_index(prepared: PreparedRequest, sequence: RequestSequence) -> int:
    """The ``index`` of a sequence's choices in a stream."""
    return sequence.prompt_index * prepared.request.n + sequence.rank


class _Chunks(StreamFormat):
    """A streamed OpenAI answer: one ``data:`` chunk per step, then usage and ``[DONE]``."""

    def __init__(
        self, serving: OpenAIServing, prepared: PreparedRequest, sequences: list[RequestSequence]
    ) -> None:
        self.serving = serving
        self.prepared = prepared
        self.sequences = sequences
        self.id = f"{serving.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _payload(self, choices: list[dict[str, Any]], *, usage: bool = False) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.serving.chunk_object,
            "created": self.created,
            "model": self.serving.requests.model_name,
            "choices": choices,
        }
        if usage or self.prepared.request.continuous_usage:
            body["usage"] = _usage(self.prepared, self.sequences)
        return sse(body)

    def opening(self) -> Iterator[str]:
        """One chunk per opening choice."""
        for choice in self.serving.opening_choices(self.prepared, self.sequences):
            yield self._payload([choice])

    def piece(self, sequence: RequestSequence, piece: str, seen: int, ended: bool) -> str:
        """A chunk for text, an end, an echo, or new tokens whose logprobs or ids are asked."""
        request = self.prepared.request
        new = len(sequence.text.tokens) > seen
        extra = request.logprobs is not None or request.return_token_ids
        echo = request.echo and not sequence.started
        if piece or ended or echo or (new and (extra or request.continuous_usage)):
            choice = self.serving.chunk_choice(self.prepared, sequence, piece, seen, ended)
            reason = choice["finish_reason"]
            if reason is None:
                return self._payload([choice])
            # As OpenAI's: the finish reason comes in a chunk of its own with no output.
            if not self.serving.carries_output(choice):
                choice |= self.serving.empty_output()
                return self._payload([choice])
            choice["finish_reason"] = None
            closing = {"index": choice["index"], **self.serving.empty_output()}
            closing |= {"logprobs": None, "finish_reason": reason}
            return self._payload([choice]) + self._payload([closing])
        return ""

    def failed(self, sequence: RequestSequence, seen: int) -> str:
        """The failed sequence's last chunk, its finish reason ``error``."""
        return self.piece(sequence, "", seen, True)

    def closing(self, error: OpenAIError | None) -> Iterator[str]:
        """The engine's error, the usage when asked, and ``[DONE]``."""
        if error is not None:
            yield sse(error.body())
        if self.prepared.request.include_usage:
            yield self._payload([], usage=True)
        yield "data: [DONE]\n\n"
