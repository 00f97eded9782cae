"""Model and engine configuration, parsed once from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shortconv.configs.hf import model_fields
from shortconv.configs.hf.common import RopeSpec
from shortconv.configs.session_store import SessionStoreConfig
from shortconv.configs.speculative import SpeculativeConfig
from shortconv.errors import ConfigError

if TYPE_CHECKING:
    import torch

# Dtype names -> torch's attribute names. NOTE: names, not torch dtypes, so that importing the
# configs (the app's build task, the ingress) does not import torch (about 2.6 s there).
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs; every field is resolved (no HF defaults left)."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    # Per layer: "conv" | "attention" (full causal) | "sliding_attention" (LFM3) | "cca" (ZAYA1).
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    norm_eps: float
    max_model_len: int
    intermediate_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Short conv (LFM2 / LFM2-MoE).
    conv_width: int = 0
    conv_bias: bool = False
    # MoE (LFM2-MoE and ZAYA1).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_dense_layers: int = 0
    use_expert_bias: bool = False
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # ZAYA1 CCA.
    cca_time0: int = 0
    cca_time1: int = 0
    router_hidden_size: int = 0
    attention_bias: bool = False
    lm_head_bias: bool = False
    hidden_act: str = "silu"
    # Sliding-window attention (LFM3): a "sliding_attention" layer's query at position p sees
    # the keys at positions (p - sliding_window, p]; 0 when the model has no such layer.
    sliding_window: int = 0
    # LFM3: RoPE per attention layer kind where it differs from (rope_theta, rotary_dim) (see
    # rope_of), a per-head sigmoid output gate on attention (`g_proj`), and a norm on each
    # operator's and MLP's output before the residual add (`post_operator_norm`, `post_ffn_norm`).
    rope_by_kind: tuple[tuple[str, RopeSpec], ...] = ()
    attention_gate: bool = False
    sandwich_norm: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        kinds = ("attention", "sliding_attention", "cca")
        return tuple(i for i, t in enumerate(self.layer_types) if t in kinds)

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        """Attention layers that see only the last `sliding_window` positions."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    def window_of(self, layer_id: int) -> int:
        """The attention window of a layer in tokens; 0 means the whole context."""
        return self.sliding_window if self.layer_types[layer_id] == "sliding_attention" else 0

    def rope_of(self, kind: str) -> RopeSpec:
        """The RoPE of attention layers of `kind` ("attention", "sliding_attention")."""
        return dict(self.rope_by_kind).get(kind, RopeSpec(self.rope_theta, self.rotary_dim))

    @property
    def conv_layer_ids(self) -> tuple[int, ...]:
        """Layers that own a slot in the conv-state pool (LFM2 conv layers, ZAYA1 CCA layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ("conv", "cca"))

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir!s}: not a Hugging Face checkpoint")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return ModelConfig.from_hf_dict(raw)

    @staticmethod
    def from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
        """Read through the architecture's transformers config class (see shortconv.configs.hf)."""
        return ModelConfig(**model_fields(raw), raw=raw)


