"""The KV-pool contract, and the pool of multi-head attention models (K and V per layer and token slot).

A pool stores a model's attention state on the device. Its paged part is addressed by the scheduler's
token slots (slot 0 is padding and never attended; position p of a request at offset p % page_size of
its (p // page_size)-th page); a model may also keep a bounded state per request row outside the pages
(DeepSeek-V4's sliding-window ring and compressor tails). What the rest of the engine may ask of a pool:

- its layout: `page_multiple` (page sizes must be multiples of it), `bytes_per_token` of the paged part,
  `check_plan` (refuse slot layouts it cannot address);
- per-request state: `reset_row` when a request (re)starts in a row at a position, `release_row` when it
  leaves, and `replay_tokens`, how many tokens before a cached prefix a request recomputes to rebuild
  that state (0 for pools without one);
- `export_request` / `import_request`: one request's KV and state as named tensors (for prefill/decode
  disaggregation: the prefill side exports, the decode side imports into its own slots and row);
- `truncate`: drop a request's last n tokens (rejected draft tokens of speculative decoding) so that the
  next step continues from the shorter length as if they had never been written.

The pool may be stored in float8 e4m3 (`--kv-cache-dtype fp8_e4m3`) with scale 1.0, as SGLang and vLLM
do without calibrated scales: half the bytes per token, which is what long-context decode reads; the
attention kernels upcast what they load to the query's dtype."""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.mailbox.messages import StepPlan


@dataclass(frozen=True)
class KVPoolSpec:
    """What the runner decides about a pool before the model makes it."""

    num_slots: int  # token slots, slot 0 included
    num_rows: int  # request rows, row 0 (padding) included
    dtype: torch.dtype
    device: torch.device
    max_positions: int  # the longest request (max_model_len)


@dataclass(frozen=True)
class SlotTensor:
    """One paged tensor of a pool: slot s of a request lives at row s // rate (rate 1: per token; a
    compressed pool holds one entry per `rate` slots, written once the window of `rate` tokens closes)."""

    name: str
    tensor: torch.Tensor
    rate: int = 1


# One request's KV as named tensors: paged parts (per closed window, in position order) and row state.
RequestKV = dict[str, torch.Tensor]


