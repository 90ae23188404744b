"""xgrammar behind one small interface: check a spec, compile it for a vocabulary, match a request.

    check(spec)                             raises ValueError with xgrammar's reason for a bad spec
    compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids)
    matcher = compiler.matcher(spec)        a request's matcher (compiled grammars are cached by spec)
    matcher.accept(token) / matcher.fill(bitmask, i) / matcher.terminated

Compiling needs the tokenizer's vocabulary (the worker's: runtime/gpu/grammar.py); checking does not
(the tokenizer actor's, so a bad schema is a 400 before the request is queued).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import xgrammar as xgr

from runtime.mailbox.messages import GrammarSpec

JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False, "strict_mode": True}
CACHE_ENTRIES = 256
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def check(spec: GrammarSpec) -> None:
    """Build the spec's grammar without a vocabulary; ValueError (with xgrammar's message) if invalid."""
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.spec, **JSON_OPTIONS)
        elif spec.kind == "json_object":
            pass
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.spec)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.spec)
        else:
            raise ValueError(f"unknown constraint kind {spec.kind!r}")
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises these for bad input
        raise ValueError(_reason(e)) from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    lines = str(e).strip().splitlines()
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (nothing changes then)."""
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the constrained output is complete."""
        return self._m.is_terminated()

    def fill(self, bitmask, index: int) -> None:
        """Write the allowed next tokens into row `index` of an int32 bitmask (xgrammar's layout:
        bit t % 32 of word t // 32)."""
        self._m.fill_next_token_bitmask(bitmask, index)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], threads: int = 1) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: dict[GrammarSpec, xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()  # compiles may run on a helper thread
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        c = self._compiler
        if spec.kind == "json_schema":
            compiled = c.compile_json_schema(spec.spec, **JSON_OPTIONS)
        elif spec.kind == "json_object":
            compiled = c.compile_json_schema(json.dumps({"type": "object"}), **JSON_OPTIONS)
        elif spec.kind == "regex":
            compiled = c.compile_regex(spec.spec)
        elif spec.kind == "ebnf":
            compiled = c.compile_grammar(spec.spec)
        elif spec.kind == "structural_tag":
            compiled = c.compile_structural_tag(spec.spec)
        else:
            raise ValueError(f"unknown constraint kind {spec.kind!r}")
        with self._lock:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
        return compiled

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return Matcher(self.compile(spec))
