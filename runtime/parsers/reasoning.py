"""Separating a reasoning model's `<think>...</think>` from its answer (`--reasoning-parser`).

SGLang's two DeepSeek modes, by what the chat template left open:
- `deepseek-r1`: R1's template ends the prompt inside the reasoning ("<think>\\n"), so the output starts
  as reasoning until "</think>"; an answer that never closes it is all reasoning. A leading "<think>" the
  model writes itself is dropped.
- `deepseek-v3`: V3.1 / V3.2 / V4 think only when the request asks (`chat_template_kwargs.thinking`):
  then the output starts as reasoning, as R1's; otherwise it is all content, unless the model opens a
  "<think>" block itself at the very start.

`feed` takes the output text in pieces and returns the (reasoning, content) text each piece completes,
holding back a suffix that could be the start of a marker; `finish` flushes what is held.
"""

from __future__ import annotations

from runtime.parsers.streaming import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("deepseek-r1", "deepseek-v3")


class ReasoningParser:
    def __init__(self, kind: str, *, thinking: bool = False) -> None:
        if kind not in PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; expected one of {PARSERS}")
        self.in_reasoning = kind == "deepseek-r1" or thinking
        self.at_start = True  # nothing but whitespace seen yet: a "<think>" here opens the reasoning
        self.done = False  # past "</think>": everything else is content
        self.closed = False  # a "</think>" ended the reasoning: the answer's leading newlines are dropped
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self._feed(text)
        return reasoning, self._content(content)

    def _content(self, content: str) -> str:
        if self.closed and content:
            content = content.lstrip()
            self.closed = not content
        return content

    def _feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.done:
            content, self.buf = self.buf, ""
            return reasoning, content
        if self.at_start:
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_START):
                self.buf = stripped[len(THINK_START) :]
                self.in_reasoning = True
                self.at_start = False
            elif THINK_START.startswith(stripped):
                return "", ""  # maybe the start of "<think>": wait for more
            else:
                self.at_start = False
        if not self.in_reasoning:
            self.done = True
            content, self.buf = self.buf, ""
            return reasoning, content
        end = self.buf.find(THINK_END)
        if end >= 0:
            reasoning = self.buf[:end]
            content = self.buf[end + len(THINK_END) :]
            self.buf = ""
            self.done = self.closed = True
            return reasoning, content
        keep = partial_suffix(self.buf, THINK_END)
        reasoning = self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: whatever is held back is reasoning (an unclosed block) or content."""
        rest, self.buf = self.buf, ""
        if self.in_reasoning and not self.done:
            return rest, ""
        return "", self._content(rest)

    @classmethod
    def split(cls, kind: str, text: str, *, thinking: bool = False) -> tuple[str, str]:
        """The whole output at once: (reasoning, content)."""
        p = cls(kind, thinking=thinking)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return r1 + r2, c1 + c2
