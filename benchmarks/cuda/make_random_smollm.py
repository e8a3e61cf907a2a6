"""A random-weight model of the default model's shape (SmolLM2-135M), bfloat16, with the tiny model's tokenizer."""

import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
tok = AutoTokenizer.from_pretrained(sys.argv[2])
cfg = LlamaConfig(
    vocab_size=len(tok),
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out)
tok.save_pretrained(out)
print("saved", out)
