"""Chat templates kv-serve ships, for models that come without one, and how one is chosen.

The packaged Gemma 3 270M is a base model: its GGUF carries no chat template, so chat, tools
and the Messages API could not be tried on it. :data:`GEMMA3_CHAT_TEMPLATE` is Gemma 3's turn
markup (``<start_of_turn>user`` / ``model`` ... ``<end_of_turn>``, the system text opening the
first user turn) with function tools added in the Hermes / Qwen form: the tools listed as JSON
in the system text, a call written ``<tool_call>``, newline, ``{"name": ..., "arguments":
{...}}``, newline, ``</tool_call>``, and a tool's result sent back in ``<tool_response>``
tags in a user turn. Calls in that form are what mlx-lm's ``json_tools`` parser reads and
what ``tool_choice`` ``required`` / a named function can enforce with a grammar; a base model
rarely calls a tool on its own (``auto``). Hugging Face renders templates with
``trim_blocks``: a newline right after a block tag is printed by an expression.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kv_protocol import UnsupportedModelError

__all__ = [
    "CHAT_TEMPLATES",
    "GEMMA3_CHAT_TEMPLATE",
    "ChatTemplate",
    "resolve_chat_template",
]

_TOOLS = (
    "You can call these functions; each is described by one JSON object:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'To call one, answer <tool_call>\n{"name": <function name>, "arguments": '
    "<arguments object>}\n</tool_call> (one such block per call). The result of a call comes "
    "back in <tool_response> tags."
)

#: Gemma 3's turns with Hermes-style tools (see the module's docstring).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0].role == 'system' %}"
    "{% set system = messages[0].content %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% if tools %}{% set listing %}" + _TOOLS + "{% endset %}"
    "{% set system = (system ~ '\n\n' ~ listing) if system else listing %}{% endif %}"
    "{% if system and (not turns or turns[0].role != 'user') %}"
    "<start_of_turn>user\n{{ system }}<end_of_turn>\n{% endif %}"
    "{% for message in turns %}"
    "{% if message.role == 'user' %}"
    "<start_of_turn>user\n{% if loop.first and system %}{{ system }}\n\n{% endif %}"
    "{{ message.content }}<end_of_turn>\n"
    "{% elif message.role == 'assistant' %}"
    "<start_of_turn>model\n{{ (message.content or '') | trim }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if call.function %}{% set call = call.function %}{% endif %}"
    '<tool_call>\n{"name": {{ call.name | tojson }}, "arguments": '
    "{{ call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<end_of_turn>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<start_of_turn>user\n"
    "{% endif %}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<end_of_turn>\n"
    "{% else %}{{ '\\n' }}{% endif %}"
    "{% else %}"
    "{{ raise_exception('Gemma 3 takes the roles user, assistant and tool after one optional "
    "first system message; got ' ~ message.role ~ ' at turn ' ~ loop.index) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A chat template to load a tokenizer with, and the tool parser its calls need.

    ``tool_parser`` names one of mlx-lm's ``mlx_lm.tool_parsers`` modules (``None``: let
    mlx-lm find it from the template, as ``mlx_lm.load`` does).
    """

    name: str
    text: str
    tool_parser: str | None = None


#: The templates kv-serve ships, by the name ``--chat-template`` takes.
CHAT_TEMPLATES: dict[str, ChatTemplate] = {
    "gemma3": ChatTemplate(name="gemma3", text=GEMMA3_CHAT_TEMPLATE, tool_parser="json_tools"),
}


def resolve_chat_template(value: str | Path) -> ChatTemplate:
    """The template ``value`` names: a shipped one by name, or a Jinja file's text.

    Raises :class:`UnsupportedModelError` naming the shipped templates for anything else.
    """
    text = str(value)
    if text in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[text]
    path = Path(text).expanduser()
    if path.is_file():
        try:
            body = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UnsupportedModelError(f"cannot read the chat template {path}: {err}") from None
        if not body.strip():
            raise UnsupportedModelError(f"the chat template {path} is empty")
        return ChatTemplate(name=str(path), text=body)
    shipped = ", ".join(sorted(CHAT_TEMPLATES))
    raise UnsupportedModelError(
        f"chat template {text!r} is neither a shipped template ({shipped}), 'none', 'auto' "
        "nor a Jinja file"
    )
