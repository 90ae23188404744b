"""The chat template a model gets, and DeepSeek's built-in formats rendered from OpenAI-shaped
conversations (tools, calls, results, thinking)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from runtime import chat_templates
from runtime.mailbox.messages import ChatMessage, FunctionTool, GenerateRequest, SamplingParams, ToolCall

BOS = "<｜begin▁of▁sentence｜>"
WEATHER = FunctionTool(
    name="get_weather",
    description="Weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
TURNS = [
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage(
        "assistant", "", tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 2}')]
    ),
    ChatMessage("tool", "18C", tool_call_id="call_1"),
    ChatMessage("assistant", "It is 18C.", reasoning_content="Read the result."),
    ChatMessage("user", "Thanks"),
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    tok.bos_token = BOS  # DeepSeek's, so the rendered text reads as DeepSeek's prompts do
    return tok


def render(tokenizer, name: str, messages, tools=None, **kwargs) -> str:
    req = GenerateRequest(
        rid="r", params=SamplingParams(), messages=messages, tools=tools, chat_template_kwargs=kwargs or None
    )
    return chat_templates.render(tokenizer, chat_templates.builtin(name), req)


def test_deepseek_v3_turns_calls_and_results(tokenizer):
    text = render(tokenizer, "deepseek-v3", TURNS)
    assert text == (
        BOS + "<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>It is 18C.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜>"
    )


def test_deepseek_v3_describes_tools_and_switches_thinking(tokenizer):
    text = render(tokenizer, "deepseek-v3", [ChatMessage("system", "Be brief."), TURNS[0]], tools=[WEATHER])
    assert text.startswith(BOS + "Be brief.\n\n## Tools")
    assert '"name": "get_weather"' in text and text.endswith("<｜User｜>Weather in Paris?<｜Assistant｜>")
    assert render(tokenizer, "deepseek-v3", TURNS[:1], thinking=True).endswith("<｜Assistant｜><think>")
    assert render(tokenizer, "deepseek-v3", TURNS[:1], thinking=False).endswith("<｜Assistant｜></think>")
    assert render(tokenizer, "deepseek-r1", TURNS[:1]).endswith("<｜Assistant｜><think>\n")
    # R1 drops an earlier answer's reasoning
    r1 = render(tokenizer, "deepseek-r1", [TURNS[0], ChatMessage("assistant", "hmm</think>Sunny."), TURNS[4]])
    assert "hmm" not in r1 and "<｜Assistant｜>Sunny.<｜end▁of▁sentence｜>" in r1


def test_deepseek_v4_chat_mode(tokenizer):
    text = render(tokenizer, "deepseek-v4", TURNS)
    assert text == (
        BOS + "<｜User｜>Weather in Paris?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>18C</tool_result><｜Assistant｜></think>It is 18C.<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks<｜Assistant｜></think>"
    )


def test_deepseek_v4_thinking_mode_tools_and_max_effort(tokenizer):
    text = render(tokenizer, "deepseek-v4", TURNS, tools=[WEATHER], thinking=True, reasoning_effort="max")
    assert text.startswith(BOS + "Reasoning Effort: Absolute maximum")
    assert "\n\n## Tools\n\nYou have access to a set of tools" in text
    assert '{"name": "get_weather", "description": "Weather", "parameters":' in text
    # with tools every turn keeps its reasoning, and each answer opens in thinking
    assert "<｜Assistant｜><think>Read the result.</think>It is 18C." in text
    assert text.endswith("<｜User｜>Thanks<｜Assistant｜><think>")
    # without tools, earlier turns' reasoning is dropped
    plain = render(tokenizer, "deepseek-v4", TURNS, thinking=True)
    assert "Read the result." not in plain and plain.endswith("<｜Assistant｜><think>")


def test_which_template_a_model_gets(tmp_path):
    assert chat_templates.select("asked", "own", "DeepseekV3ForCausalLM") == "asked"
    assert chat_templates.select(None, "own", "DeepseekV3ForCausalLM") == "own"
    assert chat_templates.select(None, None, "DeepseekV3ForCausalLM") == chat_templates.builtin("deepseek-v3")
    assert chat_templates.select(None, None, "DeepseekV4ForCausalLM") == chat_templates.builtin("deepseek-v4")
    assert chat_templates.select(None, None, "LlamaForCausalLM") is None
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert chat_templates.load(str(f)) == "{{ messages[0]['content'] }}"
    assert chat_templates.load("deepseek-r1").startswith("{%- set r1 = true -%}")
    assert chat_templates.load("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(FileNotFoundError, match="deepseek-v3"):
        chat_templates.load("no/such/template.jinja")
