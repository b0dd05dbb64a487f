"""The built-in ``sensor`` model: a patch-based transformer encoder over sensor windows.

Windows of L timesteps x 8 channels (1 <= L <= 512) are cut into patches of 8
timesteps; each patch is one token (PatchTST-style), so a 512-step window is 64
tokens. Padding is masked in attention and pooling, so an item's output does not
depend on what it was batched with. Weights come from a fixed seed: the model is
for serving and benchmarking, not for its predictions.
"""

from __future__ import annotations

from typing import Any

from vega.models.base import SequenceModel

CHANNELS = 8
MAX_LENGTH = 512
PATCH = 8
CLASSES = 4


def build_module(*, width: int = 256, layers: int = 6, heads: int = 4, seed: int = 0) -> Any:
    """The encoder. At width 256 its 12 MB of weights dominate a lone window's forward
    pass; a batch reads them once, which is what makes batching pay (docs/how-it-works.md
    has the profile on each kind of CPU)."""
    import torch
    from torch import nn

    class PatchEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = PATCH
            self.embed = nn.Linear(PATCH * CHANNELS, width)
            self.position = nn.Parameter(torch.randn(MAX_LENGTH // PATCH, width) * 0.02)
            layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width,
                                               dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, CLASSES)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            batch, steps, channels = x.shape
            patch = self.patch
            tokens = (steps + patch - 1) // patch
            if tokens * patch != steps:
                x = nn.functional.pad(x, (0, 0, 0, tokens * patch - steps))
            h = self.embed(x.reshape(batch, tokens, patch * channels)) + self.position[:tokens]
            valid = (lengths + patch - 1) // patch
            pad_mask = torch.arange(tokens, device=x.device)[None, :] >= valid[:, None]
            h = self.encoder(h, src_key_padding_mask=pad_mask)
            h = h.masked_fill(pad_mask[..., None], 0.0).sum(1) / valid[:, None]
            return torch.softmax(self.head(h), dim=-1)

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        module = PatchEncoder().eval()
    finally:
        torch.random.set_rng_state(generator_state)
    return module


def sensor(name: str = "sensor") -> SequenceModel:
    """The full model: a few ms for one window on one core; batching pays several times
    over (by CPU and window length)."""
    return SequenceModel(build_module(), name, channels=CHANNELS, max_length=MAX_LENGTH,
                         output_size=CLASSES, script=True)


def sensor_small(name: str = "sensor-small") -> SequenceModel:
    """A cheaper variant for the same inputs (a fallback under pressure)."""
    return SequenceModel(build_module(width=32, layers=2, heads=2, seed=1), name,
                         channels=CHANNELS, max_length=MAX_LENGTH, output_size=CLASSES,
                         script=True)
