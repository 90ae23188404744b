"""Kernel benchmark: time, achieved bandwidth and FLOP rate of every op implementation at Llama-3.1-8B
shapes, against ceilings measured in the same run (device-to-device copy bandwidth, bf16 matmul peak).

    python -m benchmarks.kernels.ops                      # all ops, all non-reference impls
    python -m benchmarks.kernels.ops --ops decode_attention --reference
    python -m benchmarks.kernels.ops --ops fp8_block_gemm --fp8-configs   # see benchmarks/kernels/fp8_gemm.py
    CONDUIT_KERNEL_DECODE_ATTENTION=reference ...            # (the registry's forcing also applies)

On CUDA, times are triton.testing.do_bench medians. `--device cpu` runs the references with wall-clock
timing, a smoke test of this script only."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from benchmarks.kernels.timing import bench_ms, ceilings, fp8_ceiling
from runtime.gpu.kernels import registry
from runtime.gpu.kernels.testing import paged_case
from runtime.gpu.quant import fp4

# Llama-3.1-8B
HQ, HKV, HEAD_DIM, HIDDEN, FFN = 32, 8, 128, 4096, 14336


@dataclass
class Work:
    op: str
    label: str
    args: tuple
    kwargs: dict
    bytes: float  # minimum bytes moved
    flops: float
    tokens: int = 1  # new tokens (the reference is skipped on long prefills: its scores would not fit)


def _attention_bytes(c, hq: int, tokens: int) -> float:
    kv = c.k_pool.shape[1] * c.k_pool.shape[2] * c.k_pool.element_size() * 2  # per token, K and V
    q_o = 2 * tokens * hq * c.q.shape[2] * c.q.element_size()
    seq = int(c.seq_lens.sum())
    return seq * (kv + 8) + q_o  # + the int64 slot index of each token


def workloads(ops: list[str], device: torch.device, small: bool, page: int) -> Iterator[Work]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = 16 if small else 1
    if "decode_attention" in ops:
        for batch in (1, 8, 32, 128, 256):
            for ctx in (1024, 4096, 32768):
                if batch * ctx > (1 << 20) or (small and batch * ctx > 8192):
                    continue
                c = paged_case([ctx - 1] * batch, [1] * batch, HQ, HKV, HEAD_DIM, dtype, device, page, False)
                flops = 4 * batch * HQ * ctx * HEAD_DIM
                yield Work(
                    "decode_attention",
                    f"B={batch} ctx={ctx}",
                    c.decode_args(),
                    {},
                    _attention_bytes(c, HQ, batch),
                    flops,
                )
                del c
    if "extend_attention" in ops:
        for prefix, ext in ((0, 1024), (0, 8192), (0, 32768), (4096, 4096)):
            prefix, ext = prefix // scale, ext // scale
            c = paged_case([prefix], [ext], HQ, HKV, HEAD_DIM, dtype, device, page, True)
            flops = 4 * HQ * HEAD_DIM * (ext * prefix + ext * (ext + 1) / 2)
            yield Work(
                "extend_attention",
                f"prefix={prefix} new={ext}",
                c.extend_args(),
                {},
                _attention_bytes(c, HQ, ext),
                flops,
            )
            del c
    elem = torch.empty((), dtype=dtype).element_size()
    for tokens in (1, 256, 8192 // scale):
        x = torch.randn(tokens, HIDDEN, device=device).to(dtype)
        if "rms_norm" in ops:
            w = torch.ones(HIDDEN, device=device, dtype=dtype)
            r = torch.randn_like(x)
            yield Work(
                "rms_norm", f"T={tokens} H={HIDDEN} +residual", (x, w, 1e-5, r), {}, 4 * x.numel() * elem, 0
            )
        if "silu_and_mul" in ops:
            gu = torch.randn(tokens, 2 * FFN, device=device).to(dtype)
            g, u = gu.split(FFN, dim=-1)
            yield Work("silu_and_mul", f"T={tokens} I={FFN}", (g, u), {}, 3 * g.numel() * elem, 0)
        if "rope" in ops:
            qkv = torch.randn(tokens, (HQ + 2 * HKV) * HEAD_DIM, device=device).to(dtype)
            q, k, _ = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
            q, k = q.view(tokens, HQ, HEAD_DIM), k.view(tokens, HKV, HEAD_DIM)
            table = torch.randn(32768, HEAD_DIM, device=device)
            pos = torch.randint(0, 32768, (tokens,), device=device)
            nbytes = 2 * tokens * (HQ + HKV) * HEAD_DIM * elem + 2 * tokens * HEAD_DIM * 4
            yield Work("rope", f"T={tokens} heads={HQ}+{HKV}", (pos, q, k, table, table), {}, nbytes, 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--ops", nargs="*", default=None, help=f"subset of {registry.ops()}")
    p.add_argument(
        "--reference", action="store_true", help="also time the PyTorch references (slow; not over 8K tokens)"
    )
    p.add_argument("--page-size", type=int, default=16, help="slots are shuffled a page at a time")
    p.add_argument("--small", action="store_true", help="small shapes (smoke test)")
    p.add_argument("--no-graph", action="store_true", help="time plain launches, not CUDA graph replays")
    p.add_argument(
        "--fp8-configs", action="store_true", help="fp8_block_gemm: also time the TileLang tile configs"
    )
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("no CUDA device; use --device cpu --small for a smoke test\n")
        return 2
    small = a.small or device.type != "cuda"
    ops = a.ops or registry.ops()
    copy_bw, peak = ceilings(device, small)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}  torch {torch.__version__}")
    print(f"# ceilings: copy {copy_bw / 1e9:.0f} GB/s (read+write), matmul {peak / 1e12:.1f} TFLOP/s")
    print(
        f"{'op':<18} {'impl':<10} {'shape':<26} {'us':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'%mm':>5}"
    )
    fp8_peak = None
    failures = 0
    for w in itertools.chain(
        workloads(ops, device, small, a.page_size), deepseek_workloads(ops, device, small)
    ):
        w_peak = peak
        if w.op.startswith("fp8") or w.label.startswith("fp8"):  # vs the FP8 matmul peak (_scaled_mm), once
            fp8_peak = fp8_peak or fp8_ceiling(device, small)
            w_peak = fp8_peak or peak
        for impl in registry.op(w.op).implementations():
            is_ref = impl.name == "reference"
            if not impl.available(device) or (is_ref and not (a.reference and w.tokens <= 8192)):
                continue
            fn = impl.load()
            graph = not (is_ref or a.no_graph)
            ms = bench_ms(lambda fn=fn, w=w: fn(*w.args, **w.kwargs), device, graph)
            bw, fl = w.bytes / (ms * 1e-3), w.flops / (ms * 1e-3)
            print(
                f"{w.op:<18} {impl.name:<10} {w.label:<26} {ms * 1e3:9.1f} {bw / 1e9:8.0f} "
                f"{100 * bw / copy_bw:5.0f}% {fl / 1e12:8.2f} {100 * fl / w_peak:4.0f}%",
                flush=True,
            )
    if "fp8_block_gemm" in ops:  # its own table: every impl and config checked, vs DeepGEMM's figures
        from benchmarks.kernels import fp8_gemm as fp8_bench

        fp8_peak = fp8_peak or fp8_ceiling(device, small)
        print("# fp8_block_gemm (benchmarks.kernels.fp8_gemm)", flush=True)
        failures += fp8_bench.run(
            device, fp8_bench.SMALL_SHAPES if small else None, None, a.fp8_configs, not a.no_graph,
            fp8_peak, reference=a.reference,
        )  # fmt: skip
    return 1 if failures else 0


# ------------------------------------------------------------------ DeepSeek ops

# FlashMLA's published H200 figures for its dense decode kernel, median of triton do_bench
FLASH_MLA_H200 = {
    (128, 64): {1024: "446 TF", 4096: "578 TF", 16384: "570 TF", 32768: "588 TF"},
    (128, 128): {1024: "469 TF", 4096: "575 TF", 16384: "537 TF", 32768: "525 TF"},
    (16, 128): {4096: "3.56 TB/s", 32768: "4.11 TB/s"},
}


def deepseek_workloads(ops: list[str], device: torch.device, small: bool) -> Iterator[Work]:
    """MLA decode (bf16 latent pool, page 64, FlashMLA FLOP/byte accounting: FLOPs = 2 * sum(seqlen) *
    h_q * (576 + 512), bytes = KV + Q + O) at h_q 128/16, batch 64/128, contexts 1K..32K; the FP8
    activation quantizer at DeepSeek-V3 shapes (the FP8 GEMM has its own table: `fp8_gemm.py` here); V4
    sparse attention (FLOPs = 4 * selected rows * heads * d, bytes = selected rows * d + indices + Q + O).
    Labels carry the anchor to compare with."""
    if "mla_decode" in ops:
        from runtime.gpu.kernels.mla_decode.testing import mla_case

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        r, dpe = (64, 16) if small else (512, 64)
        for hq in (128, 16):
            for batch in (2,) if small else (64, 128):
                for ctx in (300,) if small else (1024, 4096, 16384, 32768):
                    c = mla_case([ctx] * batch, hq, dtype, device, 64, r, dpe, nan_fill=False)
                    elem = c.pool.element_size()
                    nbytes = (c.kv_tokens * (r + dpe) + batch * hq * (2 * r + dpe)) * elem
                    flops = 2 * c.kv_tokens * hq * (2 * r + dpe)
                    anchor = FLASH_MLA_H200.get((hq, batch), {}).get(ctx, "")
                    label = f"h={hq} B={batch} ctx={ctx}" + (f" [FlashMLA {anchor}]" if anchor else "")
                    yield Work("mla_decode", label, c.args(), {}, nbytes, flops, tokens=c.kv_tokens)
                    del c
    if "fp8_act_quant" in ops:
        for m, k in ((64, 7168), (4096, 7168)) if not small else ((4, 300),):
            x = torch.randn(m, k, device=device).to(
                torch.bfloat16 if device.type == "cuda" else torch.float32
            )
            nbytes = m * k * (x.element_size() + 1) + 4 * m * -(-k // 128)
            yield Work("fp8_act_quant", f"M={m} K={k}", (x,), {}, nbytes, 0, tokens=m)

    if "moe_grouped_gemm" in ops:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        for tokens, experts, n, k in ((4,) * 2 + (64, 96),) if small else (
            (128, 8, 4096, 7168), (4096, 8, 4096, 7168), (8192, 8, 7168, 2048), (32768, 32, 4096, 7168)
        ):  # fmt: skip
            offsets = torch.arange(experts + 1, device=device) * (tokens // experts)
            x = torch.randn(tokens, k, device=device).to(dtype)
            w = torch.randn(experts, n, k, device=device).to(dtype)
            nbytes = (x.numel() + w.numel() + tokens * n) * x.element_size()
            yield Work(
                "moe_grouped_gemm", f"T={tokens} E={experts} N={n} K={k}", (x, w, offsets), {}, nbytes,
                2 * tokens * n * k, tokens=tokens,
            )  # fmt: skip
    if "fused_moe" in ops:  # DeepSeek-V2-Lite (64 experts, top-6), V3 (256, top-8), V4-Flash (256, top-6)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        experts_shapes = ((64, 6, 2048, 1408), (256, 8, 7168, 2048), (256, 6, 4096, 2048))
        shapes = [(4, 8, 2, 64, 32)] if small else [
            (t, e, k, d, i) for e, k, d, i in experts_shapes for t in (1, 64, 128, 4096)
        ]  # fmt: skip
        for tokens, experts, k, d, i in shapes:
            x = torch.randn(tokens, d, device=device).to(dtype)
            w13 = torch.empty(experts, 2 * i, d, device=device, dtype=dtype).normal_(0, d**-0.5)
            w2 = torch.empty(experts, d, i, device=device, dtype=dtype).normal_(0, i**-0.5)
            ids = torch.rand(tokens, experts, device=device).argsort(-1)[:, :k]
            topk_w = torch.rand(tokens, k, device=device)
            touched = ids.unique().numel()  # weight bytes of the experts the batch routes to
            nbytes = (touched * 3 * d * i + 2 * tokens * d) * x.element_size()
            yield Work(
                "fused_moe", f"T={tokens} E={experts} k={k} D={d}", (x, w13, w2, topk_w, ids), {}, nbytes,
                2 * tokens * k * 3 * d * i, tokens=tokens,
            )  # fmt: skip
            if small or d == 4096:  # V4-Flash's FP4 experts (W4A16): random codes, scales 2^-4
                packed = [torch.randint(0, 256, (experts, n, kk // 2), dtype=torch.uint8, device=device)
                          for n, kk in ((2 * i, d), (d, i))]  # fmt: skip
                scales = [torch.full((experts, n, kk // 32), 123, dtype=torch.uint8, device=device)
                          for n, kk in ((2 * i, d), (d, i))]  # fmt: skip
                if fp4.tileable(2 * i, d) and fp4.tileable(d, i):  # the form served models keep
                    packed[0], packed[1], scales[0], scales[1] = fp4.tile_layer(*packed, *scales)
                yield Work(
                    "fused_moe", f"fp4 T={tokens} E={experts} k={k} D={d}", (x, *packed, topk_w, ids),
                    {"w13_scale": scales[0], "w2_scale": scales[1]},
                    touched * 3 * d * i * (1 / 2 + 1 / 32) + 2 * tokens * d * x.element_size(),
                    2 * tokens * k * 3 * d * i, tokens=tokens,
                )  # fmt: skip
                del packed, scales
            if small or d == 7168:  # V3's FP8 experts (W8A8): N(0, 1) e4m3 values, std in the scales
                q13, q2 = (torch.empty_like(w, dtype=torch.float8_e4m3fn) for w in (w13, w2))
                for e in range(experts):  # an expert at a time: no 22 GB temporary
                    q13[e], q2[e] = w13[e] * d**0.5, w2[e] * i**0.5
                del w13, w2
                s13 = torch.full((experts, -(-2 * i // 128), -(-d // 128)), d**-0.5, device=device)
                s2 = torch.full((experts, -(-d // 128), -(-i // 128)), i**-0.5, device=device)
                yield Work(
                    "fused_moe", f"fp8 T={tokens} E={experts} k={k} D={d}", (x, q13, q2, topk_w, ids),
                    {"w13_scale": s13, "w2_scale": s2}, touched * 3 * d * i + 2 * tokens * d * x.element_size(),
                    2 * tokens * k * 3 * d * i, tokens=tokens,
                )  # fmt: skip
                del q13, q2
            else:
                del w13, w2
    if "sparse_attention" in ops:  # DeepSeek-V4-Flash: 64 heads, d 512, 128 window rows + 512 top-k entries
        from runtime.gpu.kernels.sparse_attention.testing import sparse_case

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        heads, dim, window, topk = (4, 64, 8, 24) if small else (64, 512, 128, 512)
        for tokens in (4,) if small else (1, 64, 128, 4096):
            c = sparse_case(tokens, heads, dim, window, topk, dtype, device, prefix=8192, nan_fill=False)
            rows, elem = c.selected, c.q.element_size()  # every (token, selected row) pair is gathered
            nbytes = rows * dim * elem + c.indices.numel() * 4 + 2 * c.q.numel() * elem
            yield Work(
                "sparse_attention", f"h={heads} T={tokens} K={window}+{topk}", c.args(), {}, nbytes,
                4 * rows * heads * dim, tokens=tokens,
            )  # fmt: skip
    if "index_scores" in ops:  # DeepSeek-V4-Flash's indexer: 64 heads, c 128; a prefill tile after 60K tokens
        from runtime.gpu.kernels.index_scores.testing import index_case

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        heads, dim = (4, 32) if small else (64, 128)
        for tokens, entries in ((16, 40),) if small else ((1024, 16384), (4096, 16384)):
            c = index_case(tokens, heads, dim, entries, dtype, device, prefix=4 * entries - tokens)
            seen, elem = int(c.visible.sum()), c.q.element_size()  # (query, entry) pairs scored
            nbytes = (c.q.numel() + c.keys.numel()) * elem + tokens * entries * 4  # + the scores written
            yield Work(
                "index_scores", f"h={heads} T={tokens} N={entries}", c.args(), {}, nbytes,
                2 * seen * heads * dim, tokens=tokens,
            )  # fmt: skip
    if "mhc_pre" in ops or "mhc_post" in ops:  # DeepSeek-V4-Flash: 4 streams, D 4096, 20 Sinkhorn iterations
        from runtime.gpu.kernels.mhc.reference import mhc_pre
        from runtime.gpu.kernels.mhc.testing import mhc_case

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        n, d = 4, 64 if small else 4096
        for tokens in (4,) if small else (1, 64, 4096):
            c = mhc_case(tokens, n, d, dtype, device, iters=20)
            elem, mixings = c.h.element_size(), tokens * (n + n * n) * 4  # + post and comb, float32
            if "mhc_pre" in ops:  # reads h and fn, writes x (normed: the fused RMSNorm) and the mixings
                nbytes = (c.h.numel() + tokens * d) * elem + c.fn.numel() * 4 + mixings
                yield Work(
                    "mhc_pre", f"T={tokens} n={n} D={d} +norm", c.pre_args(norm=True), {}, nbytes,
                    2 * c.h.numel() * c.fn.shape[0], tokens=tokens,
                )  # fmt: skip
            if "mhc_post" in ops:  # reads h, out and the mixings, writes h'
                _, post, comb = mhc_pre(*c.pre_args())
                nbytes = (2 * c.h.numel() + c.out.numel()) * elem + mixings
                yield Work(
                    "mhc_post", f"T={tokens} n={n} D={d}", (c.h, c.out, post, comb), {}, nbytes,
                    2 * c.h.numel() * (n + 1), tokens=tokens,
                )  # fmt: skip
    if "mla_prefill" in ops:  # DeepSeek-V3 expanded MLA prefill: h 128, d_qk 192, d_v 128
        from runtime.gpu.kernels.mla_prefill.testing import prefill_case

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        heads = 16 if small else 128
        for prefix, new in ((0, 256), (256, 256)) if small else ((0, 8192), (4096, 4096)):
            c = prefill_case([prefix], [new], heads, 192, 128, dtype, device, gaps=False)
            # FLOPs = 2 (d_qk + d_v) h x the keys each query attends (causal); bytes = Q, K, V, O once
            label = f"h={heads} prefix={prefix} new={new}"
            yield Work("mla_prefill", label, c.args(), {}, c.nbytes, c.flops, tokens=new)
            del c


if __name__ == "__main__":
    sys.exit(main())
