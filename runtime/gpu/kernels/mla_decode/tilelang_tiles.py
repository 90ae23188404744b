"""The MLA TileLang kernel's tile sizes and the schedule choice they imply, shared by the kernel builder
(tilelang_kernel.py) and its two schedules (tilelang_roles.py, tilelang_seesaw.py)."""

BLOCK_H = 64  # q heads per CTA: the wgmma M tile (fewer heads are zero-padded)
BLOCK_N = 64  # tokens per KV tile
LN2 = 0.6931471805599453
PASS_CONFIGS = {"tl.enable_fast_math": True}


def tiled(page: int) -> bool:
    """Whole 64-token tiles lie in one page: they arrive by TMA, and the seesaw schedule (which only pays
    with TMA) runs. Otherwise the three-role schedule gathers every tile."""
    return page % BLOCK_N == 0
