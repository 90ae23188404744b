"""The DeepSeek-V3 family (V3 / R1, and V2 / V2-Lite / V2.5 through V3's model): MLA over a paged latent
pool, DeepSeekMoE, MTP layers, FP8 block-scaled weights."""

from runtime.gpu.models.deepseek_v3.model import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3ForCausalLM"]