class KVPool(ABC):
    num_slots: int
    page_multiple: int = 1

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes of the paged part per token slot (the KV budget's unit)."""

    @abstractmethod
    def slot_tensors(self) -> list[SlotTensor]:
        """Every paged tensor of the pool, for export and import."""

    def check_plan(self, plan: StepPlan) -> None:
        """Refuse a step whose slots this pool cannot address (nothing to check by default)."""
        return

    # ------------------------------------------------------------------ per-request state

    def reset_row(self, row: int, start: int) -> None:
        """The request in `row` (re)builds its state from position `start` (none by default)."""
        return

    def release_row(self, row: int) -> None:
        """The request in `row` left."""
        return

    def replay_tokens(self, requested: int | None, exact: bool) -> int:
        """Tokens before a cached prefix that a hit recomputes to rebuild per-request state (none)."""
        return 0

    def row_state(self, row: int) -> RequestKV:
        """The per-request state of `row` as named tensors (copies); none by default."""
        return {}

    def load_row_state(self, row: int, state: RequestKV, start: int) -> None:
        """Install state exported by `row_state` into `row`, whose request covers positions from `start`."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no per-request state, got {sorted(state)}")

    def truncate(self, row: int, length: int, n: int) -> None:
        """The request in `row`, holding `length` tokens, drops its last `n`. Paged KV needs nothing: the
        slots go back to the allocator and the next token at those positions overwrites them."""
        if not 0 <= n <= length:
            raise ValueError(f"cannot drop {n} of {length} tokens")

    # per-row state written in place (V4's ring and tails) rolls back rejected drafts in the verify step
    # itself: `save_blocks` just before the forward, `restore_rejected` once the step's counts are known
    # (device work only). Blocks of at most `max_verify_block` tokens (None: any).
    max_verify_block: int | None = None

    def save_blocks(self, rows: torch.Tensor, first: torch.Tensor, width: int) -> object | None:
        """Before a step in which `rows` [B] verify blocks at positions first[i] .. first[i] + width - 1
        (or fewer): what those positions will overwrite of the rows' state (None: nothing, paged only)."""
        return None

    def restore_rejected(self, saved: object, kept: torch.Tensor) -> None:
        """After that step: row i keeps the first kept[i] positions of its block; undo the rest."""
        return

    # ------------------------------------------------------------------ one request, out and in

    def export_request(self, row: int, slots: torch.Tensor) -> RequestKV:
        """The KV of the request in `row` whose positions 0..len(slots)-1 sit at `slots` (device, int64),
        as named tensors: each paged tensor's entries of closed windows in position order, plus its state."""
        out = {f"slot.{t.name}": t.tensor[_entry_index(slots, t.rate)].clone() for t in self.slot_tensors()}
        out.update({f"row.{k}": v for k, v in self.row_state(row).items()})
        return out

    def import_request(self, row: int, slots: torch.Tensor, kv: RequestKV, start: int = 0) -> None:
        """Write an exported request into this pool at `slots` (its positions 0..len(slots)-1) and `row`."""
        tensors = {t.name: t for t in self.slot_tensors()}
        expected = {f"slot.{n}" for n in tensors}
        got = {k for k in kv if k.startswith("slot.")}
        if got != expected:
            raise ValueError(f"request KV has {sorted(got)}, this pool needs {sorted(expected)}")
        for name, t in tensors.items():
            index = _entry_index(slots, t.rate)
            src = kv[f"slot.{name}"]
            if src.shape[0] != index.shape[0] or src.shape[1:] != t.tensor.shape[1:]:
                raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit {len(slots)} tokens here")
            t.tensor[index] = src.to(t.tensor.device, t.tensor.dtype)
        self.load_row_state(row, {k[4:]: v for k, v in kv.items() if k.startswith("row.")}, start)


def _entry_index(slots: torch.Tensor, rate: int) -> torch.Tensor:
    """Rows of a paged tensor holding the entries of the closed windows of a request at `slots`."""
    if rate == 1:
        return slots
    return slots[: len(slots) // rate * rate : rate] // rate


def request_kv_bytes(kv: RequestKV) -> bytes:
    """One exported request as bytes (safetensors), e.g. for a byte-stream transfer."""
    from safetensors.torch import save

    return save({k: v.contiguous().cpu() for k, v in kv.items()})


def request_kv_from_bytes(data: bytes) -> RequestKV:
    from safetensors.torch import load

    return load(data)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled pool tensor. On the CPU its memory is an anonymous private mapping: the kernel hands
    out zero pages on first touch, so a pool sized for 32K tokens costs nothing until tokens fill it
    (torch.zeros would write every byte at start-up: about a second for SmolLM2's default pool)."""
    count = torch.Size(shape).numel()
    if torch.device(device).type != "cpu" or not count:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, count * dtype_bytes(dtype), flags=mmap.MAP_PRIVATE)  # kept alive by the tensor
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class MHAKVPool(KVPool):
    """Multi-head attention (Llama family): per layer, K and V of every token slot."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self._bytes = self.bytes_for(num_layers, num_kv_heads, head_dim, dtype)

    @staticmethod
    def bytes_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)

    @property
    def bytes_per_token(self) -> int:
        return self._bytes

    def slot_tensors(self) -> list[SlotTensor]:
        k = [SlotTensor(f"k.{i}", t) for i, t in enumerate(self.k)]
        return k + [SlotTensor(f"v.{i}", t) for i, t in enumerate(self.v)]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][loc] = k.to(self.k[layer].dtype)
        self.v[layer][loc] = v.to(self.v[layer].dtype)
