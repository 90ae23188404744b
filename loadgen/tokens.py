"""Token counting and prompt text: a Hugging Face tokenizer from --tokenizer, or a word-list estimate."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from loadgen.errors import LoadgenError

# Short common English words: each is about one BPE token with its leading space.
WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or "
    "have had one their not but they all we been has there who more would when will up other its into "
    "some time than only new two first these may any over after also most made many before such where "
    "through long back years much well down should each just those people how because good very work "
    "state day year still world own life see under last never under know house great old high part "
    "small place left same end water city point home light form line word name hand side game power "
    "land case car book head sea field war land open order road court body room face money law fire "
    "music tree south north east west river group plan team rain star tea cup song dog cat bird fish"
).split()


class Codec(Protocol):
    vocab_size: int
    exact: bool  # False for the word-count estimate

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class WordCodec:
    """Without a tokenizer: one word of WORDS per token, counted by splitting on whitespace."""

    vocab_size = len(WORDS)
    exact = False

    def encode(self, text: str) -> list[int]:
        return [hash(w) % self.vocab_size for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(WORDS[i % self.vocab_size] for i in ids)


class HFCodec:
    exact = True

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any load failure is one clear message
            raise LoadgenError(f"cannot load tokenizer from {path!r}: {type(e).__name__}: {e}") from None
        self.vocab_size = len(self.tok)
        self.special = set(self.tok.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_codec(path: str | None) -> Codec:
    return HFCodec(path) if path else WordCodec()


def random_ids(codec: Codec, n: int, rng: np.random.Generator) -> list[int]:
    """n random token ids, avoiding special tokens."""
    special = getattr(codec, "special", set())
    ids = rng.integers(0, codec.vocab_size, size=n).tolist()
    return [i if i not in special else (i + 1) % codec.vocab_size for i in ids]


def random_text(codec: Codec, n: int, rng: np.random.Generator) -> str:
    return codec.decode(random_ids(codec, n, rng))
