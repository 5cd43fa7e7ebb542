"""Which grammar, if any, constrains a request's output: tool-call formats and JSON schemas.

A request may ask for output the model cannot give as asked: tools from a model with no
tool-call format mlx-lm recognises, a ``tool_choice`` enforced on a format no grammar here
writes, a schema that does not compile. Each of those is a 400 naming the field at fault.
"""

from __future__ import annotations

from typing import Any

from kv_protocol import TokenConstraintFactory

from ._server_harmony import harmony_call_grammar
from ._server_protocol import CompletionRequest, OpenAIError
from ._server_tools import ToolFormat, ToolRequest
from ._server_worker import EngineWorker
from ._structured import GrammarCompiler, GrammarError

__all__ = ["OutputPolicy"]


class OutputPolicy:
    """The served model's tool-call format and the grammars that constrain its output.

    ``eos`` (the model's end-of-sequence ids within its vocabulary) is set once the engine
    runs; the grammar compiler is built at the first structured-output request (reading the
    vocabulary takes a while).
    """

    def __init__(
        self, tokenizer: Any, *, model_name: str, harmony: bool, worker: EngineWorker
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.harmony = harmony
        self.worker = worker
        self.eos: frozenset[int] = frozenset()
        self._grammars: GrammarCompiler | None = None

    def tool_format(self, tools: ToolRequest | None) -> ToolFormat | None:
        """How the served model writes tool calls; a request that needs one it lacks is a 400."""
        if tools is None or not tools.parses or self.harmony:
            return None
        tokenizer = self.tokenizer
        parser = getattr(tokenizer, "tool_parser", None)
        start = getattr(tokenizer, "tool_call_start", None)
        end = getattr(tokenizer, "tool_call_end", None)
        if not getattr(tokenizer, "has_tool_calling", False) or parser is None or not end:
            raise OpenAIError(
                400,
                f"{self.model_name!r} has no tool-call format mlx-lm recognises in its chat "
                'template, so its tools cannot be called; give tool_choice "none" to render '
                "them only",
                param="tools",
                code="unsupported_parameter",
            )
        is_json = str(getattr(parser, "__module__", "")).endswith(".json_tools")
        return ToolFormat(str(start), str(end), parser, json=is_json)

    def constraint(self, request: CompletionRequest) -> TokenConstraintFactory | None:
        """The request's grammar (a JSON format, a required tool call), or ``None``.

        A schema that does not compile is a 400 naming it.
        """
        if request.tools is not None and request.tools.enforced:
            return self._tool_constraint(request.tools, self.tool_format(request.tools))
        fmt = request.response_format
        if fmt is None:
            return None
        grammars = self._compiler()
        try:
            return grammars.json_schema(fmt.schema)
        except GrammarError as err:
            param = "response_format.json_schema.schema"
            raise OpenAIError(
                400,
                f"{param} cannot be compiled into a grammar: {err}",
                param=param,
                code="invalid_json_schema",
            ) from None

    def _tool_constraint(
        self, tools: ToolRequest, fmt: ToolFormat | None
    ) -> TokenConstraintFactory | None:
        enforced = tools.enforced
        if not enforced or (fmt is None and not self.harmony):
            return None
        if fmt is not None and not fmt.json:
            raise OpenAIError(
                400,
                f"tool_choice {tools.choice!r} is enforced with a grammar of JSON tool calls "
                f"(<tool_call>{{...}}</tool_call>, Hermes / Qwen style) or of harmony calls; "
                f"{self.model_name!r} writes them as {fmt.start}...{fmt.end}, which it cannot "
                "enforce",
                param="tool_choice",
                code="unsupported_parameter",
            )
        functions = [(t.name, t.parameters) for t in enforced]
        try:
            if fmt is None:  # harmony
                return self._compiler().lark(harmony_call_grammar(functions))
            return self._compiler().tool_calls(
                functions, start=fmt.start, end=fmt.end, parallel=tools.parallel
            )
        except GrammarError as err:
            raise OpenAIError(
                400,
                f"tools: a function's parameters cannot be compiled into a grammar: {err}",
                param="tools",
                code="invalid_json_schema",
            ) from None

    def _compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            try:
                self._grammars = GrammarCompiler(self.tokenizer, self.worker.vocab_size, self.eos)
            except GrammarError as err:
                raise OpenAIError(
                    400,
                    f"response_format: structured output is not available for this model: {err}",
                    param="response_format",
                    code="unsupported_parameter",
                ) from None
        return self._grammars
