"""The scheduler's side of the encoder cache: which images a step encodes, which embedding rows
each chunk takes, and which cache entries the runner frees after the step.

An image is encoded by the first chunk that reaches one of its tokens and kept (in the runner,
under a key unique to this engine) until the chunk that reaches its last token has run, so
chunked prefill may split one image's tokens across steps without encoding it twice. A request
that is preempted, aborted or finished lets its entries go; recomputing it encodes again.

The step budget counts encoder work (`fit`): the chunk that encodes an image pays the image's
token count on top of its own tokens, shortened to afford it or ending before the image's first
token, so a step's prompt tokens and encoder work together stay within what the scheduler gives
it (a step with decoding streams: its prefill cap).
"""

from __future__ import annotations

import itertools

from shortconv.engine.images import EncoderInput, ImageSlice, PlacedImage
from shortconv.engine.request import Request


def _slices(image: PlacedImage, key: int, start: int, end: int) -> list[ImageSlice]:
    """The rows of `image` that positions [start, end) take."""
    out, src = [], 0
    for pos, n in image.spans:
        lo, hi = max(pos, start), min(pos + n, end)
        if lo < hi:
            out.append(ImageSlice(key, src + lo - pos, lo - start, hi - lo))
        src += n
    return out


class EncoderPlanner:
    def __init__(self) -> None:
        self._keys = itertools.count(1)
        self._inputs: list[EncoderInput] = []
        self._frees: list[int] = []

    def chunk_images(self, req: Request, start: int, n: int) -> tuple[ImageSlice, ...]:
        """Plan the images of `req`'s chunk [start, start + n): encode the new ones, free those
        whose last token is in it."""
        end, slices = start + n, []
        for i, image in enumerate(req.images):
            if image.end <= start or image.start >= end:
                continue
            key = req.encoder_keys.get(i)
            if key is None:
                key = req.encoder_keys[i] = next(self._keys)
                self._inputs.append(EncoderInput(key, image.image))
            slices += _slices(image, key, start, end)
            if image.end <= end:
                self._frees.append(req.encoder_keys.pop(i))
        return tuple(slices)

    def fit(self, req: Request, start: int, n: int, budget: int) -> tuple[int, int]:
        """`req`'s chunk [start, start + n) cut so its tokens and the encoder work of the images
        it encodes (each image's token count) fit `budget`: (tokens, budget taken). An image
        the chunk starts in (its first token, or a resume inside it) is encoded whatever it
        costs, with at least one token; a later one shortens the chunk to pay for it, or ends it
        before its first token when even that does not fit (images are in prompt order)."""
        work = 0
        for i, image in enumerate(req.images):
            if i in req.encoder_keys or image.end <= start or image.start >= start + n:
                continue
            if image.start <= start:
                work += image.num_tokens
                n = max(1, min(n, budget - work))
            elif n + work + image.num_tokens > budget:
                room = budget - work - image.num_tokens  # the chunk's tokens if it encodes it
                if room <= image.start - start:
                    return image.start - start, image.start - start + work  # end before it
                n, work = room, work + image.num_tokens
            else:
                work += image.num_tokens
        return n, n + work

    def release(self, req: Request) -> None:
        """`req` no longer needs its kept images (finished, aborted or preempted)."""
        self._frees += req.encoder_keys.values()
        req.encoder_keys.clear()

    def take(self) -> tuple[tuple[EncoderInput, ...], tuple[int, ...]]:
        """This step's images to encode and the entries to free after it."""
        inputs, frees = tuple(self._inputs), tuple(self._frees)
        self._inputs, self._frees = [], []
        return inputs, frees
