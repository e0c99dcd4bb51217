"""Frozen configuration: the model's shape (read once from a HF config.json) and the engine's settings."""

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV4ForCausalLM",
                           "DeepseekV41ForCausalLM")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek's `rope_scaling` / transformers 5's `rope_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class QuantConfig:
    """FP8 e4m3 weights with block scales (`weight_scale_inv`), as DeepSeek ships V3/R1."""

    weight_block_size: tuple[int, int] = (128, 128)


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V3-family shape; model code reads this, never the raw HF dict."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str  # "sigmoid" (V3) | "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3) | "greedy" | "group_limited_greedy" (V2)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's dtype, used for dtype="auto"
    quant: QuantConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Latent cache width per token and layer: compressed KV plus the shared rope key (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig | DeepseekV4Config":
        if hf.get("model_type") in V41_MODEL_TYPES:
            return DeepseekV41Config.from_hf(hf)
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "DeepseekV4ForCausalLM":
            return DeepseekV4Config.from_hf(hf)
        if arch == "DeepseekV41ForCausalLM":
            return DeepseekV41Config.from_hf(hf)
        is_v3 = arch == "DeepseekV3ForCausalLM"
        # DeepSeek publishes `rope_scaling` + `rope_theta`; transformers 5 writes `rope_parameters`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta, scaling = _rope(rope, hf)
        quant = _quant(hf)
        eos_ids = _eos_ids(hf)
        n_routed = hf.get("n_routed_experts")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf.get("moe_intermediate_size", hf["intermediate_size"]),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            n_routed_experts=n_routed,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            first_k_dense_replace=hf.get("first_k_dense_replace", 0),
            moe_layer_freq=hf.get("moe_layer_freq", 1),
            norm_topk_prob=bool(hf.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            scoring_func=hf.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
            topk_method=hf.get("topk_method", "noaux_tc" if is_v3 else "greedy"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            quant=quant,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig | DeepseekV4Config":
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        try:
            hf = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg} is not valid JSON: {e}") from e
        config = cls.from_hf(hf)
        if isinstance(config, DeepseekV41Config) and hf.get("vision_config"):
            config = config.with_vision(hf, Path(path))
        return config


def _rope(rope: dict, hf: dict) -> tuple[float, "RopeScaling | None"]:
    """(theta, YaRN scaling or None) from one rope dict (`rope_scaling` or `rope_parameters` style)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type in ("default", None):
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, yarn")
    return theta, RopeScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
        ),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def _quant(hf: dict) -> "QuantConfig | None":
    qc = hf.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported quantization_config {qc!r}; supported: fp8 e4m3 block-scaled")
    return QuantConfig(weight_block_size=tuple(qc.get("weight_block_size", (128, 128))))


def _eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id", 1)
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


# transformers 5 names V4's attention kinds; DeepSeek's config.json lists a compression ratio per layer
V4_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class DeepseekV4Config:
    """The DeepSeek-V4 shape: hybrid compressed attention, mHC residual streams, hash-routed first layers.

    `compress_ratios[i]` is layer i's compression: 0 = sliding window only, 4 = CSA (overlapping
    windows, read through the sparse indexer), 128 = HCA (dense over every entry); tiny test models
    use other ratios, the kind follows from whether the layer has an indexer (`csa_ratio`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    compress_ratios: tuple[int, ...]
    csa_ratio: int  # the ratio of layers with an indexer (compressed sparse attention)
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by token id (tid2eid)
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    rope_theta: float  # sliding-window-only layers
    compress_rope_theta: float  # compressed layers (their window keys too), with compress_rope_scaling
    compress_rope_scaling: RopeScaling | None
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    quant: QuantConfig | None = None  # FP8 blocks of the dense linears (the experts: expert_dtype)
    expert_dtype: str | None = None  # "fp4": MXFP4 routed experts

    def layer_kind(self, layer: int) -> str:
        r = self.compress_ratios[layer]
        return "window" if r == 0 else ("csa" if r == self.csa_ratio else "hca")

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV4Config":
        n = hf["num_hidden_layers"]
        if hf.get("layer_types"):  # transformers 5
            rates = dict(hf.get("compress_rates") or {})
            ratio = {t: rates.get(t, r) for t, r in V4_LAYER_TYPES.items()}
            unknown = [t for t in hf["layer_types"] if t not in ratio]
            if unknown:
                raise ValueError(f"unknown DeepSeek-V4 layer types {unknown}; known: {', '.join(ratio)}")
            ratios = [ratio[t] for t in hf["layer_types"]]
            csa = ratio["compressed_sparse_attention"]
        else:  # DeepSeek's config.json
            ratios = list(hf.get("compress_ratios") or [])
            csa = int(hf.get("compress_rate_csa", 4))
        ratios = tuple(int(r) for r in ratios[:n])
        if len(ratios) != n:
            raise ValueError(f"DeepSeek-V4 config lists {len(ratios)} compression ratios for {n} layers")
        if hf.get("mlp_layer_types"):
            hashed = tuple(t == "hash_moe" for t in hf["mlp_layer_types"][:n])
        else:
            k = int(hf.get("num_hash_layers", 3))
            hashed = tuple(i < k for i in range(n))
        rp = hf.get("rope_parameters") or {}
        if isinstance(rp.get("main"), dict):  # transformers 5: one dict per rope kind
            main_theta, _ = _rope(rp["main"], hf)
            compress_theta, compress_scaling = _rope(rp.get("compress") or {}, hf)
        else:
            main_theta = float(hf.get("rope_theta", 10000.0))
            yarn = dict(hf.get("rope_scaling") or rp)
            yarn["rope_theta"] = hf.get("compress_rope_theta", 160000.0)
            compress_theta, compress_scaling = _rope(yarn, hf)
        if compress_scaling is not None and compress_scaling.attention_factor is None:
            # V4 does not scale cos/sin by YaRN's mscale
            compress_scaling = dataclasses.replace(compress_scaling, attention_factor=1.0)
        head_dim = hf.get("head_dim", 512)
        if "qk_rope_head_dim" in hf:
            rope_dim = int(hf["qk_rope_head_dim"])
        else:
            rope_dim = int(head_dim * float(hf.get("partial_rotary_factor") or 64 / 512))
        qc = hf.get("quantization_config") or {}
        return cls(
            architecture="DeepseekV4ForCausalLM",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=hf["num_attention_heads"],
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=hf["q_lora_rank"],
            o_groups=hf.get("o_groups", 8),
            o_lora_rank=hf.get("o_lora_rank", 1024),
            moe_intermediate_size=hf["moe_intermediate_size"],
            n_routed_experts=hf["n_routed_experts"],
            n_shared_experts=hf.get("n_shared_experts", 1),
            num_experts_per_tok=hf["num_experts_per_tok"],
            scoring_func=hf.get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
            compress_ratios=ratios,
            csa_ratio=csa,
            hash_layers=hashed,
            sliding_window=hf.get("sliding_window", 128),
            hc_mult=hf.get("hc_mult", 4),
            hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=float(hf.get("hc_eps", 1e-6)),
            index_n_heads=hf.get("index_n_heads", 64),
            index_head_dim=hf.get("index_head_dim", 128),
            index_topk=hf.get("index_topk", 512),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=main_theta,
            compress_rope_theta=compress_theta,
            compress_rope_scaling=compress_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 1048576),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            quant=_quant(hf) if qc else None,
            expert_dtype=hf.get("expert_dtype") or qc.get("expert_dtype"),
        )


V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


@dataclass(frozen=True)
class DeepseekV41Config(DeepseekV4Config):
    """DeepSeek-V4.1: V4's shape with compressed caches shared by layers. Only `kv_source_layer_ids`
    compress (ratio 2: gated pooling of 2 tokens, ratio 1: every token); other layers with a ratio read
    the nearest source at or before them. `index_source_layer_ids` run the sparse indexer (with the
    keys of their KV source); the other compressed layers reuse the last index source's picks. Index
    sources after `candidate_source_layer_id` score only inside its top `candidate_topk_blocks` blocks
    of `candidate_block_size` entries (-1: one level). Engram tables on `engram_layer_ids`."""

    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    gate_temp: float = 1.0
    engram_layer_ids: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000
    engram_compressed_vocab_size: int = 0
    engram_num_embeddings: tuple[int, ...] = ()
    engram_pad_id: int = 2
    vision: "object | None" = None  # engine.models.deepseek_vit.VisionConfig: the checkpoint has an image tower

    def with_vision(self, hf: dict, path: Path) -> "DeepseekV41Config":
        """The released config.json describes a vision tower even where a checkpoint ships none (text-only
        exports, the reference's text class): build it where its weights are, or where no weights are
        (random ones, load_format="dummy")."""
        from engine.loader import CheckpointError, checkpoint_files
        from engine.models.deepseek_vit import VisionConfig

        try:
            names = checkpoint_files(path)
        except CheckpointError:
            names = None
        if names is not None and not any(name.startswith("vision.") for name in names):
            return self
        return dataclasses.replace(self, vision=VisionConfig.from_dict(hf["vision_config"], hf.get("image_token_id")))

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed cache this one reads (None: window only)."""
        if not self.compress_ratios[layer]:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def layer_kind(self, layer: int) -> str:
        return "window" if self.compress_ratios[layer] == 0 else "shared"

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV41Config":
        """The released composite config.json (`text_config` inside) or the flat `deepseek_v41_text` one."""
        text = dict(hf.get("text_config") or hf)
        if "compress_ratios" not in text:
            raise ValueError("a DeepSeek-V4.1 config.json must list compress_ratios (one per layer)")
        text.pop("layer_types", None)  # V4.1's layer types name the KV sources, the ratios say the rest
        text.setdefault("num_hash_layers", 0)
        text.setdefault("head_dim", 512)
        if "qk_rope_head_dim" not in text:
            rp = (text.get("rope_parameters") or {}).get("main") or {}
            text["qk_rope_head_dim"] = int(text["head_dim"] * float(rp.get("partial_rotary_factor", 64 / 512)))
        base = DeepseekV4Config.from_hf(text)
        n = base.num_hidden_layers
        ratios = base.compress_ratios
        kv = tuple(int(i) for i in text.get("kv_source_layer_ids") or ())
        index = tuple(int(i) for i in text.get("index_source_layer_ids") or ())
        for layer in range(n):
            if ratios[layer] and not any(s <= layer for s in kv):
                raise ValueError(f"DeepSeek-V4.1 layer {layer} compresses but no KV source comes at or before it")
            if ratios[layer] and ratios[max(s for s in kv if s <= layer)] != ratios[layer]:
                raise ValueError(f"DeepSeek-V4.1 layer {layer} reads a KV source of another compression ratio")
        if not set(kv) <= set(index):
            raise ValueError("every DeepSeek-V4.1 KV source must be an index source (it owns the indexer keys)")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        fields.update(architecture="DeepseekV41ForCausalLM", csa_ratio=0)
        limit = float(text.get("swiglu_limit", 10.0))
        fields["swiglu_limit"] = limit if limit > 0 else float("inf")
        engram = tuple(int(i) for i in text.get("engram_layer_ids") or ())
        return cls(
            **fields,
            kv_source_layer_ids=kv,
            index_source_layer_ids=index,
            candidate_source_layer_id=int(text.get("candidate_source_layer_id", -1)),
            candidate_topk_blocks=int(text.get("candidate_topk_blocks", 2048)),
            candidate_block_size=int(text.get("candidate_block_size", 8)),
            gate_temp=float(text.get("gate_temp", 1.0)),
            engram_layer_ids=engram,
            engram_max_ngram_size=int(text.get("engram_max_ngram_size", 4)),
            engram_n_heads=int(text.get("engram_n_heads", 8)),
            engram_head_dim=int(text.get("engram_head_dim", 256)),
            engram_vocab_size=int(text.get("engram_vocab_size", 16_000_000)),
            engram_compressed_vocab_size=int(text.get("engram_compressed_vocab_size", 0)),
            engram_num_embeddings=tuple(int(i) for i in text.get("engram_num_embeddings") or ()),
            engram_pad_id=int(text.get("engram_pad_id", 2)),
        )


def required_block_size(model_config: "ModelConfig | DeepseekV4Config", block_size: int) -> int:
    """The KV page size a model needs: V4's pages hold whole compression windows (its compressed
    caches have block_size / ratio rows per page), so the least multiple of every ratio."""
    for ratio in getattr(model_config, "compress_ratios", ()):
        if ratio:
            block_size = math.lcm(block_size, ratio)
    return block_size


KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def model_fingerprint(path: Path, dtype: str, block_size: int, num_draft_layers: int = 0,
                      kv_cache_dtype: str = "auto") -> str:
    """Identifies what a KV block means: the same checkpoint, cache dtype, page size and cached layers
    (the MTP draft layers' caches ride in the same blocks) on every replica, wherever the checkpoint is
    mounted, gives the same key."""
    h = hashlib.blake2b(digest_size=12)
    for name in ("config.json", "model.safetensors.index.json"):
        f = path / name
        if f.is_file():
            h.update(f.read_bytes())
    h.update(f"{dtype}/{block_size}".encode())
    if num_draft_layers:
        h.update(f"/draft{num_draft_layers}".encode())
    if kv_cache_dtype == "fp8":  # other bytes per block: an FP8 replica and a bf16 one share no block
        h.update(b"/kv-fp8")
    return h.hexdigest()


def resolve_model_path(model: str) -> Path:
    """A directory path, or the name of a model embedded in the package (`deepseek-tiny`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    embedded = Path(__file__).parent / "models" / model
    if embedded.is_dir() and (embedded / "config.json").is_file():
        return embedded
    raise FileNotFoundError(f"model {model!r} is neither a directory nor an embedded model (deepseek-tiny)")


SPECULATIVE_METHODS = ("mtp",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `speculative_config` names it: `{"method": "mtp",
    "num_speculative_tokens": k}` drafts k tokens a step with the checkpoint's multi-token-prediction
    layer (reused autoregressively for k > 1), verified by one pass of the target.
    `disable_by_batch_size`: steps with more running requests than this draft nothing (where
    verifying k + 1 rows a request costs more than the accepted tokens save). Unset, an engine with CUDA
    graphs measures that size at start (`LLMEngine.measure_batch_cutoff`) and moves it with the
    acceptance it counts; elsewhere (a CPU) every batch size drafts."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError(f"num_speculative_tokens must be in [1, 8], got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the `--speculative-config` flag); None, {} and "" mean off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        if not value:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative config needs num_speculative_tokens")
        return cls(**value)


# a 2k-token prompt's prefill is bound by the host when eager (docs/perf.md, "Prefill steps from CUDA
# graphs"): from 33-63k to 76-78k tokens/s for DeepSeek-V2-Lite on an H200
DEFAULT_PREFILL_GRAPH_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance; derived values are properties."""

    model: str = "deepseek-tiny"
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    block_size: int = 16  # tokens per KV page
    # the latent cache's dtype (vLLM's name): auto = the activations'; bf16; fp8 = e4m3 c_kv with a scale
    # per token, k_pe as is (engine.layers.fp8_latent; V3-family MLA only)
    kv_cache_dtype: str = "auto"
    # the KV pool's size per rank: num_kv_blocks if set, else kv_cache_memory bytes, else on a GPU
    # gpu_memory_utilization of the card (what weights, activations and others leave), else 1 GiB
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    # pages of a sliding-window cache kind (V4), which the blocks do not carry: None: sized from
    # max_num_seqs and max_num_batched_tokens (`ModelRunner.window_pages_needed`); 0: none of its own
    # (a window page per block, every token's row kept)
    num_window_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    # parallelism: one process per rank (tensor_parallel_size ranks over nnodes nodes, rank 0 plans)
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # routed experts partitioned over the ranks instead of split
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous (None: a free local port)
    seed: int = 0
    # auto: the checkpoint's weights; dummy: random ones from `seed` (vLLM's name), for measuring a
    # model's shapes from its config.json alone
    load_format: str = "auto"
    attention_backend: str = "auto"  # auto | torch
    engram_tables: str = "device"  # where V4.1's Engram tables live: device | host (pinned; rows copied per step)
    enable_prefix_caching: bool = True
    show_progress: bool = True
    # launch a decode step before the tokens of the one running reach the host: auto = on a CUDA device
    async_scheduling: str = "auto"  # auto | on | off
    # steps of up to this many tokens, longer than the decode graphs', replay CUDA graphs of their padded
    # length: a fresh prompt whole, the others in pieces around attention (engine.model_runner's
    # PrefillGraphs, PiecewiseGraphs). None: DEFAULT_PREFILL_GRAPH_TOKENS where the model has them (V3
    # family, CUDA graphs on), else off; 0: eager
    prefill_graph_tokens: int | None = None
    # cross-replica KV reuse (None: local prefix cache only)
    kv_directory: str | None = None  # redis://...
    replica_id: str | None = None
    advertise_host: str = "127.0.0.1"
    kv_transport: str = "auto"
    kv_transfer_port: int = 8100
    kv_transfer_streams: int | None = None  # TCP connections per large pull (None: min(4, usable cores))
    kv_min_prefix_tokens: int = 64
    kv_pull_policy: str = "auto"  # auto | always | never
    kv_secret: bytes | None = field(default=None, repr=False)  # the fleet's secret (peers authenticate)
    # speculative decoding (None: off): a SpeculativeConfig, or its dict / JSON form
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, hash=False)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.dtype not in DTYPES:
            raise ValueError(f"invalid dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.kv_transfer_streams is not None and self.kv_transfer_streams < 1:
            raise ValueError(f"kv_transfer_streams must be >= 1, got {self.kv_transfer_streams}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_pull_policy not in ("auto", "always", "never"):
            raise ValueError(f"kv_pull_policy must be auto, always or never, got {self.kv_pull_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.engram_tables not in ("device", "host"):
            raise ValueError(f"engram_tables must be device or host, got {self.engram_tables!r}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.kv_transport not in ("auto", "tcp", "rdma"):
            raise ValueError(f"kv_transport must be auto, tcp or rdma, got {self.kv_transport!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_window_pages is not None and self.num_window_pages < 0:
            raise ValueError(f"num_window_pages must be >= 0, got {self.num_window_pages}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("tensor_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} is not a multiple of nnodes "
                             f"{self.nnodes} (each node runs the same number of ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("a replica over several nodes needs dist_init_addr (host:port of node 0)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a step proposes per request (0: speculative decoding is off)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0
