"""What the frontend needs to know about the model before the engine has loaded it: name, context
length, vocabulary size, EOS ids, tokenizer. Read from the model directory's small JSON files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import ServerConfig, apply_hf_overrides
from runtime.generation_defaults import SamplingDefaults, load_sampling_defaults

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class ModelInfo:
    path: str
    tokenizer_path: str
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    architecture: str | None = None  # config.json's first architecture
    chat_template: str | None = None  # --chat-template's text; None: the tokenizer's or the family's
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)


def resolve_model_path(cfg: ServerConfig) -> str:
    """The model directory: the one given, or the embedded default converted on first use."""
    if cfg.model is not None:
        from runtime.gpu import presets

        if cfg.load_format == "dummy" and presets.is_preset(cfg.model) and not Path(cfg.model).exists():
            return str(presets.preset_dir(cfg.model))
        path = Path(cfg.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {cfg.model}: no config.json there (expected a Hugging Face model "
                "directory; convert a GGUF file with `conduit convert`)"
            )
        return str(path)
    from runtime.gpu.convert import default_model_path

    return str(default_model_path())


def _eos_ids(path: Path, config: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (path / "generation_config.json", None):
        data = json.loads(source.read_text()) if source is not None and source.is_file() else config
        eos = data.get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if t is not None and t not in ids:
                ids.append(int(t))
        if ids:
            break
    return tuple(ids)


def has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def tokenizer_dir(tokenizer: str | None, model_path: str, load_format: str) -> str:
    """The tokenizer's directory: `--tokenizer`, else the model's; a preset or bare config with random
    weights uses the embedded SmolLM2 tokenizer (its ids < 49152 fit every preset's vocabulary)."""
    if tokenizer is not None:
        return tokenizer
    if not has_tokenizer(Path(model_path)) and load_format == "dummy":
        from runtime.gpu.convert import default_model_path

        return str(default_model_path())
    return model_path


def load_model_info(cfg: ServerConfig, path: str) -> ModelInfo:
    p = Path(path)
    config = apply_hf_overrides(json.loads((p / "config.json").read_text()), cfg.hf_overrides)
    text = config.get("text_config", config)
    native = int(text.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
    max_len = cfg.max_model_len or min(native, DEFAULT_MAX_MODEL_LEN)
    tok = tokenizer_dir(cfg.tokenizer, path, cfg.load_format)
    eos = _eos_ids(p, text)
    if not eos:
        tok_cfg = Path(tok) / "tokenizer_config.json"
        if tok_cfg.is_file():
            from transformers import AutoTokenizer

            t = AutoTokenizer.from_pretrained(tok, local_files_only=True)
            eos = (t.eos_token_id,) if t.eos_token_id is not None else ()
    name = cfg.served_model_name or p.name
    archs = config.get("architectures") or [None]
    template = None
    if cfg.chat_template is not None:
        from runtime import chat_templates

        template = chat_templates.load(cfg.chat_template)
    defaults = load_sampling_defaults(cfg.generation_config, path, cfg.override_generation_config)
    return ModelInfo(path, tok, name, max_len, int(text["vocab_size"]), eos, archs[0], template, defaults)
