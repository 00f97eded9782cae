"""A checkpoint's own transformers processor, loaded from its directory.

`AutoProcessor` where it can be built (with torchvision importing: LFM2-VL's `Lfm2VlProcessor`
and LFM3-VL's `Lfm3VlProcessor`, as transformers ships them). LFM3-VL's also holds a video
processor, which needs torchvision even to be constructed; where torchvision does not import
(a machine whose torch has no matching torchvision build), `ImageOnlyLfm3VlProcessor` is
transformers' same processor without it:
the image processor (its PIL backend), the tokenizer and the placeholder expansion are
transformers' own. NOTE: with no video processor it ignores `videos=`; the engine takes images
only (`GridImageInput.split` refuses video tensors). LFM2-VL's image processor itself is
torchvision's, so there it raises, and the replica refuses images
(deployments/frontend/images/chat_images.py).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any


@cache
def _image_only_class() -> type:
    from transformers import Lfm3VlProcessor

    class ImageOnlyLfm3VlProcessor(Lfm3VlProcessor):
        # NOTE: ProcessorMixin takes its sub-processors (and the keys it reads from the saved
        # files) from __init__'s parameters, so leaving `video_processor` out drops it
        # (transformers then never builds or checks one).
        def __init__(
            self,
            image_processor: Any = None,
            tokenizer: Any = None,
            chat_template: str | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return ImageOnlyLfm3VlProcessor


def load_processor(path: str | Path) -> Any:
    """transformers' processor for the checkpoint at `path` (see the module docstring)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError:
        config = json.loads((Path(path) / "config.json").read_text())
        if config.get("model_type") != "lfm3_vl":
            raise
        return _image_only_class().from_pretrained(str(path))
