/* Writing a tokenizer for Hugging Face: tokenizer.json + tokenizer_config.json that
 * transformers' AutoTokenizer and tokenizers' Tokenizer.from_file load and encode to
 * anneal's ids. A tokenizer that came from a tokenizer.json is written back as it was
 * read (anneal validated it and runs it exactly); one from GPT-2's files or anneal's
 * trainer gets a generated tokenizer.json (anneal_bpe_tokenizer_json). */
#include "tokenizer_impl.h"

#include "anneal/fs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

/* Writes n bytes to dir/name atomically. */
static anneal_status put_file(const char *dir, const char *name, const char *data, size_t n) {
    size_t pn = strlen(dir) + strlen(name) + 2;
    char *path = malloc(pn);
    if (!path) return anneal_set_error(ANNEAL_ERR_OOM, "save tokenizer: out of memory");
    snprintf(path, pn, "%s/%s", dir, name);
    anneal_status s = anneal_write_file_atomic(path, data ? data : "", n);
    free(path);
    return s;
}

/* Appends "key": "token text" (or null) for token id. */
static anneal_status put_token_field(anneal_strbuf *b, const anneal_tokenizer *t, const char *key, int32_t id) {
    anneal_status s = anneal_strbuf_printf(b, ",\n  \"%s\": ", key);
    if (s) return s;
    if (id < 0) return anneal_strbuf_puts(b, "null");
    size_t n;
    const char *p = tok_bytes(t, id, &n);
    return anneal_strbuf_json_string(b, p, n);
}

/* The tokenizer_config.json anneal writes when it has none to give back: a
 * PreTrainedTokenizerFast (it runs tokenizer.json as it is) with BOS/EOS, no
 * clean-up of spaces on decoding (anneal does none), and the chat template. */
static anneal_status make_config(const anneal_tokenizer *t, anneal_strbuf *b) {
    int32_t bos = t->bos, eos = t->eos >= 0 ? t->eos : t->eot;
    if (bos < 0 && t->kind == TOK_BYTE_LEVEL) bos = t->eot; /* GPT-2: <|endoftext|> is both */
    anneal_status s = anneal_strbuf_puts(b, "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n"
                                            "  \"clean_up_tokenization_spaces\": false");
    if (!s) s = put_token_field(b, t, "bos_token", bos);
    if (!s) s = put_token_field(b, t, "eos_token", eos);
    if (!s) s = put_token_field(b, t, "unk_token", t->kind == TOK_SENTENCEPIECE ? t->sp.unk : -1);
    if (!s) s = anneal_strbuf_printf(b, ",\n  \"add_bos_token\": %s,\n  \"add_eos_token\": %s",
                                     t->add_bos ? "true" : "false", t->add_eos ? "true" : "false");
    if (!s && t->chat_template) {
        s = anneal_strbuf_puts(b, ",\n  \"chat_template\": ");
        if (!s) s = anneal_strbuf_json_string(b, t->chat_template, strlen(t->chat_template));
    }
    if (!s) s = anneal_strbuf_puts(b, "\n}\n");
    return s;
}

anneal_status anneal_tokenizer_save_hf(const anneal_tokenizer *tok, const char *dir) {
    if (!tok || !dir || !*dir) return anneal_set_error(ANNEAL_ERR_ARG, "save tokenizer: NULL tokenizer or directory");
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create directory: %s", dir, strerror(errno));
    anneal_strbuf b = {0};
    anneal_status s = ANNEAL_OK;
    if (tok->hf_json) {
        s = put_file(dir, "tokenizer.json", tok->hf_json, tok->hf_json_len);
    } else {
        anneal_bpe_tables tables;
        s = anneal_tokenizer_tables(tok, &tables);
        if (!s) s = anneal_bpe_tokenizer_json(&tables, &b);
        anneal_bpe_tables_release(&tables);
        if (!s) s = put_file(dir, "tokenizer.json", b.data, b.len);
    }
    if (!s && tok->hf_config) {
        s = put_file(dir, "tokenizer_config.json", tok->hf_config, tok->hf_config_len);
    } else if (!s) {
        b.len = 0;
        s = make_config(tok, &b);
        if (!s) s = put_file(dir, "tokenizer_config.json", b.data, b.len);
    }
    anneal_strbuf_free(&b);
    return s;
}
