"""Image patches that cross from the server's HTTP processes to its engine process as uint8 and reach the GPU so,
normalized there exactly as the processor would have. Not uploaded to the Hub.

A Qwen-VL image processor resizes an image (uint8), rescales and normalizes it per channel (float32) and cuts it into
patches. Cutting commutes with the per-channel arithmetic, so the HTTP processes run their processor with rescaling
and normalizing turned off (`raw`: a quarter of the bytes to hand over, and no float work in the processes that
stream), and the engine's batch applies the same arithmetic to the patches on the device, just before the vision
tower (`PixelNormalizer.__call__` as the manager's `pixel_transform`): the engine's one reader thread, which takes
every HTTP process's requests one after another, does no float work either. Which arithmetic depends on the
processor's backend (torch's fuses the rescale into the mean and std; PIL's rescales in float64 first, looked up
here from a table of each channel's 256 results); each is an elementwise subtraction and division in float32 or a
gather, which a GPU rounds as the CPU does. `for_processor` checks the result bit for bit against the processor
itself on an image that needs resizing, and returns None where it differs, in which case the float32 patches cross
as they are.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

PROBE_SIZE = (300, 517)  # height, width: not a multiple of any patch grid, so the probe is resized


@dataclass(frozen=True)
class PixelNormalizer:
    rescale_factor: float
    mean: tuple
    std: tuple
    channels_fused: bool  # torch's backend: (x - mean / factor) / (std / factor); PIL's: (float32(x * factor) - mean) / std
    _constants: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> `_on`'s

    @classmethod
    def for_processor(cls, processor) -> "PixelNormalizer | None":
        """The normalizer of `processor`'s image processor, if it reproduces the processor's patches bit for bit."""
        image_processor = getattr(processor, "image_processor", None)
        if image_processor is None or not (image_processor.do_rescale and image_processor.do_normalize):
            return None
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (*PROBE_SIZE, 3), dtype=np.uint8))
        expected = image_processor(images=[image], return_tensors="pt")["pixel_values"]
        raw = cls.raw_patches(image_processor, [image])
        if raw is None:
            return None
        mean, std = image_processor.image_mean, image_processor.image_std
        channels = 3
        for fused in (True, False):
            normalizer = cls(float(image_processor.rescale_factor),
                             tuple(mean) if isinstance(mean, (list, tuple)) else (mean,) * channels,
                             tuple(std) if isinstance(std, (list, tuple)) else (std,) * channels, fused)
            if torch.equal(normalizer(raw), expected):
                return normalizer
        return None

    @staticmethod
    def raw(image_processor) -> None:
        """Turn `image_processor`'s rescaling and normalizing off (it then gives the patches this class normalizes)."""
        image_processor.do_rescale = image_processor.do_normalize = False

    @classmethod
    def raw_patches(cls, image_processor, images) -> torch.Tensor | None:
        """`images`' patches as uint8 (None when the processor's unnormalized patches are not whole numbers)."""
        saved = image_processor.do_rescale, image_processor.do_normalize
        cls.raw(image_processor)
        try:
            patches = image_processor(images=images, return_tensors="pt")["pixel_values"]
        finally:
            image_processor.do_rescale, image_processor.do_normalize = saved
        return as_uint8(patches)

    def check(self, patches: torch.Tensor) -> None:
        """Raise a `ValueError` unless `patches` are what `__call__` takes: uint8 `(patches, channels * rest)`."""
        channels = len(self.mean)
        if patches.dtype != torch.uint8 or patches.dim() != 2 or patches.shape[1] % channels:
            raise ValueError(f"image patches must be uint8 of shape (patches, {channels} x values per channel), got "
                             f"{patches.dtype} {tuple(patches.shape)}")

    def __call__(self, patches: torch.Tensor) -> torch.Tensor:
        """float32 patches from uint8 ones `(patches, channels * rest)`, on their device: each channel's values are
        contiguous. Raises a `ValueError` for others (float patches would otherwise come out as wrong numbers)."""
        self.check(patches)
        rows, width = patches.shape
        channels = len(self.mean)
        per_channel = patches.reshape(rows, channels, width // channels)
        constants = self._on(patches.device)
        if self.channels_fused:  # (x - mean / factor) / (std / factor), cheap in float32
            mean, std = constants
            return ((per_channel.to(torch.float32) - mean) / std).view(rows, width)
        # float64 over every value is slow (and on a GPU slower still): each channel's 256 results, looked up
        table, offsets = constants
        return table[per_channel.to(torch.int32) + offsets].view(rows, width)

    def _on(self, device: torch.device) -> tuple:
        """The arithmetic's constants on `device`, made on the host and copied there once: a copy from the host waits
        for the work queued on the device."""
        if device not in self._constants:
            channels = len(self.mean)
            if self.channels_fused:
                constants = ((torch.tensor(self.mean) * (1.0 / self.rescale_factor))[:, None],
                             (torch.tensor(self.std) * (1.0 / self.rescale_factor))[:, None])
            else:
                constants = (self._table().view(-1), torch.arange(channels, dtype=torch.int32)[:, None] * 256)
            self._constants[device] = tuple(constant.to(device) for constant in constants)
        return self._constants[device]

    def _table(self) -> torch.Tensor:
        """(channels, 256): each channel's result for each uint8 value, as the PIL backend computes it."""
        values = torch.arange(256, dtype=torch.uint8).expand(len(self.mean), 256)
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None]
        return ((values.to(torch.float64) * self.rescale_factor).to(torch.float32) - mean) / std


def as_uint8(patches: torch.Tensor) -> torch.Tensor | None:
    """`patches` as uint8 when every value is a whole number in 0..255, else None."""
    if patches.dtype == torch.uint8:
        return patches
    whole = patches.to(torch.uint8)
    return whole if torch.equal(whole.to(patches.dtype), patches) else None
