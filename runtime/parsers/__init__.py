"""Parsers of model output text: reasoning (`<think>...</think>` -> `reasoning_content`) and tool calls
(each model family's call syntax -> OpenAI `tool_calls`). Pure text processing, streaming-capable: the
HTTP layer feeds each choice's text deltas through them (runtime/http/chat_output.py)."""
