"""Build a seeded random-weight Llama as an HF directory (config.json + safetensors +
a tokenizer), for speed benchmarks only: random weights say nothing about acceptance.

The default shape is the 1.2B model of issue #10 (hidden 2048, 16 layers, 32 heads,
8 KV heads, intermediate 8192) with SmolLM2's tokenizer and vocabulary (49152):

    python scripts/make_random_llama.py --out /tmp/llama-1.2b --tokenizer embedded:smollm2-135m-instruct

``--tokenizer`` takes any model path specserve loads (embedded:<name>, a .gguf, an HF dir).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="embedded:smollm2-135m-instruct")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--max-positions", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args()

    import torch
    import transformers as tf
    from safetensors.torch import save_file

    from specserve.executor.loader import resolve_hf_dir

    src = resolve_hf_dir(a.tokenizer, None)
    tok = tf.AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    src_cfg = tf.AutoConfig.from_pretrained(str(src), local_files_only=True)
    cfg = tf.LlamaConfig(
        vocab_size=src_cfg.vocab_size, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=src_cfg.bos_token_id, eos_token_id=src_cfg.eos_token_id, rope_theta=500000.0,
    )
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # Build layer by layer in the target dtype (a 1.2B float32 model would need ~5 GB at once).
    std = cfg.initializer_range
    H, I, hd = a.hidden, a.intermediate, a.hidden // a.heads
    tensors = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, H) * std,
        "model.norm.weight": torch.ones(H),
        "lm_head.weight": torch.randn(cfg.vocab_size, H) * std,
    }
    for i in range(a.layers):
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "input_layernorm.weight": torch.ones(H),
            pre + "post_attention_layernorm.weight": torch.ones(H),
            pre + "self_attn.q_proj.weight": torch.randn(a.heads * hd, H) * std,
            pre + "self_attn.k_proj.weight": torch.randn(a.kv_heads * hd, H) * std,
            pre + "self_attn.v_proj.weight": torch.randn(a.kv_heads * hd, H) * std,
            pre + "self_attn.o_proj.weight": torch.randn(H, a.heads * hd) * std,
            pre + "mlp.gate_proj.weight": torch.randn(I, H) * std,
            pre + "mlp.up_proj.weight": torch.randn(I, H) * std,
            pre + "mlp.down_proj.weight": torch.randn(H, I) * std,
        })  # fmt: skip
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    n = sum(t.numel() for t in tensors.values())
    save_file(tensors, str(out / "model.safetensors"))
    cfg.torch_dtype = a.dtype
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}: {n / 1e9:.3f}B parameters ({a.dtype})")


if __name__ == "__main__":
    main()
