/* GPT-2 in GGUF: the tensor names and layouts llama.cpp's convert_hf_to_gguf.py
 * (GPT2Model) writes for general.architecture "gpt2". The Conv1D weights (in, out) are
 * stored transposed, (out, in); the lm head is tied, and the converter writes it as a
 * copy of the token embedding under output.weight. Hyperparameters: context_length,
 * embedding_length, block_count, feed_forward_length, attention.head_count,
 * attention.layer_norm_epsilon. */
#include "models_internal.h"

static const anneal_gguf_name gpt2_names[] = {
    {"transformer.wte.weight", "token_embd.weight", ANNEAL_GGUF_SAME},
    {"transformer.wpe.weight", "position_embd.weight", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.ln_1.weight", "blk.%d.attn_norm.weight", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.ln_1.bias", "blk.%d.attn_norm.bias", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.attn.c_attn.weight", "blk.%d.attn_qkv.weight", ANNEAL_GGUF_TRANSPOSED},
    {"transformer.h.%d.attn.c_attn.bias", "blk.%d.attn_qkv.bias", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.attn.c_proj.weight", "blk.%d.attn_output.weight", ANNEAL_GGUF_TRANSPOSED},
    {"transformer.h.%d.attn.c_proj.bias", "blk.%d.attn_output.bias", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.ln_2.weight", "blk.%d.ffn_norm.weight", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.ln_2.bias", "blk.%d.ffn_norm.bias", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.mlp.c_fc.weight", "blk.%d.ffn_up.weight", ANNEAL_GGUF_TRANSPOSED},
    {"transformer.h.%d.mlp.c_fc.bias", "blk.%d.ffn_up.bias", ANNEAL_GGUF_SAME},
    {"transformer.h.%d.mlp.c_proj.weight", "blk.%d.ffn_down.weight", ANNEAL_GGUF_TRANSPOSED},
    {"transformer.h.%d.mlp.c_proj.bias", "blk.%d.ffn_down.bias", ANNEAL_GGUF_SAME},
    {"transformer.ln_f.weight", "output_norm.weight", ANNEAL_GGUF_SAME},
    {"transformer.ln_f.bias", "output_norm.bias", ANNEAL_GGUF_SAME},
    {"lm_head.weight", "output.weight", ANNEAL_GGUF_SAME},
    {NULL, NULL, ANNEAL_GGUF_SAME},
};

const anneal_gguf_arch anneal_gpt2_gguf = {
    .name = "gpt2",
    .rms_norm = false,
    .rope = false,
    .output_copy = true,
    .names = gpt2_names,
    .check = NULL,
};
