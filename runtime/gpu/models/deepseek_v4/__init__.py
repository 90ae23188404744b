"""The DeepSeek-V4 family: mHC residual streams, sliding / compressed sparse attention over paged
compressed pools with per-request state (kv_pool.py), hash-routed MoE; docs/deepseek_v4.md."""

from runtime.gpu.models.deepseek_v4.model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]
