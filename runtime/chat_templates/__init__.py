"""Chat templates: which one a model gets, and the conversation it is rendered from.

The template is, in order: `--chat-template` (a file, a built-in name, or the Jinja text itself), the
tokenizer's own, or the built-in for the model's family when its checkpoint has none (DeepSeek-V3's
and V4's releases ship their format in code, not in tokenizer_config.json). The built-ins are files of
this package (deepseek_v3.jinja, deepseek_v4.jinja); nothing is downloaded.

The conversation handed to the template is OpenAI's shape as Hugging Face templates expect it: an
assistant's `tool_calls` as `{"id", "type": "function", "function": {"name", "arguments"}}` with the
arguments parsed into an object where they are JSON (templates iterate or `tojson` them, as vLLM
passes them), a tool result's `tool_call_id`, an assistant's `reasoning_content`; the request's
`tools` and `chat_template_kwargs` (DeepSeek's `thinking`, `reasoning_effort`) are template variables.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from runtime.mailbox.messages import ChatMessage, GenerateRequest

# name -> (file, a Jinja prelude that sets the variant's switch)
BUILTIN: dict[str, tuple[str, str]] = {
    "deepseek-v3": ("deepseek_v3.jinja", ""),
    "deepseek-r1": ("deepseek_v3.jinja", "{%- set r1 = true -%}"),
    "deepseek-v4": ("deepseek_v4.jinja", ""),
}
# the built-in a checkpoint without a template gets, by its config.json architecture
BY_ARCHITECTURE = {"DeepseekV3ForCausalLM": "deepseek-v3", "DeepseekV4ForCausalLM": "deepseek-v4"}


def builtin(name: str) -> str:
    file, prelude = BUILTIN[name]
    return prelude + resources.files(__package__).joinpath(file).read_text(encoding="utf-8")


def load(asked: str) -> str:
    """The template `--chat-template` names: a file, a built-in, or the template text itself."""
    path = Path(asked)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if asked in BUILTIN:
        return builtin(asked)
    if "{{" in asked or "{%" in asked:
        return asked
    raise FileNotFoundError(
        f"--chat-template {asked}: not a file, a Jinja template, or one of {sorted(BUILTIN)}"
    )


def select(asked: str | None, own: str | None, architecture: str | None) -> str | None:
    """The template to use: the asked one, else the tokenizer's, else the family's built-in."""
    if asked:
        return asked
    if own:
        return own
    name = BY_ARCHITECTURE.get(architecture or "")
    return builtin(name) if name else None


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def message_dict(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in m.tool_calls
        ]  # content stays a string ("" with only calls): templates that concatenate it then work
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def render(tokenizer, template: str, req: GenerateRequest) -> str:
    """The prompt text of a chat request (raises jinja2's errors for a template that fails)."""
    conversation = [message_dict(m) for m in req.messages or []]
    tools = [t.openai() for t in req.tools] if req.tools else None
    kwargs = dict(req.chat_template_kwargs or {})
    return tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=req.add_generation_prompt,
        **kwargs,
    )
