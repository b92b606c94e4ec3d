/* Fuzzes GPT-2's tokenizer files (anneal_tokenizer_load_gpt2): the input is
 * encoder.json FUZZ_SEP vocab.bpe FUZZ_SEP a text. A tokenizer that loads encodes the
 * text (with and without special tokens), decodes the ids back to the same bytes
 * (byte-level BPE round-trips any bytes) and stream-decodes them. */
#include "anneal/tokenizer.h"
#include "fuzz/fuzz_util.h"

/* Encodes, decodes and stream-decodes text with tok; aborts when bytes do not round-trip. */
static void exercise(const anneal_tokenizer *tok, const uint8_t *text, size_t n, bool must_round_trip) {
    for (int special = 0; special < 2; special++) {
        anneal_ids ids = {0};
        if (anneal_tokenizer_encode(tok, (const char *)text, n, special == 1, &ids) == ANNEAL_OK) {
            char *back = NULL;
            size_t len = 0;
            if (anneal_tokenizer_decode(tok, ids.ids, ids.n, &back, &len) == ANNEAL_OK) {
                if (must_round_trip && special == 0 && (len != n || memcmp(back, text, n) != 0)) abort();
                free(back);
            }
            anneal_stream_decoder d;
            anneal_stream_decoder_init(&d, tok);
            for (size_t i = 0; i < ids.n; i++) {
                size_t tl = 0;
                anneal_tokenizer_token_bytes(tok, ids.ids[i], &tl);
                char *out = malloc(64 + tl);
                size_t ol;
                if (!out) abort();
                (void)anneal_stream_decoder_push(&d, ids.ids[i], out, 64 + tl, &ol);
                free(out);
            }
            char tail[64];
            anneal_stream_decoder_flush(&d, tail, sizeof tail);
        }
        anneal_ids_free(&ids);
        anneal_clear_error();
    }
    /* out-of-range ids are errors, not reads */
    int32_t bad[3] = {-1, anneal_tokenizer_vocab_size(tok), 0};
    char *back = NULL;
    size_t len;
    if (anneal_tokenizer_decode(tok, bad, 3, &back, &len) == ANNEAL_OK) abort();
    anneal_clear_error();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[3];
    size_t len[3];
    int n = fuzz_split(data, size, part, len, 3);
    const char *enc = fuzz_write("encoder.json", part[0], len[0]);
    const char *bpe = fuzz_write("vocab.bpe", n > 1 ? part[1] : (const uint8_t *)"", n > 1 ? len[1] : 0);
    anneal_tokenizer *tok = NULL;
    if (anneal_tokenizer_load_gpt2(enc, bpe, &tok) == ANNEAL_OK) {
        if (n > 2) exercise(tok, part[2], len[2], false);
        anneal_tokenizer_free(tok);
    }
    anneal_clear_error();
    return 0;
}
