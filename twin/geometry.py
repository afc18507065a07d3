"""Model geometries: the shape of an MoE model as the twin prices it, as data (pure; no torch).

A `Geometry` holds what a model's published HF `config.json` says (layers, MoE layers, routed
experts E, top-k, shared experts, hidden size H, expert FFN size F, dtype, attention shape, vocab)
and derives from it the bytes the twin bills: one routed expert (3 x H x F parameters: gate, up,
down) and everything else (`non_expert_params`, the formula below). Sources:

- `GEOMETRIES`: the paper's three models (Mixtral-8x7B, Phi-3.5-MoE, Llama-4-Scout) and
  DeepSeek-V2-Lite, Qwen3-30B-A3B, OLMoE-1B-7B, each with the URL of its config.json;
- "default": the project's default model (SmolLM2-135M MoEfied, model/shape.py), float32 as the
  expert hosts run it;
- any HF config.json given as a path (`parse_hf_config`: the keys of the mixtral, phimoe, llama4,
  deepseek_v2/v3, qwen2_moe/qwen3_moe and olmoe families).

    load_geometry("mixtral-8x7b").expert_bytes   # 352_321_536 (bf16)
    load_geometry("path/to/config.json")

Non-expert parameters (per model; L layers, of which L_moe MoE, V vocab, H hidden):
  embeddings V*H (+ an untied LM head V*H, + its bias V) + final norm
  + L x (attention + 2 norms)
  + L_moe x (router H*E (+E bias) + shared experts 3*H*S (+ a shared-expert gate H))
  + (L - L_moe) x dense FFN 3*H*F_dense
  attention, GQA: q H*(n*d) + k, v 2*H*(n_kv*d) + o (n*d)*H (+ biases) (+ q/k norms);
  MLA (DeepSeek): q (via its low rank if any) + kv_a H*(r_kv + d_rope) + kv norm r_kv
                  + kv_b r_kv*n*(d_nope + d_v) + o n*d_v*H.
A norm holds H weights (RMSNorm) or 2H (LayerNorm: weight and bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moeless.core.json_file import read_json
from moeless.model.shape import DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K, SOURCE_FFN, SOURCE_HIDDEN

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


class GeometryError(ValueError):
    """An unknown model name or a config.json that lacks what a geometry needs."""


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention (config keys of the same names)."""

    kv_lora_rank: int
    q_lora_rank: int  # 0: q is a plain projection
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Geometry:
    """One MoE model's shape (a config.json's values) and the bytes the twin bills for it."""

    name: str
    source: str  # the config.json's URL or path
    num_layers: int  # decoder layers
    moe_layers: int  # of which MoE layers (the others have a dense FFN of dense_ffn)
    num_experts: int  # E routed experts per MoE layer
    top_k: int  # k routed experts per token
    hidden: int  # H
    expert_ffn: int  # F neurons of one routed expert (SwiGLU: gate, up [F, H], down [H, F])
    dtype: str  # the weights' dtype, a key of DTYPE_BYTES
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    shared_experts: int = 0  # shared experts per MoE layer (run on every token; non-expert here)
    shared_ffn: int = 0  # neurons of all shared experts of one MoE layer together
    dense_ffn: int = 0  # neurons of a dense layer's FFN
    tied_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = "none"  # "none", "head" (weights of head_dim: Qwen3) or "full" (of n*d: OLMoE)
    norm: str = "rms"  # "rms" (H weights) or "layer" (2H: weight and bias)
    lm_head_bias: bool = False
    router_bias: bool = False
    shared_expert_gate: bool = False  # Qwen2-MoE gates its shared expert with an H -> 1 projection
    mla: Mla | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise GeometryError(f"{self.name}: unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        if not 0 < self.moe_layers <= self.num_layers or not 0 < self.top_k <= self.num_experts:
            raise GeometryError(f"{self.name}: need 0 < moe_layers <= num_layers and 0 < top_k <= num_experts, got "
                                f"{self.moe_layers}/{self.num_layers} layers, top-{self.top_k} of {self.num_experts}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: 3 x H x F."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.dtype_bytes

    @property
    def non_expert_params(self) -> int:
        return non_expert_params(self)

    @property
    def non_expert_bytes(self) -> int:
        return self.non_expert_params * self.dtype_bytes

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all non-expert ones and k routed experts per MoE layer."""
        return self.non_expert_params + self.moe_layers * self.top_k * self.expert_params


def attention_params(g: Geometry) -> int:
    """Parameters of one layer's attention block (projections, biases, q/k norms)."""
    h, n, nkv, d = g.hidden, g.heads, g.kv_heads, g.head_dim
    if g.mla is not None:
        m = g.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * n * qk if not m.q_lora_rank else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h
    params = 2 * h * n * d + 2 * h * nkv * d
    if g.attention_bias:
        params += n * d + 2 * nkv * d + h
    params += {"none": 0, "head": 2 * d, "full": n * d + nkv * d}[g.qk_norm]
    return params


def non_expert_params(g: Geometry) -> int:
    """Every parameter but the routed experts' (the module docstring's formula)."""
    h = g.hidden
    norm = h * (2 if g.norm == "layer" else 1)
    # 1. Embeddings, LM head, final norm.
    params = g.vocab * h + (0 if g.tied_embeddings else g.vocab * h) + (g.vocab if g.lm_head_bias else 0) + norm
    # 2. Every layer: attention and its two norms.
    params += g.num_layers * (attention_params(g) + 2 * norm)
    # 3. MoE layers: router and shared experts; dense layers: their FFN.
    per_moe = h * g.num_experts + (g.num_experts if g.router_bias else 0) + 3 * h * g.shared_ffn
    per_moe += h if g.shared_expert_gate else 0
    params += g.moe_layers * per_moe + (g.num_layers - g.moe_layers) * 3 * h * g.dense_ffn
    return params


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


# The values of each model's published config.json (the URL in `source`).
GEOMETRIES: dict[str, Geometry] = {g.name: g for g in (
    Geometry("mixtral-8x7b", _hub("mistralai/Mixtral-8x7B-v0.1"), num_layers=32, moe_layers=32, num_experts=8, top_k=2,
             hidden=4096, expert_ffn=14336, dtype="bfloat16", vocab=32000, heads=32, kv_heads=8, head_dim=128),
    Geometry("phi-3.5-moe", _hub("microsoft/Phi-3.5-MoE-instruct"), num_layers=32, moe_layers=32, num_experts=16, top_k=2,
             hidden=4096, expert_ffn=6400, dtype="bfloat16", vocab=32064, heads=32, kv_heads=8, head_dim=128,
             attention_bias=True, norm="layer", lm_head_bias=True),
    Geometry("llama-4-scout", _hub("meta-llama/Llama-4-Scout-17B-16E"), num_layers=48, moe_layers=48, num_experts=16,
             top_k=1, hidden=5120, expert_ffn=8192, dtype="bfloat16", vocab=202048, heads=40, kv_heads=8, head_dim=128,
             shared_experts=1, shared_ffn=8192,
             notes=("text model only (text_config); the vision encoder is not served by expert hosts",)),
    Geometry("deepseek-v2-lite", _hub("deepseek-ai/DeepSeek-V2-Lite"), num_layers=27, moe_layers=26, num_experts=64,
             top_k=6, hidden=2048, expert_ffn=1408, dtype="bfloat16", vocab=102400, heads=16, kv_heads=16, head_dim=128,
             shared_experts=2, shared_ffn=2 * 1408, dense_ffn=10944,
             mla=Mla(kv_lora_rank=512, q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
             notes=("first_k_dense_replace 1: layer 0 has a dense FFN of 10944",)),
    Geometry("qwen3-30b-a3b", _hub("Qwen/Qwen3-30B-A3B"), num_layers=48, moe_layers=48, num_experts=128, top_k=8,
             hidden=2048, expert_ffn=768, dtype="bfloat16", vocab=151936, heads=32, kv_heads=4, head_dim=128,
             qk_norm="head"),
    Geometry("olmoe-1b-7b", _hub("allenai/OLMoE-1B-7B-0924"), num_layers=16, moe_layers=16, num_experts=64, top_k=8,
             hidden=2048, expert_ffn=1024, dtype="bfloat16", vocab=50304, heads=16, kv_heads=16, head_dim=128,
             qk_norm="full"),
    Geometry("deepseek-v3", _hub("deepseek-ai/DeepSeek-V3"), num_layers=61, moe_layers=58, num_experts=256, top_k=8,
             hidden=7168, expert_ffn=2048, dtype="float8", vocab=129280, heads=128, kv_heads=128, head_dim=128,
             shared_experts=1, shared_ffn=2048, dense_ffn=18432, router_bias=True,
             mla=Mla(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
             notes=("first_k_dense_replace 3: layers 0-2 have a dense FFN of 18432",
                    "weights as published: FP8 (e4m3) with 128 x 128 block scales, the scales not counted",
                    "the multi-token-prediction module (num_nextn_predict_layers 1) is not served")),
    Geometry("qwen3-235b-a22b", _hub("Qwen/Qwen3-235B-A22B"), num_layers=94, moe_layers=94, num_experts=128, top_k=8,
             hidden=4096, expert_ffn=1536, dtype="bfloat16", vocab=151936, heads=64, kv_heads=4, head_dim=128,
             qk_norm="head"),
)}

# Published parameter counts (total, active) and where: the test checks the formula against them.
PUBLISHED: dict[str, tuple[float, float, str]] = {
    "mixtral-8x7b": (46.7e9, 12.9e9, "https://mistral.ai/news/mixtral-of-experts"),
    "phi-3.5-moe": (41.9e9, 6.6e9, "https://huggingface.co/microsoft/Phi-3.5-MoE-instruct"),
    "llama-4-scout": (109e9, 17e9, "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E (total includes the vision encoder)"),
    "deepseek-v2-lite": (15.7e9, 2.4e9, "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite"),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, "https://huggingface.co/Qwen/Qwen3-30B-A3B"),
    "olmoe-1b-7b": (6.9e9, 1.3e9, "https://arxiv.org/abs/2409.02060"),
    "deepseek-v3": (671e9, 37e9, "https://arxiv.org/abs/2412.19437"),
    "qwen3-235b-a22b": (235e9, 22e9, "https://huggingface.co/Qwen/Qwen3-235B-A22B"),
}

# SmolLM2-135M's config (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json).
SMOLLM2 = {"num_hidden_layers": 30, "vocab_size": 49152, "num_attention_heads": 9, "num_key_value_heads": 3}


def default_geometry(num_experts: int | None = None, top_k: int | None = None) -> Geometry:
    """The default model (model/shape.py): SmolLM2-135M's FFNs MoEfied into a shared expert and E
    routed experts, float32 as the expert hosts run it; (E, k) as rebuilt with other values."""
    experts, k = num_experts or DEFAULT_EXPERTS, top_k or DEFAULT_TOP_K
    heads = SMOLLM2["num_attention_heads"]
    return Geometry("default", "model/shape.py (SmolLM2-135M-Instruct MoEfied)", num_layers=SMOLLM2["num_hidden_layers"],
                    moe_layers=SMOLLM2["num_hidden_layers"], num_experts=experts, top_k=k, hidden=SOURCE_HIDDEN,
                    expert_ffn=(SOURCE_FFN - DEFAULT_SHARED) // experts, dtype="float32", vocab=SMOLLM2["vocab_size"],
                    heads=heads, kv_heads=SMOLLM2["num_key_value_heads"], head_dim=SOURCE_HIDDEN // heads,
                    shared_experts=1, shared_ffn=DEFAULT_SHARED, tied_embeddings=True)


def known_geometries() -> list[str]:
    return ["default", *GEOMETRIES]


def load_geometry(name_or_path: str | Path) -> Geometry:
    """A geometry from a path to a HF config.json (or its folder), else by name (case-insensitive:
    "Mixtral-8x7B") or "default"."""
    text = str(name_or_path)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.exists() or path.suffix == ".json":  # a path wins over a name
        return parse_hf_config(path)
    key = text.lower()
    if key == "default":
        return default_geometry()
    if key in GEOMETRIES:
        return GEOMETRIES[key]
    raise GeometryError(f"unknown model {text!r}: give one of {', '.join(known_geometries())} or a HF config.json path")


def parse_hf_config(path: str | Path, name: str | None = None) -> Geometry:
    """A geometry from a HF config.json file (see `geometry_from_config`)."""
    path = Path(path)
    doc = read_json(path, GeometryError, "no such config.json")
    return geometry_from_config(doc, name or path.parent.name or path.stem, str(path))


def _first(doc: dict, keys: tuple[str, ...], where: str, default=None):
    for key in keys:
        if doc.get(key) is not None:
            return doc[key]
    if default is not None:
        return default
    raise GeometryError(f"{where}: config.json lacks {' / '.join(keys)}")


def geometry_from_config(doc: dict, name: str, source: str) -> Geometry:
    """A geometry from a config.json's mapping: the common keys of the mixtral, phimoe, llama4
    (its text_config), deepseek_v2/v3, qwen2_moe/qwen3_moe and olmoe families."""
    if not isinstance(doc, dict):
        raise GeometryError(f"{source}: a config.json is a JSON object")
    if isinstance(doc.get("text_config"), dict):  # multimodal (Llama 4): the text model serves the experts
        doc = {**{k: v for k, v in doc.items() if k != "text_config"}, **doc["text_config"]}
    kind = str(doc.get("model_type", ""))
    layers = int(_first(doc, ("num_hidden_layers", "n_layers"), source))
    hidden = int(_first(doc, ("hidden_size", "d_model"), source))
    experts = int(_first(doc, ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts"), source))
    heads = int(_first(doc, ("num_attention_heads",), source))
    dense_ffn = int(_first(doc, ("intermediate_size",), source, 0))
    expert_ffn = int(_first(doc, ("moe_intermediate_size",), source, dense_ffn))
    if not expert_ffn:
        raise GeometryError(f"{source}: config.json lacks moe_intermediate_size / intermediate_size")
    # 1. Which layers are MoE: DeepSeek's first_k_dense_replace, Qwen's decoder_sparse_step and
    #    mlp_only_layers, Llama 4's interleave_moe_layer_step; all others: every layer.
    step = int(doc.get("moe_layer_freq") or doc.get("decoder_sparse_step") or doc.get("interleave_moe_layer_step") or 1)
    first_dense = int(doc.get("first_k_dense_replace") or 0)
    dense_only = set(doc.get("mlp_only_layers") or [])
    moe = [i for i in range(layers) if i >= first_dense and i not in dense_only and (i + 1) % step == 0]
    if "deepseek" in kind:
        moe = [i for i in range(layers) if i >= first_dense and i % step == 0]
    if isinstance(doc.get("moe_layers"), list):
        moe = doc["moe_layers"]
    # 2. Shared experts: DeepSeek's n_shared_experts of moe_intermediate_size, Qwen2-MoE's one of
    #    shared_expert_intermediate_size, Llama 4's one of intermediate_size; dense layers' FFN.
    shared_count = int(doc.get("n_shared_experts") or 0)
    shared_ffn = shared_count * expert_ffn
    if doc.get("shared_expert_intermediate_size"):
        shared_count, shared_ffn = 1, int(doc["shared_expert_intermediate_size"])
    if kind.startswith("llama4"):
        shared_count, shared_ffn, dense_ffn = 1, expert_ffn, int(doc.get("intermediate_size_mlp") or dense_ffn)
    mla = None
    if doc.get("kv_lora_rank"):
        mla = Mla(int(doc["kv_lora_rank"]), int(doc.get("q_lora_rank") or 0), int(doc["qk_nope_head_dim"]),
                  int(doc["qk_rope_head_dim"]), int(doc["v_head_dim"]))
    dtype = str(doc.get("torch_dtype") or doc.get("dtype") or "bfloat16")
    dtype = "float8" if dtype.startswith("float8") else dtype  # float8_e4m3fn and kin: one byte
    return Geometry(
        name, source, num_layers=layers, moe_layers=len(moe), num_experts=experts,
        top_k=int(_first(doc, ("num_experts_per_tok", "moe_top_k", "top_k"), source)), hidden=hidden,
        expert_ffn=expert_ffn, dtype=dtype if dtype in DTYPE_BYTES else "bfloat16", vocab=int(_first(doc, ("vocab_size",), source)),
        heads=heads, kv_heads=int(doc.get("num_key_value_heads") or heads),
        head_dim=int(doc.get("head_dim") or hidden // heads), shared_experts=shared_count, shared_ffn=shared_ffn,
        dense_ffn=dense_ffn, tied_embeddings=bool(doc.get("tie_word_embeddings", False)),
        attention_bias=bool(doc.get("attention_bias", False) or doc.get("qkv_bias", False)),
        qk_norm="head" if kind.startswith("qwen3") else "full" if kind == "olmoe" else "none",
        norm="layer" if kind == "phimoe" else "rms", lm_head_bias=bool(doc.get("lm_head_bias", False)),
        router_bias="deepseek_v3" in kind, shared_expert_gate=kind == "qwen2_moe", mla=mla)

