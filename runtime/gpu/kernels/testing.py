"""Random paged-attention inputs for the kernel tests and the benchmark, closeness and tolerances, and
the registry lookups every kernel test makes (the implementations to test, loaded or skipped).

Slots are handed out a page at a time in shuffled order (so a row's slots are scattered over the pool
for any page size), rows sit at shuffled indices of req_to_token, and every slot no row owns (slot 0
included) holds NaN: a kernel that reads one poisons its output."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.gpu.kernels import registry


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D], a strided view when q_strided
    k_pool: torch.Tensor  # [num_slots, Hkv, D]
    v_pool: torch.Tensor
    req_to_token: torch.Tensor  # [max_rows, width] int64
    rows: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    q_starts: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] prefix + extend
    max_extend: int
    max_seq_len: int
    scale: float

    def decode_args(self) -> tuple:
        return (self.q, self.k_pool, self.v_pool, self.req_to_token, self.rows, self.seq_lens, self.scale)

    def extend_args(self) -> tuple:
        return (
            *(self.q, self.k_pool, self.v_pool, self.req_to_token, self.rows),
            *(self.prefix_lens, self.extend_lens, self.q_starts, self.scale, self.max_extend),
        )


def paged_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    page_size: int = 1,
    q_strided: bool = True,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedCase:
    rng = random.Random(seed)
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_per_row = [-(-n // page_size) for n in seq]
    num_pages = sum(pages_per_row) + 2  # + page 0 (holds the padding slot) + one spare
    pages = list(range(1, num_pages))
    rng.shuffle(pages)
    batch = len(seq)
    rows = list(range(1, batch + 3))
    rng.shuffle(rows)
    rows = rows[:batch]
    width = max(seq, default=1) + 7
    r2t = torch.zeros(batch + 3, width, dtype=torch.int64)
    for b, n in enumerate(seq):
        mine = [pages.pop() for _ in range(pages_per_row[b])]
        slots = torch.tensor([p * page_size + i for p in mine for i in range(page_size)][:n])
        r2t[rows[b], :n] = slots
    num_slots = num_pages * page_size
    shape = (num_slots, num_kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    v_pool = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    used = (
        torch.cat([r2t[rows[b], :n] for b, n in enumerate(seq)])
        if batch
        else torch.zeros(0, dtype=torch.int64)
    )
    k_pool[used] = torch.randn(len(used), num_kv_heads, head_dim, generator=gen, device=dev).to(dtype)
    v_pool[used] = torch.randn(len(used), num_kv_heads, head_dim, generator=gen, device=dev).to(dtype)
    if kv_dtype is not None:  # e.g. an fp8 pool under bf16 queries (--kv-cache-dtype fp8_e4m3)
        k_pool, v_pool = k_pool.to(kv_dtype), v_pool.to(kv_dtype)
    tokens = sum(extend_lens)
    if q_strided:  # the q slice of a fused qkv projection output
        width_qkv = (num_q_heads + 2 * num_kv_heads) * head_dim
        qkv = torch.randn(tokens, width_qkv, generator=gen, device=dev).to(dtype)
        q = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    else:
        q = torch.randn(tokens, num_q_heads, head_dim, generator=gen, device=dev).to(dtype)
    starts = [sum(extend_lens[:b]) for b in range(batch)]
    cols = torch.tensor([rows, prefix_lens, extend_lens, starts, seq], dtype=torch.int64).to(dev)
    rows_t, prefix_t, ext_t, starts_t, seq_t = cols.unbind(0) if batch else [cols[i] for i in range(5)]
    return PagedCase(
        q, k_pool, v_pool, r2t.to(dev),
        *(rows_t, prefix_t, ext_t, starts_t, seq_t),
        max(extend_lens, default=0), max(seq, default=0), head_dim**-0.5,
    )  # fmt: skip


def close_ratio(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
    """max |a - e| / (atol + rtol |e|): <= 1 means within tolerance; NaN anywhere gives inf."""
    a, e = actual.float(), expected.float()
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != {tuple(e.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return ((a - e).abs() / (atol + rtol * e.abs())).max().item()


# Tolerances of a kernel against its float32-accumulating reference, per input dtype.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def impl_names(op: str) -> list[str]:
    """The op's implementations other than the reference: what a kernel test compares to it."""
    return [i.name for i in registry.op(op).implementations() if i.name != "reference"]


def load_impl(op: str, name: str, device: str = "cuda") -> Callable[..., Any]:
    """The named implementation, or the calling test skipped when it cannot run here."""
    import pytest

    impl = registry.op(op).named(name)
    if not impl.available(torch.device(device)):
        pytest.skip(f"{op}/{name} not available here")
    return impl.load()


