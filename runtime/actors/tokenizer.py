"""The tokenizer actor: text or chat messages -> token ids, and the request checks that need them.

Tokenizing never runs on the event loop: the requests that arrive together form a batch that one call on
a tokenizer thread handles, and a large prompt goes alone to a thread of its own, so one huge request
delays neither the small ones nor anything else the frontend's loop serves. An abort that arrives while
its request is being tokenized drops the request (the scheduler never sees it); later ones go to the
scheduler behind it, so an abort never overtakes its request."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import jinja2
import structlog

from runtime import chat_templates, envs
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
LARGE_PROMPT_CHARS = 32 << 10  # a prompt this long is tokenized alone, on the large-prompt thread
MAX_BATCH = 64


def _background() -> None:
    """The large-prompt thread yields the CPU to everything else (the engine's steps on a small machine):
    a huge prompt's tokenization is the one piece of work that may wait."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


def _prompt_chars(msg: GenerateRequest) -> int:
    if msg.prompt is not None:
        return len(msg.prompt)
    if msg.messages is not None:
        return sum(len(m.content or "") for m in msg.messages)
    return len(msg.prompt_ids or ())


class TokenizerActor(Actor):
    restart_on_crash = True

    def __init__(self, info: ModelInfo, scheduler: str = addresses.scheduler(0)) -> None:
        super().__init__(addresses.TOKENIZER)
        self.scheduler = scheduler  # where tokenized requests go
        self.info = info
        self.tokenizer = info.load_tokenizer()
        self.chat_template = chat_templates.select(
            info.chat_template, self.tokenizer.chat_template, info.architecture
        )
        self._small = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large", initializer=_background)
        self._batch: list[GenerateRequest] = []  # arrived together; tokenized by one thread call
        self._pending: dict[str, bool] = {}  # rid being tokenized -> aborted meanwhile
        self._tasks: set[asyncio.Task] = set()
        self._fault = envs.injected_fault("tokenizer")

    def fresh(self) -> TokenizerActor:
        return TokenizerActor(self.info, self.scheduler)

    async def on_stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)

    async def on_crash(self, msg: Message, exc: BaseException) -> None:
        rids = list(self._pending) + [m.rid for m in self._batch]
        if isinstance(msg, GenerateRequest) and msg.rid not in rids:
            rids.append(msg.rid)
        self._pending.clear()
        self._batch.clear()
        await self.fail(rids, f"the tokenizer failed: {exc}")

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateRequest):
            if self._fault and self._fault in (msg.prompt or "") + str(msg.messages):
                raise RuntimeError("injected tokenizer fault")
            self._pending[msg.rid] = False
            if _prompt_chars(msg) >= LARGE_PROMPT_CHARS:
                self._start([msg], self._large)
                return
            self._batch.append(msg)
            if len(self._batch) == 1:
                # runs once the messages queued now are handled: the actor takes queued messages without
                # yielding to the loop, so requests that arrived together share one thread call
                asyncio.get_running_loop().call_soon(self._flush)
            elif len(self._batch) >= MAX_BATCH:
                self._flush()
        elif isinstance(msg, AbortRequest):
            if msg.rid in self._pending:
                self._pending[msg.rid] = True  # dropped when its tokenization ends
            else:
                await self.send(self.scheduler, msg)  # in order behind the request it aborts

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._start(batch, self._small)

    def _start(self, batch: list[GenerateRequest], pool: ThreadPoolExecutor) -> None:
        task = asyncio.create_task(self._run_batch(batch, pool), name="tokenize")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tokenize_all(self, batch: list[GenerateRequest]) -> list[TokenizedRequest | InvalidRequest]:
        out: list[TokenizedRequest | InvalidRequest] = []
        for msg in batch:
            try:
                out.append(self.tokenize(msg))
            except InvalidRequest as e:
                out.append(e)
        return out

    async def _run_batch(self, batch: list[GenerateRequest], pool: ThreadPoolExecutor) -> None:
        try:
            results = await asyncio.get_running_loop().run_in_executor(pool, self._tokenize_all, batch)
        except Exception as exc:  # the tokenizer itself failed: this batch's requests end with an error
            log.exception("tokenize_failed", requests=len(batch))
            rids = [m.rid for m in batch if self._pending.pop(m.rid, None) is not None]
            await self.fail(rids, f"the tokenizer failed: {exc}")
            return
        for msg, result in zip(batch, results, strict=True):
            aborted = self._pending.pop(msg.rid, None)
            if aborted is None or aborted:
                continue  # aborted while it was tokenized (or the actor crashed and failed it)
            if isinstance(result, InvalidRequest):
                await self.send(
                    addresses.CLIENT,
                    RequestFailed(rid=msg.rid, status=400, message=result.message, param=result.param),
                )
                continue
            await self.send(
                addresses.DETOKENIZER,
                TrackRequest(
                    rid=msg.rid,
                    prompt_tokens=len(result.input_ids),
                    stop=msg.params.stop,
                    skip_special_tokens=msg.params.skip_special_tokens,
                    logprobs=msg.params.logprobs,
                    prompt_tail=result.input_ids[-PROMPT_TAIL:],
                ),
            )
            await self.send(self.scheduler, result)

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
        bad = next((t for t in msg.params.stop_token_ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"stop token id {bad} is outside the vocabulary [0, {self.info.vocab_size})",
                param="stop_token_ids",
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
            disagg=msg.disagg,
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
