"""MLA prefill (DeepSeek-V2/V3, expanded form): every prefill row of a step at once, ragged. q [T, H, dqk]
against per-head K [S, H, dqk] and V [S, H, dv] (the row's latents already expanded), causal with each
row's queries the last of its keys; out [T, H, dv]. Ours (Triton) on CUDA, then the reference."""

from runtime.gpu.kernels.registry import always, register, triton_on_cuda

register("mla_prefill", "triton", "runtime.gpu.kernels.mla_prefill.triton:mla_prefill", triton_on_cuda)
register("mla_prefill", "reference", "runtime.gpu.kernels.mla_prefill.reference:mla_prefill", always)
