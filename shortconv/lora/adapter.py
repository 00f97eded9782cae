"""Read one PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) from disk.

The engine does not import peft: it reads the two files PEFT's `save_pretrained` writes: the
config, and the weights file's header (names, shapes, dtypes), never its tensor data, which
each TP rank reads for itself, its shard only (`lora.shard_read`). What this module checks
needs no model (the files, the config's options); the checks against the model's layers
(module names, shapes, rank) are `lora.install`'s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from shortconv.lora.adapter_params import name_parameters
from shortconv.lora.tensors import LoraError, LoraTensors

__all__ = ["LoraAdapter", "LoraError", "LoraTensors", "read_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's key prefix on a causal LM (PeftModelForCausalLM.base_model.model).
_PEFT_PREFIX = "base_model.model."
_PARTS = {"lora_A": 0, "lora_B": 1}
# The float dtypes an adapter's tensors may have (safetensors' names), by bytes per element.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_Entry = tuple[tuple[int, int], int]  # (shape, itemsize)


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as read and checked: `modules` maps each HF module name (as the base
    checkpoint names it, PEFT's prefix stripped) to its tensors in the file; `scale` is
    alpha/r, or alpha/sqrt(r) with rsLoRA. `target_modules` is PEFT's list (or regex string).

    NOTE: it holds no weights: it is what the engine ships to every rank (small), and each
    rank reads its shard from `weights_file` (so the file must be readable where every rank
    runs, as the base checkpoint is). `stamp` (size, mtime_ns) is the file's as checked here:
    a rank refuses a file that changed since (`lora.shard_read`)."""

    path: Path
    rank: int
    scale: float
    target_modules: tuple[str, ...] | str
    modules: dict[str, LoraTensors]
    stamp: tuple[int, int]

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def tensor_rank(self) -> int:
        """The largest rank its tensors have: what its slot holds (`rank` is the config's)."""
        return max(t.rank for t in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.modules.values())


def read_adapter(path: str | Path) -> LoraAdapter:
    """Read and check an adapter directory; LoraError naming what is wrong."""
    root = Path(path)
    cfg = _read_config(root)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{root / CONFIG_FILE}: needs an integer r >= 1 and a lora_alpha")
    _refuse_options(root, cfg)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules")
    target_modules = targets if isinstance(targets, str) else tuple(sorted(targets or ()))
    stamp, index = _read_index(root)
    params = cfg.get("target_parameters") or []
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise LoraError(f"{root / CONFIG_FILE}: target_parameters must be a list of names")
    modules = name_parameters(root, _pair_tensors(root, index), params, rank)
    return LoraAdapter(root, rank, float(scale), target_modules, modules, stamp)


def _read_config(root: Path) -> dict:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise LoraError(
            f"{root}: no {CONFIG_FILE} (is this a PEFT LoRA adapter directory?)", "files"
        )
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{file}: not readable JSON ({exc})", "files") from exc
    if not isinstance(cfg, dict):
        raise LoraError(f"{file}: not a JSON object", "files")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{file}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _refuse_options(root: Path, cfg: dict) -> None:
    """PEFT options whose math this engine does not implement: refused, not ignored."""
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoraError(f"{root / CONFIG_FILE}: unsupported PEFT options {bad}")


def file_stamp(file: Path) -> tuple[int, int]:
    """(size, mtime_ns): what tells a rank the weights file is still the one checked."""
    st = file.stat()
    return st.st_size, st.st_mtime_ns


def _read_index(root: Path) -> tuple[tuple[int, int], dict[str, _Entry]]:
    """The weights file's stamp and its tensors' (shape, itemsize), from the header alone."""
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"{root}: no {WEIGHTS_FILE}", "files")
    try:
        stamp = file_stamp(file)
        # NOTE: opening checks the header and that it covers the whole file (a truncated
        # file is refused here); no tensor data is read.
        with safe_open(str(file), "pt", device="cpu") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}
            index = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in slices.items()}
    except (SafetensorError, OSError, ValueError) as exc:
        msg = f"{file}: not a readable safetensors file ({exc})"
        raise LoraError(msg, "files") from exc
    return stamp, {k: _entry(file, k, shape, dtype) for k, (shape, dtype) in index.items()}


def _entry(file: Path, key: str, shape: tuple[int, ...], dtype: str) -> _Entry:
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None or len(shape) != 2:
        raise LoraError(f"{file}: unexpected tensor {key!r} {dtype}{shape}", "files")
    return (shape[0], shape[1]), itemsize


def _pair_tensors(root: Path, index: dict[str, _Entry]) -> dict[str, LoraTensors]:
    """{module: LoraTensors} from PEFT's `<prefix><module>.lora_A.weight` / `.lora_B.weight`."""
    parts: dict[str, list[tuple[str, _Entry] | None]] = {}
    for key, entry in index.items():
        stem, _, leaf = key.removeprefix(_PEFT_PREFIX).rpartition(".")
        module, _, kind = stem.rpartition(".")
        if leaf != "weight" or kind not in _PARTS:
            raise LoraError(f"{root / WEIGHTS_FILE}: unexpected tensor {key!r} {entry[0]}", "files")
        parts.setdefault(module, [None, None])[_PARTS[kind]] = (key, entry)
    out: dict[str, LoraTensors] = {}
    for module, (a, b) in parts.items():
        if a is None or b is None:
            msg = f"{root / WEIGHTS_FILE}: {module} has lora_A or lora_B missing"
            raise LoraError(msg, "files")
        (a_key, (a_shape, a_size)), (b_key, (b_shape, _)) = a, b
        if a_shape[0] != b_shape[1]:
            msg = f"{module}: lora_A rank {a_shape[0]} != lora_B rank {b_shape[1]}"
            raise LoraError(msg, "files")
        out[module] = LoraTensors(a_key, b_key, a_shape, b_shape, a_size)
    if not out:
        raise LoraError(f"{root / WEIGHTS_FILE}: no LoRA tensors", "files")
    return out
