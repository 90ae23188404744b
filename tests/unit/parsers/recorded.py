"""Model outputs as DeepSeek's and Hermes-style models write them (the formats of their releases'
chat templates and encoders), for the parser tests. Each is the raw completion text a server sees."""

from __future__ import annotations

# DeepSeek-R1: the prompt ends in "<think>\n", so the answer opens inside the reasoning.
R1_ANSWER = (
    "Okay, the user asks for 17 * 23. Let me multiply: 17 * 20 = 340, 17 * 3 = 51, so 340 + 51 = 391.\n"
    "Double-check: 23 * 17 = 23 * 10 + 23 * 7 = 230 + 161 = 391. Yes.\n"
    "</think>\n\n"
    "17 × 23 = **391**."
)
R1_REASONING = (
    "Okay, the user asks for 17 * 23. Let me multiply: 17 * 20 = 340, 17 * 3 = 51, so 340 + 51 = 391.\n"
    "Double-check: 23 * 17 = 23 * 10 + 23 * 7 = 230 + 161 = 391. Yes.\n"
)
R1_CONTENT = "17 × 23 = **391**."

# Some R1 distills repeat the opening tag themselves.
R1_WITH_OPEN_TAG = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."

# Cut off by max_tokens inside the reasoning: everything is reasoning.
R1_TRUNCATED = "Let me think about the Collatz sequence starting at 27. 27 -> 82 -> 41 -> 124 -> 62 -> 31 ->"

# DeepSeek-V3 / R1 tool calls: text, then one block with two calls.
V3_TOOL_CALLS = (
    "I'll check both cities for you."
    "<｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"location": "Paris, France", "unit": "celsius"}\n```'
    "<｜tool▁call▁end｜>\n"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"location": "São Paulo, Brasil", "unit": "celsius", "days": [1, 2]}\n```'
    "<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)
V3_TOOL_CALLS_ARGS = [
    {"location": "Paris, France", "unit": "celsius"},
    {"location": "São Paulo, Brasil", "unit": "celsius", "days": [1, 2]},
]

# R1 with reasoning before its call.
R1_REASONING_THEN_CALL = (
    "The user wants the weather; I should call get_weather with Berlin.\n</think>\n\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"location": "Berlin"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)

# DeepSeek-V3.1: no type, no code fence.
V31_TOOL_CALLS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"location": "Tokyo", "unit": "celsius"}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": "Asia/Tokyo"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)

# DeepSeek-V4: a DSML block after the answer's text, parameters typed by `string`.
V4_TOOL_CALLS = (
    "Let me look that up.\n\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Zürich</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="options" string="false">{"hourly": true, "fields": ["temp", "wind"]}'
    "</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n'
    '<｜DSML｜parameter name="timezone" string="true">Europe/Zurich</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
V4_TOOL_CALLS_ARGS = [
    {"location": "Zürich", "days": 3, "options": {"hourly": True, "fields": ["temp", "wind"]}},
    {"timezone": "Europe/Zurich"},
]

# V4 also writes an invoke's arguments as one JSON object.
V4_JSON_BODY = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_time">\n{"timezone": "UTC"}\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)

HERMES_TOOL_CALLS = (
    "Sure, checking now.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Lyon", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)
