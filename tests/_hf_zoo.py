"""Every causal LM of the installed transformers, built tiny from its config
class with seeded random weights (float32), for the model matrix
(tests/hf/test_hf_models.py) and the support table of docs/hf.md.

``architectures()`` lists the model types of transformers' causal-LM auto
mapping; ``tiny_config(model_type)`` shrinks the config class's defaults (2
layers, hidden 64, vocabulary 128) and switches every attention feature on
at a size that matters for prompts of 40-64 tokens (windows of 16, chunks of
16, sinks of a trained model's size, ALiBi for the families that have it);
``build(model_type)`` is the eager model.  Types that cannot be built from
their config alone are in ``NOT_BUILT`` with the reason.
"""
import dataclasses
import warnings

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 128
PAD = 0
WINDOW = 16        # sliding windows and chunks: shorter than every prompt
CHUNK = 16

# the shrunk sizes, applied to whichever of these fields a config class has
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, shared_expert_intermediate_size=32, n_shared_experts=1,
    d_model=64, decoder_ffn_dim=64, encoder_ffn_dim=64, decoder_attention_heads=4,
    encoder_attention_heads=4, decoder_layers=2, encoder_layers=2, n_layer=2, n_head=4,
    n_embd=64, n_positions=512, ffn_dim=64, n_inner=64, num_layers=2, n_layers=2, n_heads=4,
    num_heads=4, max_seq_len=512, n_ctx=512, rotary_dim=8, dim_head=16, dim_ff=64,
    kv_channels=16, ffn_hidden_size=64, first_k_dense_replace=1,
    # multi-head latent attention (refused, but built to check the refusal)
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    bos_token_id=1, eos_token_id=2, pad_token_id=PAD, initializer_range=0.1,
    # attention features on, at sizes shorter than the prompts
    sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1,
    attention_chunk_size=CHUNK,
    # soft caps that act on a tiny model's scores (a trained model's scores
    # reach its cap of 30-50; these models' stay within a few units)
    attn_logit_softcapping=1.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16,
)

# per model class: extra config fields (on top of TINY)
EXTRA = {
    "FalconForCausalLM": dict(new_decoder_architecture=False, multi_query=True),
    "CpmAntForCausalLM": dict(dim_model=64, prompt_length=4),
    "BltForCausalLM": dict(encoder_hash_byte_group_vocab=64, local_attention_window_len=WINDOW),
    "Dots3NoteForCausalLM": dict(num_key_value_heads=4),
    "Kolibri1_1ForCausalLM": dict(index_num_heads=2, index_topk=8, index_num_local_tokens=4,
                                  index_num_sink_tokens=2, index_pool_size=64,
                                  mlp_only_intermediate_size=64),
    "ZayaForCausalLM": dict(num_experts_per_tok=1, router_hidden_size=16),
    "Gemma3nForCausalLM": dict(num_hidden_layers=4, num_kv_shared_layers=2,
                               vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                               laurel_rank=8, altup_num_inputs=2,
                               intermediate_size=[64] * 4, activation_sparsity_pattern=[0.0] * 4),
    "Gemma4AssistantForCausalLM": dict(hidden_size_per_layer_input=0),
    "ReformerModelWithLMHead": dict(is_decoder=True, axial_pos_shape=(16, 32),
                                    axial_pos_embds_dim=(16, 48), attention_head_size=16,
                                    feed_forward_size=64),
    "GPTNeoForCausalLM": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "DbrxForCausalLM": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "MptForCausalLM": dict(use_cache=True),
    "CohereCompassForCausalLM": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={k: dict(rope_type="default", rope_theta=10000.0)
                         for k in ("sliding_attention", "full_attention")}),
    "Phi4MultimodalForCausalLM": dict(
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, crop_size=28),
        audio_config=dict(hidden_size=32, intermediate_size=32, num_blocks=1,
                          num_attention_heads=2, ext_pw_out_channel=32,
                          depthwise_separable_out_channel=32, nemo_conv_channels=32)),
    "DoryForCausalLM": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1,
                            n_output_layers=1, n_recurrent_loops=2),
}

