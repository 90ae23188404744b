"""The two nouns of a benchmark run: a Prompt to send and the RequestResult it produced."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prompt:
    """One request of a dataset. `prompt` is text, or token ids for the random-ids dataset."""

    prompt: str | list[int]
    input_len: int  # client-side token count of the prompt (tokenizer, or a word-count estimate)
    output_len: int  # max_tokens to ask for


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start_s`/`end_s` are offsets from the benchmark start."""

    index: int
    input_len: int  # client-side count
    output_len_requested: int
    success: bool = False
    error: str = ""
    status: int = 0  # HTTP status (0: no answer)
    start_s: float = 0.0
    end_s: float = 0.0
    e2e_s: float = 0.0  # measured directly (not end - start) so TTFT <= E2E holds exactly
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None  # from the server's usage
    output_chunks: int = 0  # content chunks received
    retokenized_output_tokens: int | None = None  # the generated text re-encoded with --tokenizer
    text: str = ""  # generated text; dropped from the JSON

    @property
    def output_tokens(self) -> int:
        """Server's count when it reported usage, else the number of content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.output_chunks

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_len

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "text"}

    @classmethod
    def from_json(cls, d: dict) -> RequestResult:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**d)
