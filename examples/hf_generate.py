"""Prefix reuse across requests with Hugging Face transformers and kvcore.

Runs as is (no download): a tiny Llama with random weights stands in for
your model.  With a real one, replace the model and the token ids:

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvcore")
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids

Each request's prefix that an earlier request already computed (a shared
system prompt, or an earlier answer the user follows up on) is read from the
pool instead of being computed again; pool.stats() shows the hits.
"""
import torch
import transformers

import kvcore.hf  # registers attn_implementation="kvcore"

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=2048)
model = transformers.LlamaForCausalLM(config).eval()
model.set_attn_implementation("kvcore")     # attention reads the pages directly

# one pool for every request: 512 blocks of 16 positions, float16 storage
pool = kvcore.hf.pool_for(model.config, num_blocks=512, dtype="float16", block_size=16)

system = torch.randint(3, 1000, (1, 300))            # a shared 300-token system prompt
requests = [torch.cat([system, torch.randint(3, 1000, (1, 20))], dim=1) for _ in range(3)]

for i, input_ids in enumerate(requests, 1):
    before = pool.stats()["prefix_hits"]
    out = kvcore.hf.generate(model, input_ids, pool, max_new_tokens=20, do_sample=False,
                             pad_token_id=0)
    hits = pool.stats()["prefix_hits"] - before
    print(f"request {i}: {input_ids.shape[1]} prompt tokens, "
          f"{out.shape[1] - input_ids.shape[1]} generated, prefix_hits {hits}")

# a follow-up on the last answer reuses that request's prompt and generated tokens
follow_up = torch.cat([out, torch.randint(3, 1000, (1, 10))], dim=1)
before = pool.stats()["prefix_hits"]
kvcore.hf.generate(model, follow_up, pool, max_new_tokens=10, do_sample=False, pad_token_id=0)
print(f"follow-up: {follow_up.shape[1]} prompt tokens, "
      f"prefix_hits {pool.stats()['prefix_hits'] - before}")
print("pool:", {k: v for k, v in pool.stats().items()
                if k in ("num_blocks", "num_cached_blocks", "prefix_queries", "prefix_hits")})