# architectures that cannot be built tiny from their config alone: why
NOT_BUILT = {
    "FuyuForCausalLM": "a vision-native decoder (image patches are part of its input)",
    "Gemma4AssistantForCausalLM": "a drafter that reads its target model's hidden states",
    "Gemma4UnifiedAssistantForCausalLM": "a drafter that reads its target model's hidden "
                                         "states",
    "MusicgenForCausalLM": "audio codebooks (input_ids of num_codebooks rows per sample)",
    "MusicgenMelodyForCausalLM": "audio codebooks (input_ids of num_codebooks rows per sample)",
}

# what is not a decoder-only causal LM of its own (listed, not run)
MULTIMODAL = "multimodal ...ForConditionalGeneration (a vision or audio tower)"


# a feature a family switches on in its config, run as an architecture of
# its own: name -> (class name, config fields)
VARIANTS = {
    "FalconForCausalLM (alibi=True)": ("FalconForCausalLM", dict(alibi=True)),
}


def architectures():
    """``{class name: [model types]}`` of transformers' causal-LM auto
    mapping (several types may share a class) and the VARIANTS, sorted."""
    out = {}
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        out.setdefault(name, []).append(model_type)
    for variant, (name, _) in VARIANTS.items():
        out[variant] = out[name]
    return dict(sorted(out.items()))


def model_class(name):
    return getattr(transformers, VARIANTS.get(name, (name,))[0])


def _fields(cls):
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls().to_dict())


def tiny_config(name, **overrides):
    """The config class of model class ``name`` with TINY's sizes (for the
    fields it has), ``EXTRA[name]`` and ``overrides``."""
    cls = model_class(name).config_class
    fields = _fields(cls)
    kw = {k: v for k, v in TINY.items() if k in fields}
    base, variant = VARIANTS.get(name, (name, {}))
    kw.update(EXTRA.get(base, {}))
    kw.update(variant)
    kw.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**kw)


def config_or_default(name):
    """``tiny_config(name)``, or the config class's defaults when the tiny
    sizes do not validate (enough to check a refusal), or None."""
    for make in (lambda: tiny_config(name), lambda: model_class(name).config_class()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return make()
        except Exception:
            continue
    return None


def build(name, seed=0, **overrides):
    """The tiny model of ``model_type``: float32, eval, eager attention,
    weights from ``seed`` (the caller's RNG is left as it was); attention
    sinks are set to a trained model's scale (normal, mean 1, std 1)."""
    config = tiny_config(name, **overrides)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = model_class(name)(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks") or name.endswith("s_aux"):
                    p.normal_(1.0, 1.0)
    model.to(torch.float32).eval()
    if hasattr(model, "set_default_language"):       # X-MOD's language adapters
        model.set_default_language(config.languages[0])
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None     # every call runs max_new_tokens
    model.generation_config.pad_token_id = PAD
    return model


def prompts(lengths=(56, 41), seed=1, vocab=VOCAB, pad=PAD):
    """Left-padded ``(input_ids, attention_mask)`` of random tokens (ids
    3..vocab-1; ``pad`` in the padding)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def count_operators(monkeypatch):
    """The layers of each run of the compiled route's attention operator
    (``kvcore::attend``, kvcore/hf/compiled.py), in order, as a list that
    grows while the test runs."""
    import kvcore.hf.compiled

    layers = []
    real = kvcore.hf.compiled.current

    def counted(cache_id, layer):
        layers.append(layer)
        return real(cache_id, layer)
    monkeypatch.setattr(kvcore.hf.compiled, "current", counted)
    return layers


if __name__ == "__main__":     # a survey: which types build
    import sys
    import time
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    for mt in sys.argv[1:] or architectures():
        if mt.endswith("ForConditionalGeneration"):
            continue
        t = time.time()
        try:
            m = build(mt)
            n = sum(p.numel() for p in m.parameters())
            print(f"{mt:28s} built {n:8d} params {time.time() - t:.2f}s", flush=True)
        except Exception as e:
            print(f"{mt:28s} FAIL {type(e).__name__}: {str(e)[:160]!r}", flush=True)
