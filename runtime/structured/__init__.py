"""Structured output: constraints on what a request may generate, enforced by token masks.

    specs.py    what a request asks (OpenAI `response_format`, SGLang's `regex` / `ebnf`, forced tool
                calls) -> a `GrammarSpec` message; pure Python, used by the HTTP layer
    grammar.py  xgrammar: checking a spec (the tokenizer actor answers 400 for a bad one), compiling it
                against the model's vocabulary (cached), and a matcher per request that advances by
                the tokens sampled and fills the next step's token bitmask

The worker applies the masks on the device inside sampling (runtime/gpu/grammar.py says how that
fits overlap scheduling).
"""
