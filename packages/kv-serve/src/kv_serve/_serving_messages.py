"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API.

A Messages body is mapped onto a chat request (:mod:`._server_messages`) and run like one;
its answer and its errors take Anthropic's shapes.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ._server_messages import (
    MessageEvents,
    anthropic_error,
    message_body,
    messages_to_chat,
    stop_reason,
)
from ._server_protocol import OpenAIError, parse_json_body
from ._server_requests import PreparedRequest, RequestPreparer
from ._server_stream import ClientGone, RequestRunner, RequestSequence, StreamFormat
from ._server_warnings import ignored_headers

__all__ = ["AnthropicMessages"]


class AnthropicMessages:
    """Anthropic's Messages API over the server's chat requests."""

    def __init__(self, requests: RequestPreparer, runner: RequestRunner) -> None:
        self.requests = requests
        self.runner = runner

    def _refused(self, error: OpenAIError) -> Response:
        self.runner.metrics.reject(error.status)
        return JSONResponse(anthropic_error(error), status_code=error.status)

    async def create(self, http: Request) -> Response:
        """Answer a Messages request: the message, its event stream, or an error."""
        try:
            mapped = messages_to_chat(parse_json_body(await http.body()))
            prepared = self.requests.prepare(mapped.chat, chat=True, fit_max_tokens=True)
            ignored = (*mapped.ignored, *mapped.named(prepared.ignored))
            self.requests.ignored_log.note("/v1/messages", ignored)
            headers = ignored_headers(ignored)
            if mapped.stream:
                return await self.runner.stream(
                    prepared,
                    http,
                    lambda sequences: _MessageStream(self, prepared, sequences[0]),
                    headers,
                )
            sequences = await self.runner.collect(prepared, http)
        except OpenAIError as err:
            return self._refused(err)
        except ClientGone:
            return self._refused(OpenAIError(499, "the client disconnected", code="client_gone"))
        sequence = sequences[0]
        content, calls = sequence.split_output()
        return JSONResponse(
            message_body(
                model=self.requests.model_name,
                text=content,
                calls=calls,
                finish=sequence.finish,
                stop_string=sequence.text.stop_string,
                input_tokens=prepared.prompt_tokens,
                output_tokens=sequence.text.completion_tokens,
                cached_tokens=sequence.cached_tokens,
            ),
            headers=headers,
        )

    async def count_tokens(self, http: Request) -> Response:
        """The input tokens a Messages request's prompt would take, nothing generated."""
        try:
            mapped = messages_to_chat(parse_json_body(await http.body()), count_only=True)
            request = self.requests.parse_chat(mapped.chat)
            count = len(self.requests.chat_tokens(request))
        except OpenAIError as err:
            return self._refused(err)
        ignored = (
            *mapped.ignored,
            *mapped.named([*request.ignored, *self.requests.template_ignores(request)]),
        )
        self.requests.ignored_log.note("/v1/messages/count_tokens", ignored)
        return JSONResponse({"input_tokens": count}, headers=ignored_headers(ignored))


class _MessageStream(StreamFormat):
    """A streamed message: Anthropic's events around the one sequence's text and tool uses."""

    def __init__(
        self, api: AnthropicMessages, prepared: PreparedRequest, sequence: RequestSequence
    ) -> None:
        self.out = MessageEvents(api.requests.model_name, prepared.prompt_tokens)
        self.sequence = sequence

    def opening(self) -> Iterable[str]:
        """``message_start``."""
        return [self.out.start()]

    def piece(self, sequence: RequestSequence, piece: str, seen: int, ended: bool) -> str:
        """Text deltas, and each tool call once it is whole."""
        piece, _, calls = sequence.stream_output(piece, ended)
        chunk = self.out.text(piece)
        for call in calls:
            chunk += self.out.tool_use(call)
        return chunk

    def failed(self, sequence: RequestSequence, seen: int) -> str:
        """Nothing: the error event closes the stream."""
        return ""

    def closing(self, error: OpenAIError | None) -> Iterable[str]:
        """The error event, or the stop reason, usage and ``message_stop``."""
        if error is not None:
            return [self.out.error(error)]
        sequence = self.sequence
        made = sequence.tools.calls if sequence.tools is not None else []
        stop = sequence.text.stop_string
        reason = stop_reason(sequence.finish, made, stop)
        return [
            self.out.stop(reason, stop, sequence.text.completion_tokens, sequence.cached_tokens)
        ]
