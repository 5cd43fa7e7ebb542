"""The shipped chat templates: Gemma 3's turns with Hermes-style tools, and how one is chosen.

The rendering is checked against Gemma 3's turn markup written out by hand, and the tool calls
an assistant turn renders are read back with mlx-lm's own ``json_tools`` parser (the parser a
model served with the template is read with). Loading: ``chat_template`` ``none``, a shipped
name and a Jinja file on a tiny model directory; bad names and files are refused by name.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tool_parsers import json_tools

from kv_protocol import UnsupportedModelError
from kv_serve import CHAT_TEMPLATES, GEMMA3_CHAT_TEMPLATE, cli_main, encode_prompt, load_model
from kv_serve._chat_templates import resolve_chat_template
from kv_testing import build_tiny_tokenizer, save_tiny_model_dir

TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@cache
def _tokenizer() -> Any:
    return build_tiny_tokenizer()


def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The shipped Gemma 3 template's text for ``messages`` (the tiny tokenizer's BOS)."""
    text = _tokenizer().apply_chat_template(
        messages, chat_template=GEMMA3_CHAT_TEMPLATE, tokenize=False, **kwargs
    )
    assert isinstance(text, str)
    return text


def test_turns_are_gemma_3_s() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! \n"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(messages, add_generation_prompt=True) == (
        "<|bos|><start_of_turn>user\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render(messages[:1]) == "<|bos|><start_of_turn>user\nHi<end_of_turn>\n"


def test_the_system_text_opens_the_first_user_turn() -> None:
    text = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|bos|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    alone = render([{"role": "system", "content": "Be brief."}], add_generation_prompt=True)
    assert alone == ("<|bos|><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n")


def test_tools_are_listed_and_calls_read_back_with_mlx_lm_s_parser() -> None:
    calls: list[dict[str, Any]] = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {}}},
        {
            "id": "b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": 'Os"lo'}},
        },
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "3 C"},
        {"role": "tool", "tool_call_id": "b", "content": "4 C"},
        {"role": "user", "content": "Thanks"},
    ]
    text = render(messages, tools=[TOOL], add_generation_prompt=True)
    first_turn = text.split("<end_of_turn>")[0]
    assert first_turn.startswith("<|bos|><start_of_turn>user\nBe brief.\n\n")
    assert json.dumps(TOOL) in first_turn and first_turn.endswith("\n\nWeather?")
    model_turn = text.split("<start_of_turn>model\n")[1].split("<end_of_turn>")[0]
    blocks = model_turn.split(json_tools.tool_call_start)[1:]
    read = [json_tools.parse_tool_call(b.split(json_tools.tool_call_end)[0]) for b in blocks]
    assert read == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ]
    # Both results in one user turn, then the next user turn.
    assert text.endswith(
        "<start_of_turn>user\n<tool_response>\n3 C\n</tool_response>\n"
        "<tool_response>\n4 C\n</tool_response><end_of_turn>\n"
        "<start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n"
    )


def test_other_roles_are_refused_naming_the_turn() -> None:
    with pytest.raises(Exception, match="got system at turn 2"):
        render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_a_template_is_a_shipped_name_or_a_file(tmp_path: Path) -> None:
    assert resolve_chat_template("gemma3") is CHAT_TEMPLATES["gemma3"]
    assert CHAT_TEMPLATES["gemma3"].tool_parser == "json_tools"
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert resolve_chat_template(path).text == "{{ messages[0].content }}"
    assert resolve_chat_template(path).tool_parser is None
    with pytest.raises(
        UnsupportedModelError, match=r"'llama9' is neither a shipped template \(gemma3\)"
    ):
        resolve_chat_template("llama9")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(UnsupportedModelError, match="is empty"):
        resolve_chat_template(tmp_path / "empty.jinja")
    (tmp_path / "bytes.jinja").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UnsupportedModelError, match="cannot read the chat template"):
        resolve_chat_template(tmp_path / "bytes.jinja")


def test_load_model_takes_none_a_name_or_a_file(tmp_path: Path) -> None:
    plain = save_tiny_model_dir(tmp_path / "plain", "llama", chat_template=False, num_layers=2)
    assert not load_model(plain)[1].chat_template  # auto keeps a directory's own (none)
    gemma_turns = load_model(plain, chat_template="gemma3")[1]
    assert gemma_turns.chat_template == GEMMA3_CHAT_TEMPLATE
    assert gemma_turns.has_tool_calling and gemma_turns.tool_call_end == "</tool_call>"
    assert encode_prompt(gemma_turns, "Hi", chat=True) == encode_prompt(
        gemma_turns, "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    chat = save_tiny_model_dir(tmp_path / "chat", "llama", num_layers=2)
    assert load_model(chat)[1].chat_template  # auto: the directory's own
    bare = load_model(chat, chat_template="none")[1]
    assert not bare.chat_template
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        encode_prompt(bare, "Hi", chat=True)
    file = tmp_path / "brackets.jinja"
    file.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    bracketed = load_model(chat, chat_template=file)[1]
    assert encode_prompt(bracketed, "Hi", chat=True) == encode_prompt(bracketed, "[Hi]")[1:]
    with pytest.raises(UnsupportedModelError, match="neither a shipped template"):
        load_model(chat, chat_template=tmp_path / "missing.jinja")


def test_the_cli_refuses_an_unknown_template_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = save_tiny_model_dir(tmp_path / "m", "llama", num_layers=2)
    argv = ["generate", "--model", str(model), "--prompt", "Hi", "--chat-template", "llama9"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: chat template 'llama9' is neither a shipped template (gemma3)")
    assert "Traceback" not in err
    argv = ["generate", "--model", str(model), "--prompt", "Hi", "--max-tokens", "2"]
    assert cli_main([*argv, "--chat", "--chat-template", "gemma3"]) == 0
