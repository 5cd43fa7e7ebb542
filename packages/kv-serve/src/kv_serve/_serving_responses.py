"""``/v1/responses``: OpenAI's Responses API (create, retrieve, delete).

A Responses body is mapped onto a chat request (:mod:`._server_responses`) and run like one;
its answer takes the Responses shapes (:mod:`._server_response_output`). Finished responses
made with ``store`` (the default) are kept in memory, bounded, for ``previous_response_id``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ._server_errors import OpenAIError
from ._server_protocol import parse_json_body
from ._server_requests import PreparedRequest, RequestPreparer
from ._server_response_output import (
    ResponseEvents,
    ResponseStore,
    ResponseUsage,
    assistant_message,
    new_response_id,
    output_items,
    response_object,
)
from ._server_responses import ResponsesRequest, responses_to_chat
from ._server_stream import ClientGone, RequestRunner, RequestSequence, StreamFormat
from ._server_warnings import ignored_headers
from ._serving_openai import error_response

__all__ = ["OpenAIResponses"]


def _usage(prepared: PreparedRequest, sequence: RequestSequence) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=prepared.prompt_tokens,
        cached_tokens=sequence.cached_tokens,
        output_tokens=sequence.text.completion_tokens,
    )


class OpenAIResponses:
    """OpenAI's Responses API over the server's chat requests, with a response store."""

    path = "/v1/responses"

    def __init__(
        self, requests: RequestPreparer, runner: RequestRunner, store: ResponseStore
    ) -> None:
        self.requests = requests
        self.runner = runner
        self.store = store

    def _refused(self, error: OpenAIError) -> Response:
        self.runner.metrics.reject(error.status)
        return error_response(error)

    async def create(self, http: Request) -> Response:
        """Answer a Responses request: the response, its event stream, or an error."""
        try:
            mapped = responses_to_chat(
                parse_json_body(await http.body()), previous=self.store.conversation
            )
            prepared = self.requests.prepare(mapped.chat, chat=True, fit_max_tokens=True)
            ignored = (*mapped.ignored, *mapped.named(prepared.ignored))
            self.requests.ignored_log.note(self.path, ignored)
            headers = ignored_headers(ignored)
            if mapped.stream:
                return await self.runner.stream(
                    prepared,
                    http,
                    lambda sequences: _ResponseStream(self, mapped, prepared, sequences[0]),
                    headers,
                )
            sequences = await self.runner.collect(prepared, http)
        except OpenAIError as err:
            return self._refused(err)
        except ClientGone:
            return self._refused(OpenAIError(499, "the client disconnected", code="client_gone"))
        sequence = sequences[0]
        text, calls = sequence.split_output()
        reasoning = sequence.tools.reasoning if sequence.tools is not None else ""
        body = response_object(
            mapped,
            ident=new_response_id(),
            created_at=int(time.time()),
            model=self.requests.model_name,
            output=output_items(reasoning, text, calls, mapped.custom_tools),
            finish=sequence.finish,
            usage=_usage(prepared, sequence),
        )
        self.keep(mapped, body, assistant_message(reasoning, text, calls))
        return JSONResponse(body, headers=headers)

    def keep(self, mapped: ResponsesRequest, body: dict[str, Any], said: dict[str, Any]) -> None:
        """Store a finished response (when its request asked) with its conversation."""
        if mapped.store:
            self.store.put(body, [*mapped.history, said])

    async def retrieve(self, response_id: str) -> Response:
        """``GET /v1/responses/{id}``: a stored response."""
        body = self.store.get(response_id)
        if body is None:
            return self._refused(_not_found(response_id))
        return JSONResponse(body)

    async def delete(self, response_id: str) -> Response:
        """``DELETE /v1/responses/{id}``: forget a stored response."""
        if not self.store.delete(response_id):
            return self._refused(_not_found(response_id))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"no stored response {response_id!r} (responses made with store: true are kept in "
        "memory until the server restarts or evicts them)",
        param="response_id",
        code="response_not_found",
    )


class _ResponseStream(StreamFormat):
    """A streamed response: the Responses events around the one sequence's output."""

    def __init__(
        self,
        api: OpenAIResponses,
        mapped: ResponsesRequest,
        prepared: PreparedRequest,
        sequence: RequestSequence,
    ) -> None:
        self.api = api
        self.mapped = mapped
        self.prepared = prepared
        self.sequence = sequence
        self.out = ResponseEvents(mapped, api.requests.model_name)

    def opening(self) -> Iterable[str]:
        """``response.created`` and ``response.in_progress``."""
        return self.out.start()

    def piece(self, sequence: RequestSequence, piece: str, seen: int, ended: bool) -> str:
        """Reasoning and text deltas, and each call once it is whole."""
        shown, thought, calls = sequence.stream_output(piece, ended)
        chunk = self.out.reasoning(thought) + self.out.text(shown)
        for call in calls:
            chunk += self.out.call(call)
        return chunk

    def failed(self, sequence: RequestSequence, seen: int) -> str:
        """Nothing: ``response.failed`` closes the stream."""
        return ""

    def closing(self, error: OpenAIError | None) -> Iterable[str]:
        """``response.failed``, or the closing events; the finished response is stored."""
        if error is not None:
            return [self.out.fail(error)]
        sequence = self.sequence
        chunk, body = self.out.finish(sequence.finish, _usage(self.prepared, sequence))
        text, reasoning, calls = sequence.streamed_output()
        self.api.keep(self.mapped, body, assistant_message(reasoning, text, calls))
        return [chunk]
