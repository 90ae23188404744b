"""The tokenizer actor: text or chat messages -> token ids, and the request checks that need them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jinja2
import structlog

from runtime import chat_templates
from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.errors import InvalidRequest
from runtime.mailbox.messages import (
    AbortRequest,
    GenerateRequest,
    Message,
    RequestFailed,
    TokenizedRequest,
    TrackRequest,
)

if TYPE_CHECKING:
    from runtime.model_info import ModelInfo

log = structlog.get_logger(__name__)

# Prompt ids handed to the detokenizer as decoding context: SentencePiece-style tokenizers drop the
# leading space of a sequence's first token, so an answer's first word must be decoded after the prompt.
PROMPT_TAIL = 6


class TokenizerActor(Actor):
    def __init__(self, info: ModelInfo, scheduler: str = addresses.scheduler(0)) -> None:
        super().__init__(addresses.TOKENIZER)
        self.scheduler = scheduler  # where tokenized requests go
        self.info = info
        self.tokenizer = info.load_tokenizer()
        self.chat_template = chat_templates.select(
            info.chat_template, self.tokenizer.chat_template, info.architecture
        )

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                tokenized = self.tokenize(msg)
            except InvalidRequest as e:
                await self.send(
                    addresses.CLIENT, RequestFailed(rid=msg.rid, status=400, message=e.message, param=e.param)
                )
                return
            await self.send(
                addresses.DETOKENIZER,
                TrackRequest(
                    rid=msg.rid,
                    prompt_tokens=len(tokenized.input_ids),
                    stop=msg.params.stop,
                    skip_special_tokens=msg.params.skip_special_tokens,
                    logprobs=msg.params.logprobs,
                    prompt_tail=tokenized.input_ids[-PROMPT_TAIL:],
                ),
            )
            await self.send(self.scheduler, tokenized)
        elif isinstance(msg, AbortRequest):
            await self.send(self.scheduler, msg)  # in order behind the request it aborts

    def encode_prompt(self, msg: GenerateRequest) -> tuple[list[int], str]:
        """The prompt's token ids and the name of the field they came from (for error messages)."""
        if msg.prompt_ids is not None:
            bad = next((t for t in msg.prompt_ids if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"token id {bad} is outside the vocabulary [0, {self.info.vocab_size})", param="prompt"
                )
            return list(msg.prompt_ids), "prompt"
        if msg.messages is not None:
            if not self.chat_template:
                raise InvalidRequest(
                    "this model has no chat template; give one with --chat-template, or use /v1/completions",
                    param="messages",
                )
            try:
                text = chat_templates.render(self.tokenizer, self.chat_template, msg)
            except (jinja2.TemplateError, TypeError, ValueError) as e:
                raise InvalidRequest(
                    f"the chat template failed on these messages: {e}", param="messages"
                ) from None
            return self.tokenizer.encode(text, add_special_tokens=False), "messages"
        return self.tokenizer.encode(msg.prompt or "", add_special_tokens=True), "prompt"

    def tokenize(self, msg: GenerateRequest) -> TokenizedRequest:
        ids, field = self.encode_prompt(msg)
        limit = self.info.max_model_len
        if not ids:
            raise InvalidRequest("the prompt is empty", param=field)
        if len(ids) >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but the prompt has {len(ids)} tokens",
                param=field,
            )
        max_tokens = msg.params.max_tokens
        if max_tokens is None:
            max_tokens = limit - len(ids)
        elif len(ids) + max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceeds the maximum context "
                f"length of {limit} tokens",
                param="max_tokens",
            )
        if msg.params.grammar is not None:
            check_grammar(msg)
        stop_ids = ([] if msg.params.ignore_eos else list(self.info.eos_token_ids)) + list(
            msg.params.stop_token_ids
        )
        return TokenizedRequest(
            rid=msg.rid,
            input_ids=ids,
            params=msg.params,
            stop_ids=stop_ids,
            max_new_tokens=max_tokens,
            priority=msg.priority,
            arrival=msg.arrival,
        )


def check_grammar(msg: GenerateRequest) -> None:
    """A constraint xgrammar cannot build is the client's error (400), found before the request queues."""
    from runtime.structured.grammar import check  # xgrammar: imported with the first constrained request

    spec = msg.params.grammar
    try:
        check(spec)
    except ValueError as e:
        where = {"regex": "regex", "ebnf": "ebnf"}.get(spec.kind, "tools" if msg.tools else "response_format")
        raise InvalidRequest(f"The {spec.kind} constraint is invalid: {e}", param=where) from None
