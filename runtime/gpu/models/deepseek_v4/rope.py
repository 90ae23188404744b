"""DeepSeek-V4's RoPE: interleaved pairs (x[2i], x[2i+1]) on the last `rope_dim` channels of a head.

V4 has two tables: "main" (sliding-window layers) and "compress" (CSA/HCA layers, their compressed
entries and the indexer; YaRN in the released configs). cos/sin are computed from the positions on the
fly (float32), so there is no table to rebuild after building the model on the meta device."""

from __future__ import annotations

import torch

from runtime.gpu.kernels.rope import ROPE_INTERLEAVED


def inv_frequencies(config, rope_kind: str) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim / 2], attention scaling) of table `rope_kind` ("main" | "compress")."""
    params = config.rope_parameters[rope_kind]
    rope_dim = int(config.head_dim * params.get("partial_rotary_factor", config.partial_rotary_factor))
    with torch.device("cpu"):  # models are built under `torch.device("meta")`; this table is real
        if params.get("rope_type", "default") == "default":
            inv = 1.0 / (
                params["rope_theta"] ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
            )
            return inv, 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", layer_type=rope_kind)
        return inv.float(), float(scale)


class InterleavedRope:
    """Rotates the trailing `2 * len(inv_freq)` channels of x [..., H, d] (or [..., d]) by position."""

    def __init__(self, config, rope_kind: str) -> None:
        self.inv_freq, self.scaling = inv_frequencies(config, rope_kind)
        # one copy per device, made on first use: a copy made on every call is a host-to-device
        # transfer, which CUDA graph capture refuses (the eager warm-up step makes it first)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies [rope_dim / 2] float32 on `device` (for ops that rope inside)."""
        inv = self._inv_freq_on.get(device)
        if inv is None:
            inv = self._inv_freq_on[device] = self.inv_freq.to(device)
        return inv

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inverse: bool = False,
        unit_rms_eps: float | None = None,
    ) -> torch.Tensor:
        """x [T, d] or [T, H, d], positions [T]; `inverse` rotates by -position (V4's attention output).
        In place (the `rope_interleaved` op): every caller hands over a tensor it has just made, and the
        out-of-place form copied the whole head (the unrotated channels too) to rotate a quarter or an
        eighth of it. `unit_rms_eps`: each head first divided by its rms (V4's q norm, in the same launch).
        Returns x."""
        op = ROPE_INTERLEAVED.get(x.device)
        return op(x, positions, self.inv_freq_on(positions.device), self.scaling, inverse, unit_rms_eps)
