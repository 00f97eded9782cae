"""An image's bytes -> an RGB PIL image, or ImageError: PNG, JPEG and WebP only, the size read
from the header and checked before any pixel is decoded (a small file may claim a huge image),
corrupt or truncated data refused. CPU work: callers run it off the event loop."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from deployments.frontend.images.fetch import ImageError
from deployments.frontend.images.limits import ImageLimits

FORMATS = ("PNG", "JPEG", "WEBP")


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The decoded image, converted to RGB (alpha dropped, palettes expanded)."""
    with warnings.catch_warnings():
        # NOTE: our own max_pixels check replaces PIL's decompression-bomb warning.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return _decode(data, limits)
        except (UnidentifiedImageError, Image.DecompressionBombError):
            raise ImageError("image data is not a PNG, JPEG or WebP image") from None
        except (OSError, SyntaxError, ValueError) as exc:  # PIL's corrupt/truncated data
            if isinstance(exc, ImageError):
                raise
            raise ImageError(f"image data is corrupt or truncated: {exc}") from None


def _decode(data: bytes, limits: ImageLimits) -> Image.Image:
    with Image.open(io.BytesIO(data), formats=FORMATS) as probe:
        width, height = probe.size
        if width * height > limits.max_pixels:
            raise ImageError(
                f"image is {width}x{height} pixels; at most {limits.max_pixels} pixels in all"
            )
        probe.verify()  # NOTE: checks the file's structure; the image cannot be used after it
    with Image.open(io.BytesIO(data), formats=FORMATS) as image:
        image.load()  # a truncated body fails here
        return image.convert("RGB")
