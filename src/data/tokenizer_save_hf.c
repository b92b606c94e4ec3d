/* Writing a tokenizer for Hugging Face: tokenizer.json + tokenizer_config.json that
 * transformers' AutoTokenizer and tokenizers' Tokenizer.from_file load and encode to
 * anneal's ids. A tokenizer that came from a tokenizer.json is written back as it was
 * read (anneal validated it and runs it exactly), with the special_tokens_map.json and
 * tokenizer.model that were beside it; one from GPT-2's files or anneal's trainer gets a
 * generated tokenizer.json (anneal_bpe_tokenizer_json). */
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

/* Copies src_dir/name to dir/name (atomically) if it exists and the two directories
 * differ: files of the original model directory that transformers may read besides. */
static anneal_status copy_beside(const char *src_dir, const char *dir, const char *name) {
    char src[4096];
    if (snprintf(src, sizeof src, "%s/%s", src_dir, name) >= (int)sizeof src) return ANNEAL_OK;
    struct stat a, b;
    if (stat(src, &a) != 0 || !S_ISREG(a.st_mode)) return ANNEAL_OK;
    if (stat(src_dir, &a) == 0 && stat(dir, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return ANNEAL_OK;
    char *buf;
    size_t n;
    anneal_status s = anneal_tok_read_file(src, &buf, &n);
    if (s) return s;
    s = put_file(dir, name, buf, n);
    free(buf);
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
    if (!s && tok->hf_dir) s = copy_beside(tok->hf_dir, dir, "special_tokens_map.json");
    if (!s && tok->hf_dir) s = copy_beside(tok->hf_dir, dir, "tokenizer.model");
    anneal_strbuf_free(&b);
    return s;
}
