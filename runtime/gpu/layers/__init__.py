"""Building blocks shared by models: norms, linear layers with packed shards, rotary embeddings."""

from runtime.gpu.layers.linear import MergedLinear
from runtime.gpu.layers.norm import RMSNorm
from runtime.gpu.layers.rotary import RotaryEmbedding

__all__ = ["MergedLinear", "RMSNorm", "RotaryEmbedding"]
