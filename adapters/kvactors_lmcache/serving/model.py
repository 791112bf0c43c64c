"""A tiny random-weight Llama-style model on disk, made locally (no download, no tokenizer)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ("TINY_LLAMA", "make_tiny_llama")

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
