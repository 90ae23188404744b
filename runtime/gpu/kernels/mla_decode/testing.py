"""Random MLA decode inputs on a paged latent pool, for the tests and the benchmark.

Pages of `page_size` slots are handed out in shuffled order (in order with `shuffle_pages=False`), so
every row's tokens are scattered over the pool; rows sit at shuffled indices of req_to_token; every slot no row owns (slot 0, the tail of a
row's last page, the spare pages) holds NaN, so a kernel that reads one poisons its output. The same
case is also laid out the FlashMLA way (`block_table`, `k_cache` [pages, page, 1, D]) for the adapter."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class MLACase:
    q: torch.Tensor  # [B, Hq, D]
    pool: torch.Tensor  # [slots, 1, D] (LatentKVPool.kv[layer])
    req_to_token: torch.Tensor  # [max_rows, width] int64
    rows: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_pages] int32: the FlashMLA view of the same slots
    block_rows: torch.Tensor  # [B] int64 arange: row b reads block_table[b] (the block-table entry's rows)
    cache_seqlens: torch.Tensor  # [B] int32
    page_size: int
    kv_lora_rank: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.pool, self.req_to_token, self.rows, self.seq_lens, self.scale, self.kv_lora_rank)

    def k_cache(self) -> torch.Tensor:
        """The pool as FlashMLA's k_cache [num_pages, page_size, 1, D] (a view)."""
        return self.pool.view(-1, self.page_size, 1, self.pool.shape[-1])

    @property
    def kv_tokens(self) -> int:
        return int(self.seq_lens.sum())


def mla_case(
    seq_lens: list[int],
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device | str,
    page_size: int = 64,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    seed: int = 0,
    nan_fill: bool = True,
    shuffle_pages: bool = True,
) -> MLACase:
    """`shuffle_pages` False: rows take consecutive pages in row order, the block table FlashMLA's own
    benchmark builds (`torch.arange(...).view(b, -1)`)."""
    rng = random.Random(seed)
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    dim = kv_lora_rank + rope_dim
    batch = len(seq_lens)
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_row) + 2  # + page 0 (holds the padding slot 0) + one spare
    pages = list(range(1, num_pages))
    if shuffle_pages:
        rng.shuffle(pages)
    else:
        pages.reverse()  # handed out by pop(): row 0 gets pages 1, 2, ...
    rows = list(range(1, batch + 3))
    rng.shuffle(rows)
    rows = rows[:batch]
    width = max(seq_lens, default=1) + 7
    r2t = torch.zeros(batch + 3, width, dtype=torch.int64)
    table = torch.zeros(batch, max(max(pages_per_row, default=1), 1), dtype=torch.int32)
    used = []
    for b, n in enumerate(seq_lens):
        mine = [pages.pop() for _ in range(pages_per_row[b])]
        table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        slots = torch.tensor(
            [p * page_size + i for p in mine for i in range(page_size)][:n], dtype=torch.int64
        )
        r2t[rows[b], :n] = slots
        used.append(slots)
    num_slots = num_pages * page_size
    fill = float("nan") if nan_fill else 0.0
    pool = torch.full((num_slots, 1, dim), fill, dtype=dtype, device=dev)
    used_t = torch.cat(used) if used else torch.zeros(0, dtype=torch.int64)
    pool[used_t.to(dev), 0] = torch.randn(len(used_t), dim, generator=gen, device=dev).to(dtype)
    q = torch.randn(batch, num_heads, dim, generator=gen, device=dev).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return MLACase(
        q, pool, r2t.to(dev), torch.tensor(rows, dtype=torch.int64).to(dev), lens.to(dev),
        table.to(dev), torch.arange(batch, device=dev), lens.to(torch.int32).to(dev), page_size,
        kv_lora_rank, dim**-0.5,
    )  # fmt: skip
