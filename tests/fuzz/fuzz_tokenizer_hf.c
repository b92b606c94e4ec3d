/* Fuzzes Hugging Face tokenizer files (anneal_tokenizer_load_hf): the input is
 * tokenizer.json FUZZ_SEP tokenizer_config.json (absent when there is no separator)
 * FUZZ_SEP a text. A tokenizer that loads encodes and decodes the text, formats a
 * conversation with its chat template when it has one, and is written back out
 * (anneal_tokenizer_save_hf) and loaded again. */
#include "anneal/tokenizer.h"
#include "fuzz/fuzz_util.h"

/* Encodes and decodes text with tok (both with and without special tokens). */
static void exercise(const anneal_tokenizer *tok, const uint8_t *text, size_t n) {
    for (int special = 0; special < 2; special++) {
        anneal_ids ids = {0};
        if (anneal_tokenizer_encode(tok, (const char *)text, n, special == 1, &ids) == ANNEAL_OK) {
            char *back = NULL;
            size_t len = 0;
            if (anneal_tokenizer_decode(tok, ids.ids, ids.n, &back, &len) == ANNEAL_OK) free(back);
        }
        anneal_ids_free(&ids);
        anneal_clear_error();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool made;
    if (!made) {
        char d[600];
        snprintf(d, sizeof d, "%s/tok", fuzz_dir());
        mkdir(d, 0755);
        snprintf(d, sizeof d, "%s/out", fuzz_dir());
        mkdir(d, 0755);
        made = true;
    }
    const uint8_t *part[3];
    size_t len[3];
    int n = fuzz_split(data, size, part, len, 3);
    const char *tj = fuzz_write("tok/tokenizer.json", part[0], len[0]);
    if (n > 1) fuzz_write("tok/tokenizer_config.json", part[1], len[1]);
    else fuzz_unlink("tok/tokenizer_config.json");
    anneal_tokenizer *tok = NULL;
    if (anneal_tokenizer_load_hf(tj, &tok) == ANNEAL_OK) {
        static const uint8_t dflt[] = "Hello world! <|endoftext|> \xe2\x96\x81x \xff";
        if (n > 2) exercise(tok, part[2], len[2]);
        else exercise(tok, dflt, sizeof dflt - 1);
        (void)anneal_tokenizer_bos(tok), (void)anneal_tokenizer_eot(tok), (void)anneal_tokenizer_adds_bos(tok);
        if (anneal_tokenizer_chat_template(tok)) {
            anneal_chat_message msgs[3] = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}};
            char *text = NULL;
            size_t tl = 0;
            if (anneal_chat_format(tok, msgs, 3, true, &text, &tl) == ANNEAL_OK) free(text);
            anneal_clear_error();
        }
        if (anneal_tokenizer_save_hf(tok, fuzz_path("out")) == ANNEAL_OK) {
            anneal_tokenizer *again = NULL;
            if (anneal_tokenizer_load_hf(fuzz_path("out/tokenizer.json"), &again) == ANNEAL_OK) {
                if (anneal_tokenizer_fingerprint(again) != anneal_tokenizer_fingerprint(tok)) abort();
                anneal_tokenizer_free(again);
            } else {
                abort(); /* anneal wrote a tokenizer it cannot read back */
            }
        }
        anneal_tokenizer_free(tok);
    }
    anneal_clear_error();
    return 0;
}
