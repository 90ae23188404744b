"""Tokenizer compression: ids whose decoded text normalises to the same key share one compressed id
(NFKC, NFD, strip accents, lowercase, collapse whitespace, strip; a token that is one space stays one
space; text that does not decode cleanly keys on the raw token string)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SENTINEL = "\ue000"


def _normalizer():  # noqa: ANN202
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(SENTINEL, " "),
        ]
    )


def compression_table(tokenizer) -> np.ndarray:  # noqa: ANN001 (a transformers tokenizer)
    """lookup[tokenizer id] -> compressed id, numbered in first-seen order."""
    norm = _normalizer()
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    lookup = np.empty(n, dtype=np.int64)
    for tid, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.convert_ids_to_tokens(tid)
        else:
            key = norm.normalize_str(text) or text
        lookup[tid] = keys.setdefault(key, len(keys))
    return lookup


def load_compression_table(model_path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """The table of a model directory's tokenizer, cached beside nothing (about a second for 50K ids),
    extended to `vocab_size` (ids past the tokenizer's get ids of their own)."""
    from transformers import AutoTokenizer

    lookup = compression_table(AutoTokenizer.from_pretrained(str(model_path)))
    if vocab_size is not None and vocab_size > len(lookup):
        extra = np.arange(vocab_size - len(lookup), dtype=np.int64) + int(lookup.max()) + 1
        lookup = np.concatenate([lookup, extra])
    return lookup


def cached_compression_table(tokenizer_path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """`load_compression_table`, kept in ~/.cache/conduit/engram/ under the tokenizer files' hash (the
    table takes seconds to build and every Engram process needs it)."""
    import hashlib

    h = hashlib.sha256(str(vocab_size).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"):
        f = Path(tokenizer_path) / name
        if f.is_file():
            h.update(f.read_bytes())
    cache = Path.home() / ".cache" / "conduit" / "engram" / f"compression-{h.hexdigest()[:24]}.npy"
    if cache.is_file():
        return np.load(cache)
    lookup = load_compression_table(tokenizer_path, vocab_size)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{id(lookup)}.tmp.npy")
    np.save(tmp, lookup)
    tmp.replace(cache)
    return lookup
