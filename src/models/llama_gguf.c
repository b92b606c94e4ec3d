/* The Llama family in GGUF: the tensor names and layouts llama.cpp's
 * convert_hf_to_gguf.py (LlamaModel) writes for general.architecture "llama". The
 * q/k projections' rows (weights and biases) are permuted per head from Hugging Face's
 * rotate-half RoPE to ggml's interleaved one; output.weight only when the head is not
 * tied. Hyperparameters: those of every architecture plus attention.head_count_kv,
 * attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count, vocab_size
 * and the linear rope scaling. Qwen2 is llama.cpp's own architecture ("qwen2", no
 * permutation) and llama3 rope scaling needs a rope_freqs tensor: both refused here. */
#include "models_internal.h"

#include <string.h>

static const anneal_gguf_name llama_names[] = {
    {"model.embed_tokens.weight", "token_embd.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.input_layernorm.weight", "blk.%d.attn_norm.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.self_attn.q_proj.weight", "blk.%d.attn_q.weight", ANNEAL_GGUF_PERMUTE_Q},
    {"model.layers.%d.self_attn.q_proj.bias", "blk.%d.attn_q.bias", ANNEAL_GGUF_PERMUTE_Q},
    {"model.layers.%d.self_attn.k_proj.weight", "blk.%d.attn_k.weight", ANNEAL_GGUF_PERMUTE_K},
    {"model.layers.%d.self_attn.k_proj.bias", "blk.%d.attn_k.bias", ANNEAL_GGUF_PERMUTE_K},
    {"model.layers.%d.self_attn.v_proj.weight", "blk.%d.attn_v.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.self_attn.v_proj.bias", "blk.%d.attn_v.bias", ANNEAL_GGUF_SAME},
    {"model.layers.%d.self_attn.o_proj.weight", "blk.%d.attn_output.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.self_attn.o_proj.bias", "blk.%d.attn_output.bias", ANNEAL_GGUF_SAME},
    {"model.layers.%d.post_attention_layernorm.weight", "blk.%d.ffn_norm.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.mlp.gate_proj.weight", "blk.%d.ffn_gate.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.mlp.up_proj.weight", "blk.%d.ffn_up.weight", ANNEAL_GGUF_SAME},
    {"model.layers.%d.mlp.down_proj.weight", "blk.%d.ffn_down.weight", ANNEAL_GGUF_SAME},
    {"model.norm.weight", "output_norm.weight", ANNEAL_GGUF_SAME},
    {"lm_head.weight", "output.weight", ANNEAL_GGUF_SAME},
    {NULL, NULL, ANNEAL_GGUF_SAME},
};

/* Llama and Mistral only, RoPE unscaled or linear. */
static anneal_status llama_gguf_check(const anneal_model_config *c) {
    if (c->hf_model_type[0] && strcmp(c->hf_model_type, "llama") && strcmp(c->hf_model_type, "mistral"))
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "gguf: model_type %s is not written as GGUF (llama and mistral are; qwen2 is llama.cpp's "
                                "architecture \"qwen2\", not done yet)",
                                c->hf_model_type);
    if (c->rope.scaling != ANNEAL_ROPE_SCALING_NONE && c->rope.scaling != ANNEAL_ROPE_SCALING_LINEAR)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "gguf: llama3 rope scaling is not written as GGUF yet (llama.cpp wants a rope_freqs tensor)");
    return ANNEAL_OK;
}

const anneal_gguf_arch anneal_llama_gguf = {
    .name = "llama",
    .rms_norm = true,
    .rope = true,
    .output_copy = false,
    .names = llama_names,
    .check = llama_gguf_check,
};
