"""The Llama family (Llama 2/3/3.1+, SmolLM2, ...)."""

from runtime.gpu.models.llama.model import LlamaForCausalLM, head_dim_of

__all__ = ["LlamaForCausalLM", "head_dim_of"]
