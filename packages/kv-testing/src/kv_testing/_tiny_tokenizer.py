"""A tiny in-memory byte-level BPE tokenizer (with a chat template) for the tiny models.

Built with the ``tokenizers`` library from a short built-in corpus; nothing is downloaded.
Byte-level, so any text encodes and a multi-byte character can be split across tokens
(what a streaming decoder must handle). Wrapped like :func:`mlx_lm.load` wraps a real
tokenizer (mlx-lm's ``TokenizerWrapper``), so servers and generators treat it as they treat
a real one.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = [
    "TINY_CHAT_TEMPLATE",
    "TINY_SPECIAL_TOKENS",
    "TINY_HARMONY_CHAT_TEMPLATE",
    "TINY_HARMONY_TOKENS",
    "TINY_TOOL_CHAT_TEMPLATE",
    "build_tiny_tokenizer",
]

#: Special tokens, ids 0.. in this order: end of text, begin of text, the chat markers.
TINY_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|bos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)

#: A minimal chat template over the special tokens (``<|role|>content<|end|>`` per turn).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: A chat template with tools, Hermes / Qwen style: the tools listed as JSON in a system turn,
#: a call written ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, a tool's
#: result as a ``<tool_response>`` user turn (mlx-lm reads calls in this form: ``json_tools``).
TINY_TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>You can call these functions:\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}"
    'To call one, answer <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>'
    "<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|assistant|>{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|end|>"
    "{%- elif message.role == 'tool' %}"
    "<|user|><tool_response>\n{{ message.content }}\n</tool_response><|end|>"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)

#: gpt-oss's harmony markers, added after the tiny tokenizer's own tokens (``<|end|>`` is
#: already one of those).
TINY_HARMONY_TOKENS = (
    "<|start|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)

#: A chat template in gpt-oss's harmony format: each message ``<|start|>role ... <|message|>
#: text<|end|>``; the tools as a TypeScript-like ``functions`` namespace in a developer
#: message; an assistant's answer on the ``final`` channel, a call on ``commentary`` addressed
#: ``to=functions.NAME`` with ``<|constrain|>json`` and ended by ``<|call|>``; a tool's result
#: from ``functions.NAME to=assistant``. The generation prompt is ``<|start|>assistant``.
TINY_HARMONY_CHAT_TEMPLATE = (
    "{% set ns = namespace(last='') %}"
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n\n"
    "{% for tool in tools %}{% set f = tool.function if tool.function else tool %}"
    "{% if f.description %}// {{ f.description }}\n{% endif %}"
    "type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;\n\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{% if message.content %}<|start|>assistant<|channel|>final<|message|>"
    "{{ message.content }}<|end|>{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% if call.function %}{% set call = call.function %}{% endif %}"
    "{% set ns.last = call.name %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.name }} <|constrain|>json"
    "<|message|>{{ call.arguments | tojson }}<|call|>"
    "{% endfor %}"
    "{% elif message.role == 'tool' %}"
    "<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{% else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

_CORPUS = (
    "The river rises in the hills north of the town and runs south to the sea. "
    "In spring the water is high and fast; the old stone bridge is often closed. "
    "Children swim in it during the summer, and people walk along its banks. "
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9: 3\u20ac or 2\u00a3. "
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002 \u00bfQu\u00e9 tal? \U0001f600 \U0001f680 "
    "def main():\n    return 42\n"
)


@cache
def _backend(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos = TINY_SPECIAL_TOKENS[1]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, 1)]
    )
    return tokenizer


def build_tiny_tokenizer(
    *,
    vocab_size: int = 320,
    chat_template: bool = True,
    tools: bool = False,
    harmony: bool = False,
) -> Any:
    """An mlx-lm ``TokenizerWrapper`` around a byte-level BPE of about ``vocab_size`` tokens.

    Ids ``0 .. len(TINY_SPECIAL_TOKENS) - 1`` are :data:`TINY_SPECIAL_TOKENS`; the 256 byte
    tokens and the learned merges follow. ``len(tokenizer)`` is the real size (at most
    ``vocab_size``): build the model with that vocabulary. Encoding adds ``<|bos|>``; the end
    of sequence ids are ``<|endoftext|>`` and ``<|end|>``. Without ``chat_template`` the
    tokenizer has none (for the "no chat template" paths). With ``tools`` its template is
    :data:`TINY_TOOL_CHAT_TEMPLATE` and the wrapper knows its tool-call markers and parser
    (mlx-lm's ``json_tools``), as :func:`mlx_lm.load` finds them for such a template.
    With ``harmony`` the :data:`TINY_HARMONY_TOKENS` follow as special tokens, the template is
    :data:`TINY_HARMONY_CHAT_TEMPLATE` and ``<|return|>`` and ``<|call|>`` end a sequence too
    (as gpt-oss's generation config has it); mlx-lm knows no parser for it.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    backend = _backend(vocab_size)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend.__class__.from_str(backend.to_str()),
        bos_token=TINY_SPECIAL_TOKENS[1],
        eos_token=TINY_SPECIAL_TOKENS[0],
        additional_special_tokens=list(TINY_SPECIAL_TOKENS[2:]),
    )
    end = TINY_SPECIAL_TOKENS.index("<|end|>")
    if harmony:
        hf.add_special_tokens(
            {"additional_special_tokens": [*TINY_SPECIAL_TOKENS[2:], *TINY_HARMONY_TOKENS]}
        )
        hf.chat_template = TINY_HARMONY_CHAT_TEMPLATE
        ends = hf.convert_tokens_to_ids(["<|return|>", "<|call|>"])
        return TokenizerWrapper(hf, eos_token_ids=[0, end, *ends])
    if tools:
        from mlx_lm.tool_parsers import json_tools

        hf.chat_template = TINY_TOOL_CHAT_TEMPLATE
        return TokenizerWrapper(
            hf,
            eos_token_ids=[0, end],
            tool_call_start=json_tools.tool_call_start,
            tool_call_end=json_tools.tool_call_end,
            tool_parser=json_tools.parse_tool_call,
        )
    if chat_template:
        hf.chat_template = TINY_CHAT_TEMPLATE
    return TokenizerWrapper(hf, eos_token_ids=[0, end])