def load_reference(op: str) -> Callable[..., Any]:
    return registry.op(op).named("reference").load()


def backend_outputs(backends, q, k, v, *, rows, positions, out_loc, prefix_lens, extend_lens, req_to_token,
                    kv_pool) -> list[torch.Tensor]:  # fmt: skip
    """Layer 0 of one step through each attention backend on the same cache (each stores the step's k, v
    again, identically): their outputs, to compare backends on runner-shaped steps."""
    from runtime.gpu.forward_batch import ForwardBatch

    device = q.device
    outs = []
    for backend in backends:
        batch = ForwardBatch(
            input_ids=torch.zeros(len(out_loc), dtype=torch.int64, device=device),
            positions=torch.tensor(positions, device=device),
            out_loc=torch.tensor(out_loc, device=device),
            rows=torch.tensor(rows, device=device),
            rows_list=list(rows),
            prefix_lens=list(prefix_lens),
            extend_lens=list(extend_lens),
            req_to_token=req_to_token,
            kv_pool=kv_pool,
        )
        backend.prepare(batch)
        outs.append(backend.forward(0, q, k, v, batch))
    return outs


class InterpreterCases:
    """Triton kernels checked on the CPU by the Triton interpreter. TRITON_INTERPRET must be set before the
    kernels are defined and must not leak into other tests (GPU tests in the same session would be
    interpreted), so the cases run in one subprocess: the test file, run as a script, calls `main()`,
    which prints {case: closeness ratio (or an error message)}; the pytest side reads it with `results`.

        CASES = InterpreterCases()

        @CASES.case
        def rope_bf16(): return close_ratio(...)

        test_kernels_match_under_interpreter = CASES.pytest_test(__file__)   # after the cases

        if __name__ == "__main__": CASES.main()
    """

    def __init__(self) -> None:
        self.cases: dict[str, Callable[[], float]] = {}

    def case(self, fn: Callable[[], float]) -> Callable[[], float]:
        return self.add(fn.__name__, fn)

    def add(self, name: str, fn: Callable[[], float]) -> Callable[[], float]:
        """A case by name (table-driven cases: `functools.partial(run, *row)`)."""
        if name in self.cases:
            raise ValueError(f"interpreter case {name!r} defined twice")
        self.cases[name] = fn
        return fn

    def __len__(self) -> int:
        return len(self.cases)

    def names(self) -> list[str]:
        return sorted(self.cases)

    def results(self, test_file: str, timeout: float = 300) -> dict:
        import json
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = Path(__file__).resolve().parents[3]
        # the subprocess imports this `runtime` (a script's sys.path starts at its own folder, so without
        # this an installed copy elsewhere, e.g. another checkout's editable install, would be tested)
        path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
        # a clean environment: variables an earlier test of the same session left behind (thread counts,
        # kernel choices) must not change what the interpreter computes
        keep = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "VIRTUAL_ENV", "SYSTEMROOT")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env |= {"TRITON_INTERPRET": "1", "PYTHONPATH": path}
        proc = subprocess.run(
            [sys.executable, test_file], env=env, cwd=root, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def pytest_test(self, test_file: str) -> Callable[[str], None]:
        """The pytest side: one test per case (parametrized by name, skipped without triton), all read
        from one subprocess run of `test_file`, started by the first of them (a failed run fails each)."""
        import importlib.util

        import pytest

        run: dict = {}

        @pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
        @pytest.mark.parametrize("name", self.names())
        def test(name: str) -> None:
            if not run:
                try:
                    run["results"] = self.results(test_file)
                except Exception as e:  # every case reports the one failed run, none reruns it
                    run["error"] = e
            if "error" in run:
                raise run["error"]
            check_interpreted(run["results"], name)

        return test

    def main(self) -> None:
        import json
        import os

        assert os.environ.get("TRITON_INTERPRET") == "1"
        torch.manual_seed(0)
        out: dict[str, float | str] = {}
        for name, fn in self.cases.items():
            try:
                out[name] = float(fn())
            except Exception as e:  # reported per case by the test
                out[name] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))


def check_interpreted(results: dict, name: str) -> None:
    """The pytest side of one `InterpreterCases` case: a closeness ratio within tolerance."""
    got = results[name]
    assert isinstance(got, float), got  # an error message from the subprocess
    assert got <= 1.0, f"{name}: error {got:.3g}x the tolerance"
