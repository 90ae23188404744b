"""The detokenizer: output text only, the first word's leading space kept (SentencePiece-style
tokenizers drop it at the start of a sequence), stop strings trimmed and never streamed in part."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from runtime.actors.detokenizer import DetokenizerActor
from runtime.mailbox.messages import AbortRequest, TextDeltas, TokenBatch, TrackRequest

VOCAB = ["<unk>", "▁The", "▁answer", "▁is", "▁42", ".", "▁Done", "!", "▁END"]
ID = {t: i for i, t in enumerate(VOCAB)}


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


class Recording(DetokenizerActor):
    def __init__(self, tokenizer) -> None:
        super().__init__(SimpleNamespace(load_tokenizer=lambda: tokenizer))
        self.sent: list[tuple[str, object]] = []

    async def send(self, to: str, msg) -> None:
        self.sent.append((to, msg))


def run(tokenizer, stop: list[str], steps: list[list[str]], finish_last: str = "length"):
    actor = Recording(tokenizer)
    prompt = [ID["▁The"], ID["▁answer"], ID["▁is"]]

    async def main():
        await actor.handle(
            TrackRequest(
                rid="r",
                prompt_tokens=3,
                stop=stop,
                skip_special_tokens=True,
                logprobs=None,
                prompt_tail=prompt,
            )
        )
        for i, toks in enumerate(steps):
            finish = finish_last if i == len(steps) - 1 else None
            ids = [ID[t] for t in toks]
            await actor.handle(TokenBatch(["r"], [ids], [finish], [3], [i + 1], [0], [None]))

    asyncio.run(main())
    deltas = [d for to, m in actor.sent if isinstance(m, TextDeltas) for d in m.items]
    aborts = [m for to, m in actor.sent if isinstance(m, AbortRequest)]
    return deltas, aborts


def test_first_output_word_keeps_its_leading_space(metaspace_tokenizer):
    assert metaspace_tokenizer.decode([ID["▁42"]]) == "42"  # what a context-free decode would stream
    deltas, _ = run(metaspace_tokenizer, [], [["▁42"], ["."], ["▁Done"]])
    assert [d.text for d in deltas] == [" 42", ".", " Done"]
    assert deltas[-1].finish_reason == "length"


def test_stop_string_is_trimmed_and_never_streamed_in_part(metaspace_tokenizer):
    deltas, aborts = run(metaspace_tokenizer, [" Done!"], [["▁42"], ["▁Done"], ["!"], ["▁END"]])
    text = "".join(d.text for d in deltas)
    assert text == " 42"
    assert deltas[-1].finish_reason == "stop"
    assert all("Done" not in d.text for d in deltas)  # " Done" was held back until it could be judged
    assert [a.reason for a in aborts] == ["stop"]  # the scheduler is told to stop generating
