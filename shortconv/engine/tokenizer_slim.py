"""Drop what a loaded Hugging Face tokenizer keeps only to be saved again.

transformers' tokenizer keeps `init_kwargs`, a deep copy of its constructor's arguments, so
that `save_pretrained` can write `tokenizer_config.json` back. Among them is
`added_tokens_decoder`: one more `AddedToken` per added token. The live tokenizer already
holds its added tokens (its Rust backend and `added_tokens_decoder`, which is built from the
backend, not from this copy). For the LFM2-350M-shaped bench checkpoint (65k added tokens)
the copy costs about 58 MB of the tokenizer's 76 MB, in each process that loads one (the
replica and the engine core): docs/serving_path.md, "Memory".

The engine never saves a tokenizer, so the copy goes at load.
"""

from __future__ import annotations

from typing import Any


def drop_save_only_copies(hf_tokenizer: Any) -> Any:
    """`hf_tokenizer` without its save-only copy of the added tokens (in place; returned)."""
    init_kwargs = getattr(hf_tokenizer, "init_kwargs", None)
    if isinstance(init_kwargs, dict):
        init_kwargs.pop("added_tokens_decoder", None)
    return hf_tokenizer
