"""Datasets: each builder returns a list of Prompts. Named and parameterised as bench_serving does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadgen.errors import LoadgenError
from loadgen.records import Prompt
from loadgen.tokens import Codec, random_ids, random_text

DATASETS = ("random", "random-ids", "shared-prefix", "sharegpt", "jsonl")


def sample_lens(mean: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """bench_serving's lengths: uniform in [max(1, mean*ratio), mean]."""
    lo = max(int(mean * ratio), 1)
    return rng.integers(lo, max(mean, lo) + 1, size=n).tolist()


def random_prompts(
    n: int, input_len: int, output_len: int, ratio: float, codec: Codec, rng: np.random.Generator
) -> list[Prompt]:
    ins, outs = sample_lens(input_len, ratio, n, rng), sample_lens(output_len, ratio, n, rng)
    return [Prompt(random_text(codec, i, rng), i, o) for i, o in zip(ins, outs, strict=True)]


def random_id_prompts(
    n: int, input_len: int, output_len: int, ratio: float, codec: Codec, rng: np.random.Generator
) -> list[Prompt]:
    ins, outs = sample_lens(input_len, ratio, n, rng), sample_lens(output_len, ratio, n, rng)
    return [Prompt(random_ids(codec, i, rng), i, o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_prompts(
    groups: int, per_group: int, system_len: int, question_len: int, output_len: int, codec: Codec,
    rng: np.random.Generator,
) -> list[Prompt]:  # fmt: skip
    """bench_serving's generated-shared-prefix: `groups` system prompts, each followed by
    `per_group` different questions; the order is shuffled so groups interleave."""
    out = []
    for _ in range(groups):
        system = random_text(codec, system_len, rng)
        for _ in range(per_group):
            text = system + "\n\n" + random_text(codec, question_len, rng)
            out.append(Prompt(text, len(codec.encode(text)), output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def sharegpt_prompts(
    path: str, n: int, codec: Codec, rng: np.random.Generator, fixed_output_len: int | None = None
) -> list[Prompt]:
    """First human turn as the prompt, the reply's length as output_len (or `fixed_output_len`).
    Drops pairs under 4 tokens or over 1024 prompt / 2048 total tokens, as bench_serving does."""
    data = _load_json(path)
    if not isinstance(data, list):
        raise LoadgenError(f"{path}: expected a JSON list of ShareGPT conversations")
    convs = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    pairs = [(c[0]["value"], c[1]["value"]) for c in convs if isinstance(c, list) and len(c) >= 2]
    out: list[Prompt] = []
    for i in rng.permutation(len(pairs)):
        if len(out) == n:
            break
        prompt, reply = pairs[i]
        p_len = len(codec.encode(prompt))
        o_len = fixed_output_len or len(codec.encode(reply))
        if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
            continue
        out.append(Prompt(prompt, p_len, o_len))
    if not out:
        raise LoadgenError(f"{path}: no usable conversations (need 'conversations' with two turns)")
    return out


def jsonl_prompts(path: str, n: int, codec: Codec, default_output_len: int) -> list[Prompt]:
    """One {"prompt": str, "output_len": int} object per line; output_len is optional."""
    out = []
    for lineno, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            text = d["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LoadgenError(
                f'{path}:{lineno}: expected {{"prompt": ..., "output_len": ...}}: {e}'
            ) from None
        out.append(Prompt(text, len(codec.encode(text)), int(d.get("output_len") or default_output_len)))
        if len(out) == n:
            break
    if not out:
        raise LoadgenError(f"{path}: no prompts")
    return out


def build(args, codec: Codec, n: int, rng: np.random.Generator) -> list[Prompt]:
    """The dataset named by args.dataset_name, `n` prompts (fewer if a file holds fewer)."""
    name = args.dataset_name
    if name == "random":
        return random_prompts(
            n, args.random_input_len, args.random_output_len, args.random_range_ratio, codec, rng
        )
    if name == "random-ids":
        return random_id_prompts(
            n, args.random_input_len, args.random_output_len, args.random_range_ratio, codec, rng
        )
    if name == "shared-prefix":
        ps = shared_prefix_prompts(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len, codec, rng,
        )  # fmt: skip
        return ps
    if args.dataset_path is None:
        raise LoadgenError(f"--dataset-name {name} needs --dataset-path")
    if name == "sharegpt":
        return sharegpt_prompts(args.dataset_path, n, codec, rng, args.sharegpt_output_len)
    if name == "jsonl":
        return jsonl_prompts(args.dataset_path, n, codec, args.random_output_len)
    raise LoadgenError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise LoadgenError(f"cannot read {path}: {e.strerror}") from None


def _load_json(path: str):
    try:
        return json.loads(_read(path))
    except json.JSONDecodeError as e:
        raise LoadgenError(f"{path}: bad JSON: {e}") from None
