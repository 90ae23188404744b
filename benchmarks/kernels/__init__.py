"""Kernel benchmarks (`python -m benchmarks.kernels.<name>` from the repository root):

- `ops`: every op implementation at Llama-3.1-8B and DeepSeek shapes against the measured ceilings;
- `fp8_gemm`: the FP8 block GEMM's implementations and TileLang tile configs at DeepSeek-V3 shapes;
- `fp8_weight_only`: the weight-only (W8A16) GEMM against W8A8 and a bf16 matmul;
- `mla_decode`: MLA decode against FlashMLA's figures (and FlashMLA itself, where installed);
- `decode_attention_sweep`: the decode-attention kernels' launch parameters and split counts;
- `timing`: the timers and ceilings they share."""
