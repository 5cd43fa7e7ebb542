"""``POST /tokenize`` and ``/detokenize``: the served tokenizer, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it) or chat
``messages`` (rendered by the chat template as ``/v1/chat/completions`` renders them, with
``tools``, ``reasoning_effort`` and ``chat_template_kwargs``) and answers ``{"count",
"max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``. ``model`` may be left out; another model than the served one is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ._server_protocol import OpenAIError, parse_json_body
from ._server_requests import RequestPreparer, model_not_found
from ._server_warnings import IgnoredField, ignored_headers
from ._serving_openai import error_response

__all__ = ["Tokenization"]

_PROMPT_KEYS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_DETOKENIZE_KEYS = frozenset({"model", "tokens"})


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


class Tokenization:
    """The served model's tokenizer over HTTP."""

    def __init__(self, requests: RequestPreparer, max_context: int) -> None:
        self.requests = requests
        self.max_context = max_context

    def _model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.requests.model_name:
            raise model_not_found(str(model), self.requests.model_name)

    async def tokenize(self, http: Request) -> Response:
        """The tokens of a prompt or of chat messages."""
        try:
            body = parse_json_body(await http.body())
            self._model(body)
            strs = _flag(body, "return_token_strs", False)
            ignored: list[IgnoredField] = []
            if "messages" in body:
                own = ("add_generation_prompt", "return_token_strs")
                chat = {k: v for k, v in body.items() if k not in own}
                chat["model"] = self.requests.model_name
                if not _flag(body, "add_generation_prompt", True):
                    ignored.append(
                        IgnoredField(
                            name="add_generation_prompt",
                            reason="the prompt always ends ready for the assistant's turn",
                        )
                    )
                request = self.requests.parse_chat(chat)
                tokens = self.requests.chat_tokens(request)
                ignored += [*request.ignored, *self.requests.template_ignores(request)]
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise OpenAIError(
                        400, "prompt must be a string (or give messages)", param="prompt"
                    )
                special = _flag(body, "add_special_tokens", True)
                tokens = [int(t) for t in self.requests.tokenizer.encode(prompt)]
                bos = getattr(self.requests.tokenizer, "bos_token_id", None)
                if not special and tokens and bos is not None and tokens[0] == bos:
                    tokens = tokens[1:]
                ignored += [
                    IgnoredField(name=k, reason="not a /tokenize field")
                    for k in body
                    if k not in _PROMPT_KEYS and body[k] is not None
                ]
        except OpenAIError as err:
            return error_response(err)
        texts = None
        if strs:
            convert = self.requests.tokenizer.convert_ids_to_tokens
            texts = [str(t) for t in convert(tokens)]
        answer = {
            "count": len(tokens),
            "max_model_len": self.max_context,
            "tokens": tokens,
            "token_strs": texts,
        }
        return JSONResponse(answer, headers=ignored_headers(ignored))

    async def detokenize(self, http: Request) -> Response:
        """The text of token ids."""
        try:
            body = parse_json_body(await http.body())
            self._model(body)
            tokens = body.get("tokens")
            vocab = self.requests.worker.vocab_size or None
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab or 2**31)
                for t in tokens
            ):
                top = "" if vocab is None else f" in 0..{vocab - 1}"
                raise OpenAIError(400, f"tokens must be a list of token ids{top}", param="tokens")
        except OpenAIError as err:
            return error_response(err)
        ignored = [
            IgnoredField(name=k, reason="not a /detokenize field")
            for k in body
            if k not in _DETOKENIZE_KEYS and body[k] is not None
        ]
        text = str(self.requests.tokenizer.decode(tokens))
        return JSONResponse({"prompt": text}, headers=ignored_headers(ignored))
