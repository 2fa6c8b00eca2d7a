"""The server's uint8 image patches, normalized by the engine's batch on the device: bit for bit what the processor
gives."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from qwen3vl_static.presets import ASSETS, pil_image_processor_class, tiny_image_processor
from qwen3vl_static.pixels import PixelNormalizer, as_uint8


def image_processors():
    """The tiny one, the 2B checkpoint's on PIL, and its default (torch) one where torchvision is installed."""
    processors = [tiny_image_processor(), pil_image_processor_class().from_pretrained(ASSETS / "qwen3-vl-2b")]
    try:
        processors.append(AutoImageProcessor.from_pretrained(ASSETS / "qwen3-vl-2b"))
    except ImportError:
        pass
    return processors


def pictures(seed: int = 1) -> list:
    generator = np.random.default_rng(seed)
    return [Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8))
            for height, width in ((64, 64), (97, 131), (448, 448), (33, 250))]


@pytest.mark.parametrize("image_processor", image_processors(), ids=lambda processor: type(processor).__name__)
def test_normalized_uint8_patches_equal_the_processors_bit_for_bit(image_processor):
    normalizer = PixelNormalizer.for_processor(SimpleNamespace(image_processor=image_processor))
    assert normalizer is not None
    for picture in pictures():  # one at a time and all together
        for images in ([picture], pictures()):
            expected = image_processor(images=images, return_tensors="pt")
            raw = PixelNormalizer.raw_patches(image_processor, images)
            assert raw.dtype == torch.uint8 and raw.shape == expected["pixel_values"].shape
            assert torch.equal(normalizer(raw), expected["pixel_values"])
    assert image_processor.do_rescale and image_processor.do_normalize  # left as it was


def test_raw_turns_the_processor_arithmetic_off():
    image_processor = tiny_image_processor()
    PixelNormalizer.raw(image_processor)
    patches = image_processor(images=pictures()[:1], return_tensors="pt")["pixel_values"]
    assert as_uint8(patches) is not None and patches.max() > 1


def test_a_processor_it_cannot_reproduce_keeps_its_float_patches():
    class Shifted(type(tiny_image_processor())):
        """Normalizes with a mean other than the one it declares."""

        def normalize(self, image, mean, std, **kwargs):
            return super().normalize(image, [value + 0.01 for value in mean], std, **kwargs)

    image_processor = Shifted(**tiny_image_processor().to_dict())
    assert PixelNormalizer.for_processor(SimpleNamespace(image_processor=image_processor)) is None
    assert PixelNormalizer.for_processor(SimpleNamespace(tokenizer=None)) is None  # no image processor at all


def test_as_uint8_takes_whole_values_only():
    assert torch.equal(as_uint8(torch.tensor([0.0, 17.0, 255.0])), torch.tensor([0, 17, 255], dtype=torch.uint8))
    assert as_uint8(torch.tensor([0.5, 2.0])) is None
    assert as_uint8(torch.tensor([-1.0, 2.0])) is None
    assert as_uint8(torch.tensor([256.0])) is None


@pytest.mark.cuda
@pytest.mark.parametrize("image_processor", image_processors(), ids=lambda processor: type(processor).__name__)
def test_patches_normalized_on_the_gpu_equal_the_processors_bit_for_bit(image_processor):
    """The server's batch normalizes the uint8 patches on the GPU (`pixel_transform`): the same float32 values."""
    normalizer = PixelNormalizer.for_processor(SimpleNamespace(image_processor=image_processor))
    images = pictures(2)
    expected = image_processor(images=images, return_tensors="pt")["pixel_values"]
    raw = PixelNormalizer.raw_patches(image_processor, images)
    assert torch.equal(normalizer(raw.cuda()).cpu(), expected)
