"""Tiny random-weight models built locally, for tests, the demo and benches.

No downloads are possible on the machines this project is tested on, so the
models (config, random weights, a WordLevel tokenizer) are written to a
directory and cached there: a second call with the same arguments is a no-op.
The weights are seeded, so every build of a given spec is identical.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB_SIZE = 512


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build. `arch` picks the transformers config family."""

    arch: str  # "llama" | "gemma2" | "gemma3" | "qwen3_next" | "deepseek_v2"
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    sliding_window: int = 96
    dtype: str = "float32"
    seed: int = 0
    extra: tuple[tuple[str, object], ...] = field(default=())

    @property
    def name(self) -> str:
        base = (
            f"{self.arch}-l{self.num_layers}-h{self.hidden_size}-kv{self.num_kv_heads}"
            f"x{self.head_dim}-sw{self.sliding_window}-{self.dtype}-s{self.seed}-v3"
        )
        if not self.extra:
            return base
        # Specs that differ only in their extra config keys get their own name.
        tag = hashlib.sha256(repr(sorted(self.extra)).encode()).hexdigest()[:8]
        return f"{base}-x{tag}"


SPECS = {
    "llama": TinyModelSpec("llama"),
    "gemma2": TinyModelSpec("gemma2", num_layers=4),
    "gemma3": TinyModelSpec("gemma3", num_layers=6),
    "qwen3_next": TinyModelSpec("qwen3_next", num_layers=4, dtype="bfloat16"),
    # A second Qwen3-Next shape: 6 layers, full attention every 3rd (2 of
    # them), twice the GDN value heads (a larger state, so vLLM picks a
    # larger hybrid block size).
    "qwen3_next_b": TinyModelSpec(
        "qwen3_next",
        num_layers=6,
        dtype="bfloat16",
        extra=(("full_attention_interval", 3), ("linear_num_value_heads", 8)),
    ),
    # DeepSeek-V2-like MLA: one 576-wide latent per token (kv_lora_rank 512 +
    # rope 64, the only width vLLM-CPU's MLA backend takes), bf16 (the only
    # MLA dtype there), 3 dense layers. Every tensor-parallel rank holds the
    # whole latent (a replicated cache).
    "deepseek_v2": TinyModelSpec("deepseek_v2", num_layers=3, num_kv_heads=4, dtype="bfloat16", head_dim=64),
}


def _config(spec: TinyModelSpec):
    import transformers as tf

    common: dict[str, object] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=16384,
        # vLLM's Gemma implementations have no separate lm_head.
        tie_word_embeddings=spec.arch in ("gemma2", "gemma3"),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(dict(spec.extra))
    if spec.arch == "llama":
        return tf.LlamaConfig(**common)
    if spec.arch == "gemma2":
        return tf.Gemma2Config(sliding_window=spec.sliding_window, **common)
    if spec.arch == "gemma3":
        return tf.Gemma3TextConfig(
            sliding_window=spec.sliding_window, sliding_window_pattern=6, **common
        )
    if spec.arch == "qwen3_next":
        # By default every 4th layer is full attention, the rest Gated
        # DeltaNet; `extra` may override any of these.
        qwen: dict[str, object] = dict(
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            # vLLM-CPU's chunked GDN kernel rejects head dim 32.
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            full_attention_interval=4,
        )
        for key in list(common):
            if key in qwen:
                qwen[key] = common.pop(key)
        return tf.Qwen3NextConfig(**qwen, **common)
    if spec.arch == "deepseek_v2":
        mla = dict(
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            q_lora_rank=None,  # q_proj straight from the hidden state
            # Dense MLPs only (the first num_layers layers are dense): no
            # expert routing to make outputs depend on the batch or the rank.
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            first_k_dense_replace=spec.num_layers,
            rope_scaling=None,
        )
        common.pop("head_dim")
        common["num_key_value_heads"] = spec.num_kv_heads
        return tf.DeepseekV2Config(**mla, **common)
    raise ValueError(
        f"unknown tiny model arch {spec.arch!r}; valid: llama, gemma2, gemma3, qwen3_next, deepseek_v2"
    )


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))


def default_cache_dir() -> Path:
    return Path(os.environ.get("LMCACHE_ASCEND_MODEL_CACHE", Path.home() / ".cache" / "lmcache-ascend" / "models"))


def build_tiny_model(spec: TinyModelSpec | str, cache_dir: Path | None = None) -> Path:
    """Build (once) and return the directory of a tiny random-weight model."""
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"unknown tiny model {spec!r}; valid: {sorted(SPECS)}")
        spec = SPECS[spec]
    path, marker = _build_dir(cache_dir, spec.name)
    if marker.exists():
        return path
    import torch
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    config = _config(spec)
    config.torch_dtype = spec.dtype
    torch.manual_seed(spec.seed)
    if spec.arch in ("gemma3",):
        model = tf.Gemma3ForCausalLM(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    _save_random(model, spec.dtype, path)
    _tokenizer(path)
    _mark_built(marker, spec)
    return path


def _build_dir(cache_dir: Path | None, name: str) -> tuple[Path, Path]:
    """A model's directory and the marker of its complete build."""
    path = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / name
    return path, path / "lmcache_ascend_spec.json"


def _save_random(model, dtype: str, path: Path) -> None:
    """Re-draw every matrix of ``model`` (from torch's current seed) and save
    it in ``dtype``."""
    import torch

    # Larger-than-default init so random logits are not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(path), safe_serialization=True)


def _mark_built(marker: Path, spec) -> None:
    """Written last, atomically: a directory with it is a complete build."""
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(spec), default=str))
    tmp.rename(marker)


