"""Whether the installed transformers can build a given architecture.

The GPU machine pins an older transformers (5.17) than the development environment (5.24), and
an architecture added in between (ZAYA's `zaya`, LFM3's `lfm3`) may be missing there. Tests and
benchmarks that need transformers for a checkpoint or an oracle ask here first and fall back
(our own torch reference) or skip with this reason instead of crashing.
"""

from __future__ import annotations


def transformers_lacks(model_type: str) -> str | None:
    """None if transformers is importable and knows `model_type`, else the reason it cannot."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError as exc:
        return f"transformers does not import ({exc})"
    if model_type not in CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no {model_type!r} model type"
    return None
