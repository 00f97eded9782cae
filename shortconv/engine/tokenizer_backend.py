"""Which transformers class builds a checkpoint's tokenizer, chosen without `AutoTokenizer`.

Why: `AutoTokenizer` imports transformers' auto-configuration machinery, and with it torch
(`configuration_utils` -> `modeling_rope_utils`): 2-3 s on the 2-core machine, and the one
reason a replica whose engine runs in a core process imported torch at all
(docs/serving_path.md, "Start-up"). A checkpoint whose `tokenizer_config.json` names the generic
fast class (`TokenizersBackend`, or its v4 name `PreTrainedTokenizerFast`), with no remote code,
for a model type transformers registers no tokenizer of its own for, is built by exactly that
class: `AutoTokenizer` resolves it to `TokenizersBackend` (tests/engine/test_tokenizer_backend.py
checks both facts against transformers). Anything else still goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Our model types with no tokenizer class of their own in transformers' registry
# (`TOKENIZER_MAPPING_NAMES`); ZAYA1's "zaya" maps to GemmaTokenizer, so it is not here.
GENERIC_MODEL_TYPES = frozenset({"lfm2", "lfm2_moe", "lfm2_vl", "lfm3", "lfm3_vl"})


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def uses_generic_backend(model_dir: Path) -> bool:
    """Whether `AutoTokenizer` would build this directory's tokenizer as `TokenizersBackend`
    from its `tokenizer.json` (see the module docstring)."""
    if not (model_dir / "tokenizer.json").is_file():
        return False
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    model_type = _read_json(model_dir / "config.json").get("model_type")
    return (
        tok_cfg.get("tokenizer_class") in _GENERIC_CLASSES
        and "auto_map" not in tok_cfg
        and model_type in GENERIC_MODEL_TYPES
    )


def build_hf_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's transformers tokenizer, as `AutoTokenizer` builds it (local files)."""
    if uses_generic_backend(model_dir):
        # NOTE: this module of transformers imports `tokenizers`, never torch.
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(model_dir), trust_remote_code=False, local_files_only=True
    )