def resolve_dtype(dtype: str | torch.dtype, raw: dict[str, Any] | None = None) -> torch.dtype:
    """`auto` takes the checkpoint's `torch_dtype`/`dtype` (float32 when absent)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        found = (raw or {}).get("dtype") or (raw or {}).get("torch_dtype") or "float32"
        return getattr(torch, _DTYPES.get(str(found), "float32"))
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}")
    return getattr(torch, _DTYPES[dtype])


CPU_PREFILL_TOKENS_WHILE_DECODING = 32


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and scheduling knobs of one engine (one replica).

    NOTE: a field's bounds are its `metadata` (`ge`/`gt`), checked here and read by the app's
    args (deployments/frontend/config/args.py builds its pydantic fields from these fields), so a
    bound is written once."""

    max_num_seqs: int = field(default=32, metadata={"ge": 1})
    max_num_batched_tokens: int = field(default=512, metadata={"ge": 1})
    # The most forks (`SamplingParams.n`, OpenAI's `n`) one request may ask for; each fork is
    # one running sequence with a slot of its own once its prompt has been computed.
    max_n: int = field(default=16, metadata={"ge": 1})
    # Prompt tokens one step carries while any request decodes (decode goes first), so a
    # stream's inter-token gap stays one decode step plus this much prefill however many
    # prompts arrive. 0: by device: 32 on CPU, where a prompt token costs about what a decode
    # row does and the step's time grows with every one; max_num_batched_tokens on CUDA, where
    # a step costs about the same up to hundreds of tokens.
    max_prefill_tokens_while_decoding: int = field(default=0, metadata={"ge": 0})
    # 0: max_num_seqs + 1 scratch + spare slots for session checkpoints
    num_state_slots: int = field(default=0, metadata={"ge": 0})
    kv_page_size: int = field(default=16, metadata={"ge": 1})
    # 0: enough for max_num_seqs full-length sequences, capped by kv_cache_bytes
    num_kv_pages: int = field(default=0, metadata={"ge": 0})
    max_model_len: int = field(default=0, metadata={"ge": 0})  # 0: max_position_embeddings
    kv_cache_bytes: int = field(default=1 << 30, metadata={"ge": 1})  # cap when num_kv_pages=0
    # A kept session idle this long is dropped.
    session_ttl_s: float = field(default=600.0, metadata={"gt": 0})
    # None: graph-captured decode on CUDA only. On CPU a "replay" is the same eager forward on
    # static buffers padded to a (batch, context) bucket, plus a per-step state snapshot, and MoE
    # runs every expert: measured 1.3x slower per decode step (bench/RESULTS.md, CPU results).
    enable_graphs: bool | None = None
    graph_batch_sizes: tuple[int, ...] = field(
        default=(1, 2, 4, 8, 16, 32), metadata={"min_length": 1}
    )
    # Decode contexts (tokens) the captured graphs cover on the torch attention path, each
    # capped at max_model_len; longer contexts decode eagerly. The Triton path ignores it (one
    # bucket, max_model_len). See shortconv.execution.graph_runner for why context is bucketed.
    graph_context_sizes: tuple[int, ...] = field(
        default=(256, 512, 1024, 2048, 4096, 8192), metadata={"min_length": 1}
    )
    # CPU fp32: keep a oneDNN-blocked copy of every large linear weight beside the plain one,
    # for batches of 8+ rows. Off: the copy costs the weights' size again in memory, and oneDNN
    # on the plain weight measured within 0-13% of it at 32 rows and 1.4-2x faster at one row
    # (docs/serving_path.md, Memory), so one copy serves every batch size.
    prepack_cpu_weights: bool = False
    # CPU: fp32 linears at decode batch sizes (up to 64 rows) through our AVX2 loops
    # (shortconv.kernels.cpu_gemm), built once with the system's C++ compiler; where they cannot
    # be built or this CPU lacks AVX2, torch's paths are used and the start-up log says why.
    cpu_kernels: bool = True
    # Linear weights quantized at load, per rank after TP sharding (shortconv.layers.quantize):
    # "int8": int8 with one scale per 32 weights of a row, on CPU (kernels/cpu_gemm). The
    # embedding (for lookups), routed experts and vision towers keep the model dtype; the LM
    # head is quantized too unless quantize_lm_head is off. "int4": 4-bit codes with a scale and
    # a min per 32 weights of a row, on CPU (kernels/cpu_gemm_q4), the same weights, with the
    # LM head and Q4_K_M's ffn_down layers in q6 (kernels/cpu_gemm_q6). "fp8" is named so a
    # YAML asking for it is refused at start-up with the reason.
    quantization: Literal["none", "int8", "int4", "fp8"] = "none"
    # With quantization: the LM head too (q8 under int8, q6 under int4), as llama.cpp quantizes
    # its output tensor, so equal bits mean the same thing. A head tied to the embedding gets
    # its own quantized copy (the embedding keeps its float rows, so lookups stay exact), and
    # decode reads the head's quantized bytes instead of its float ones. Off: the head stays in the
    # model dtype.
    quantize_lm_head: bool = True
    # Automatic prefix caching (shortconv.cache.prefix_cache): KV pages shared by reference,
    # recurrent state checkpointed every `prefix_checkpoint_interval` prompt tokens (0: 64
    # rounded up to whole pages; a multiple of kv_page_size) and at every end of prompt and of
    # generation, in `num_checkpoint_slots` extra state slots (0: 8 per max_num_seqs).
    enable_prefix_caching: bool = True
    prefix_checkpoint_interval: int = field(default=0, metadata={"ge": 0})
    num_checkpoint_slots: int = field(default=0, metadata={"ge": 0})
    # Speculative decoding (docs/speculative_decoding.md): None off; a mapping is parsed into
    # a `SpeculativeConfig` (vLLM's `--speculative-config` keys).
    speculative_config: SpeculativeConfig | None = None
    # Durable sessions (docs/session_store.md): None off; a mapping `{path, ttl_s, max_bytes}`
    # is parsed into a `SessionStoreConfig`.
    session_store: SessionStoreConfig | None = None
    # Multi-LoRA (docs/lora.md): PEFT adapters applied per request, up to `max_loras` resident
    # at once (LRU slots, in every projection's layer) of rank up to `max_lora_rank`;
    # `lora_modules` (name → adapter directory) are loaded at start-up.
    enable_lora: bool = False
    max_loras: int = field(default=4, metadata={"ge": 1})
    max_lora_rank: int = field(default=64, metadata={"ge": 1})
    lora_modules: dict[str, str] | None = None

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        store = SessionStoreConfig.parse(self.session_store)
        object.__setattr__(self, "session_store", store)
        for f in fields(self):
            value, bounds = getattr(self, f.name), f.metadata
            if "ge" in bounds and value < bounds["ge"]:
                raise ConfigError(f"{f.name} must be >= {bounds['ge']}, got {value}")
            if "gt" in bounds and value <= bounds["gt"]:
                raise ConfigError(f"{f.name} must be > {bounds['gt']}, got {value}")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules needs enable_lora=True")
        interval = self.prefix_checkpoint_interval
        if interval % self.kv_page_size:
            raise ConfigError(
                f"prefix_checkpoint_interval must be 0 (auto) or a positive multiple of "
                f"kv_page_size={self.kv_page_size}, got {interval}"
            )

    @property
    def checkpoint_interval(self) -> int:
        """Tokens between a prompt's state checkpoints (whole KV pages)."""
        if self.prefix_checkpoint_interval:
            return self.prefix_checkpoint_interval
        return -(-64 // self.kv_page_size) * self.kv_page_size

    @property
    def num_speculative_tokens(self) -> int:
        """k, the tokens a speculating request proposes per step (0: speculation off)."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    @property
    def checkpoint_slots(self) -> int:
        """State slots reserved for prefix-cache checkpoints (0 with caching off)."""
        if not self.enable_prefix_caching:
            return 0
        return self.num_checkpoint_slots or 8 * self.max_num_seqs

    def prefill_tokens_while_decoding(self, device: torch.device) -> int:
        """`max_prefill_tokens_while_decoding`, with 0 resolved for `device`."""
        if self.max_prefill_tokens_while_decoding:
            return self.max_prefill_tokens_while_decoding
        return CPU_PREFILL_TOKENS_WHILE_DECODING if device.type == "cpu" else 0

    def graphs_enabled(self, device: torch.device) -> bool:
        """`enable_graphs`, with None resolved for `device` (on for CUDA only)."""
        if self.enable_graphs is None:
            return device.type == "cuda"
        return self.enable_graphs