def token_prompt(n_tokens: int, seed: int = 0, prefix: list[int] | None = None) -> list[int]:
    """Deterministic pseudo-random token ids (no special tokens)."""
    import random

    rng = random.Random(seed)
    out = list(prefix or [])
    while len(out) < n_tokens:
        out.append(rng.randrange(4, VOCAB_SIZE))
    return out[:n_tokens]


def build_tiny_lora(model: TinyModelSpec | str, seed: int, rank: int = 8,
                    targets: tuple[str, ...] = ("k_proj", "v_proj"), cache_dir: Path | None = None) -> Path:
    """Build (once) a random LoRA adapter (PEFT's file layout) for a tiny
    model. It targets the K/V projections by default, so it changes the KV
    cache itself: a base request served the adapter's KV gets other logits."""
    if isinstance(model, str):
        model = SPECS[model]
    if model.arch != "llama":
        raise ValueError(f"tiny LoRA adapters are built for llama-shaped models, not {model.arch!r}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / f"lora-{model.name}-r{rank}-{'-'.join(targets)}-s{seed}"
    marker = path / "adapter_config.json"
    if marker.exists():
        return path
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    out_dim = {"q_proj": model.num_heads * model.head_dim, "k_proj": model.num_kv_heads * model.head_dim,
               "v_proj": model.num_kv_heads * model.head_dim, "o_proj": model.hidden_size}
    in_dim = {"o_proj": model.num_heads * model.head_dim}
    tensors = {}
    for layer in range(model.num_layers):
        for t in targets:
            base = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, in_dim.get(t, model.hidden_size), generator=gen) * 0.3
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim[t], rank, generator=gen) * 0.3
    save_file({k: v.to(getattr(torch, model.dtype)).contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": model.name, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(config))
    tmp.rename(marker)
    return path



# ---- a tiny vision-language model -------------------------------------------

# Idefics3's shape (SmolVLM's): a SigLIP-like vision tower, a pixel-shuffle
# connector and a Llama text model, served by vLLM through the Hugging Face
# processor (Idefics3's image processor has a PIL backend: no torchvision,
# which vLLM's LLaVA, Qwen2-VL and Gemma-3 code paths import). Without image
# splitting each "<image>" of a prompt becomes
# <fake_token_around_image><global-img><image>*VLM_IMAGE_TOKENS<fake_token_around_image>,
# one multimodal item of VLM_ITEM_TOKENS positions.
VLM_IMAGE_TOKEN = "<image>"
VLM_SPECIAL_TOKENS = ("<fake_token_around_image>", VLM_IMAGE_TOKEN, "<global-img>", "<end_of_utterance>")
VLM_IMAGE_TOKEN_ID = VOCAB_SIZE + 1  # past every id token_prompt draws
VLM_IMAGE_SIZE = 112
VLM_PATCH_SIZE = 14
VLM_SCALE_FACTOR = 2
VLM_IMAGE_TOKENS = (VLM_IMAGE_SIZE // VLM_PATCH_SIZE) ** 2 // VLM_SCALE_FACTOR**2  # 16
VLM_ITEM_TOKENS = VLM_IMAGE_TOKENS + 3


@dataclass(frozen=True)
class TinyVlmSpec:
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vision_layers: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2  # head dim 32
    dtype: str = "float32"
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"idefics3-l{self.num_layers}-h{self.hidden_size}-kv{self.num_kv_heads}x{self.head_dim}"
            f"-vis{self.vision_layers}x{self.vision_hidden}-i{VLM_IMAGE_SIZE}p{VLM_PATCH_SIZE}"
            f"-{self.dtype}-s{self.seed}-v1"
        )


def _vlm_config(spec: TinyVlmSpec):
    import transformers as tf

    text = tf.LlamaConfig(
        vocab_size=VOCAB_SIZE + len(VLM_SPECIAL_TOKENS),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = tf.Idefics3VisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=2 * spec.vision_hidden,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=VLM_IMAGE_SIZE,
        patch_size=VLM_PATCH_SIZE,
    )
    return tf.Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=VLM_IMAGE_TOKEN_ID,
        scale_factor=VLM_SCALE_FACTOR,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def _vlm_processor(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    for i, t in enumerate(VLM_SPECIAL_TOKENS):
        vocab[t] = VOCAB_SIZE + i
    assert vocab[VLM_IMAGE_TOKEN] == VLM_IMAGE_TOKEN_ID
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": VLM_IMAGE_SIZE},
        max_image_size={"longest_edge": VLM_IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor=images, tokenizer=fast, image_seq_len=VLM_IMAGE_TOKENS)
    processor.save_pretrained(str(path))


def build_tiny_vlm(spec: TinyVlmSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Build (once) and return the directory of a tiny random-weight
    Idefics3: config, weights, tokenizer (with ``VLM_SPECIAL_TOKENS``) and
    processor. Each image becomes one item of ``VLM_ITEM_TOKENS`` prompt
    positions wherever a prompt holds ``VLM_IMAGE_TOKEN_ID``."""
    spec = spec or TinyVlmSpec()
    path, marker = _build_dir(cache_dir, spec.name)
    if marker.exists():
        return path
    import torch
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    config = _vlm_config(spec)
    config.dtype = spec.dtype
    torch.manual_seed(spec.seed)
    model = tf.Idefics3ForConditionalGeneration(config)
    _save_random(model, spec.dtype, path)
    _vlm_processor(path)
    _mark_built(marker, spec)
    return path


def tiny_image(seed: int, size: int = VLM_IMAGE_SIZE):
    """A deterministic RGB PIL image of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), "RGB")
