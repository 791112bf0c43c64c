"""A tiny random-weight Llama-style model on disk, made locally (no download, no tokenizer)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from kvactors.errors import InvalidSettingError

if TYPE_CHECKING:
    from pathlib import Path

__all__ = (
    "TINY_LLAMA",
    "TINY_MLA",
    "kv_bytes_per_token",
    "make_model",
    "make_tiny_llama",
    "make_tiny_mla",
)

TINY_LLAMA: dict[str, int | float] = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
}
"""The model's shape: 2 layers, 4 heads, 2 KV heads of 32 (vLLM CPU: 2 KV planes fused)."""


def make_tiny_llama(directory: Path, *, seed: int = 0, max_positions: int = 1024) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a random fp32 Llama to ``directory``.

    Weights are Gaussian, scaled so that the logits are peaked (the top two tokens rarely
    tie), deterministic for ``seed``. Returns ``directory``.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    c = TINY_LLAMA
    hidden, inter = int(c["hidden_size"]), int(c["intermediate_size"])
    heads, kv_heads, hd = (
        int(c["num_attention_heads"]),
        int(c["num_key_value_heads"]),
        int(c["head_dim"]),
    )
    vocab, n_layers = int(c["vocab_size"]), int(c["num_hidden_layers"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **c,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    gen = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        out: torch.Tensor = torch.randn(rows, cols, generator=gen) * (scale / cols**0.5)
        return out

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * hd, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = w(vocab, hidden, scale=4.0)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


TINY_MLA: dict[str, int | float] = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
}
"""A DeepSeek-V2-style model with MLA: one latent of 512 + 64 per token and layer (format 3).
vLLM's CPU MLA backend needs that latent width (576); every layer has a dense MLP."""


def make_tiny_mla(directory: Path, *, seed: int = 0, max_positions: int = 1024) -> Path:
    """Write a random fp32 DeepSeek-V2-style (MLA) model to ``directory``; returns it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    c = {k: int(v) for k, v in TINY_MLA.items()}
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    rank, nope, rope, v = (
        c["kv_lora_rank"],
        c["qk_nope_head_dim"],
        c["qk_rope_head_dim"],
        c["v_head_dim"],
    )
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **c,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "q_lora_rank": None,
        "rope_scaling": None,
        "attention_bias": False,
        # Routed experts exist in the config only: first_k_dense_replace covers every layer.
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": c["num_hidden_layers"],
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
    }
    gen = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        out: torch.Tensor = torch.randn(rows, cols, generator=gen) * (scale / cols**0.5)
        return out

    tensors = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], hidden, generator=gen)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * (nope + rope), hidden),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(rank + rope, hidden),
            p + "self_attn.kv_a_layernorm.weight": torch.ones(rank),
            p + "self_attn.kv_b_proj.weight": w(heads * (nope + v), rank),
            p + "self_attn.o_proj.weight": w(hidden, heads * v),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = w(c["vocab_size"], hidden, scale=4.0)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def make_model(kind: str, directory: Path, *, seed: int = 0) -> Path:
    """``llama`` (format 12 in vLLM's CPU build) or ``mla`` (format 3)."""
    if kind == "mla":
        return make_tiny_mla(directory, seed=seed)
    if kind == "llama":
        return make_tiny_llama(directory, seed=seed)
    raise InvalidSettingError(f"unknown model kind {kind!r} (llama or mla)", setting="model")


def kv_bytes_per_token(kind: str) -> int:
    """Bytes of KV cache per token over all layers (fp32)."""
    if kind == "mla":
        m = TINY_MLA
        width = int(m["kv_lora_rank"]) + int(m["qk_rope_head_dim"])
        return 4 * int(m["num_hidden_layers"]) * width
    c = TINY_LLAMA
    return 4 * int(c["num_hidden_layers"]) * 2 * int(c["num_key_value_heads"]) * int(c["head_dim"])
