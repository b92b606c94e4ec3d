/* Chat templates: the common ones of tokenizer_config.json, recognised by their
 * signature and rendered in C exactly as transformers' apply_chat_template(...,
 * tokenize=False) renders their Jinja (tests/data/test_chat_template.c checks each
 * against transformers). anneal runs no Jinja: a template it does not recognise, or a
 * variant with features it does not render (tools, dates), is refused, never guessed.
 *
 *   Llama 3   <|start_header_id|>role<|end_header_id|>\n\n{content | trim}<|eot_id|>,
 *             BOS before the first message
 *   ChatML    <|im_start|>role\n{content}<|im_end|>\n (Qwen2: a default system message
 *             when the conversation has none, taken from the template)
 *   Llama 2   <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>
 *   Mistral   <s>[INST] {user} [/INST]{assistant}</s>   (no system role)
 *   Zephyr    <|role|>\n{content}</s>\n */
#include "tokenizer_impl.h"

#include <stdlib.h>

enum { CHAT_LLAMA3, CHAT_CHATML, CHAT_LLAMA2, CHAT_MISTRAL, CHAT_ZEPHYR };

static bool has(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

/* Which template this is, or -1 (*why says what is wrong). */
static int recognise(const char *tpl, const char **why) {
    *why = NULL;
    if (has(tpl, "tools") || has(tpl, "Cutting Knowledge") || has(tpl, "date_string") || has(tpl, "ipython")) {
        *why = "it uses tools or dates, which anneal does not render";
        return -1;
    }
    if (has(tpl, "<|start_header_id|>") && has(tpl, "<|end_header_id|>") && has(tpl, "<|eot_id|>")) return CHAT_LLAMA3;
    if (has(tpl, "<|im_start|>") && has(tpl, "<|im_end|>")) return CHAT_CHATML;
    if (has(tpl, "[INST]") && has(tpl, "<<SYS>>")) return CHAT_LLAMA2;
    if (has(tpl, "[INST]") && !has(tpl, "system_message") && has(tpl, "raise_exception('Only user and assistant"))
        return CHAT_MISTRAL;
    if (has(tpl, "[INST]")) {
        *why = "an [INST] template that is neither Llama 2's (<<SYS>>) nor Mistral v0.1's";
        return -1;
    }
    if (has(tpl, "<|user|>") && has(tpl, "<|assistant|>")) return CHAT_ZEPHYR;
    *why = "its signature is none of Llama 3 (<|start_header_id|>), ChatML (<|im_start|>), Llama 2 / Mistral "
           "([INST]) or Zephyr (<|user|>)";
    return -1;
}

/* ChatML's default system message: the text of "<|im_start|>system\n...<|im_end|>" that
 * the template emits when the first message is not a system one; NULL if it has none. */
static char *chatml_default_system(const char *tpl) {
    const char *cond = strstr(tpl, "messages[0]['role'] != 'system'");
    if (!cond) return NULL;
    const char *a = strstr(cond, "<|im_start|>system\\n");
    size_t skip = strlen("<|im_start|>system\\n");
    if (!a) {
        a = strstr(cond, "<|im_start|>system\n");
        skip = strlen("<|im_start|>system\n");
    }
    if (!a) return NULL;
    a += skip;
    const char *b = strstr(a, "<|im_end|>");
    if (!b) return NULL;
    char *s = malloc((size_t)(b - a) + 1);
    if (!s) return NULL;
    memcpy(s, a, (size_t)(b - a));
    s[b - a] = 0;
    return s;
}

/* Python's str.strip(): trims whitespace (ASCII, \x1c-\x1f and Unicode spaces). */
static void strip(const char *s, const char **start, size_t *len) {
    static const char *const uni[] = {"\xc2\x85", "\xc2\xa0", "\xe1\x9a\x80", "\xe2\x80\xa8", "\xe2\x80\xa9",
                                      "\xe2\x80\xaf", "\xe2\x81\x9f", "\xe3\x80\x80"};
    size_t n = strlen(s), i = 0;
    for (;;) {
        bool moved = false;
        if (i < n && (strchr(" \t\n\v\f\r\x1c\x1d\x1e\x1f", s[i]) && s[i])) {
            i++;
            moved = true;
        }
        for (size_t k = 0; !moved && k < sizeof uni / sizeof *uni; k++)
            if (n - i >= strlen(uni[k]) && memcmp(s + i, uni[k], strlen(uni[k])) == 0) {
                i += strlen(uni[k]);
                moved = true;
            }
        if (i < n && !moved && (unsigned char)s[i] == 0xE2 && i + 2 < n && (unsigned char)s[i + 1] == 0x80 &&
            (unsigned char)s[i + 2] >= 0x80 && (unsigned char)s[i + 2] <= 0x8A) { /* U+2000..U+200A */
            i += 3;
            moved = true;
        }
        if (!moved) break;
    }
    size_t e = n;
    for (;;) {
        bool moved = false;
        if (e > i && strchr(" \t\n\v\f\r\x1c\x1d\x1e\x1f", s[e - 1]) && s[e - 1]) {
            e--;
            moved = true;
        }
        for (size_t k = 0; !moved && k < sizeof uni / sizeof *uni; k++) {
            size_t l = strlen(uni[k]);
            if (e - i >= l && memcmp(s + e - l, uni[k], l) == 0) {
                e -= l;
                moved = true;
            }
        }
        if (!moved && e - i >= 3 && (unsigned char)s[e - 3] == 0xE2 && (unsigned char)s[e - 2] == 0x80 &&
            (unsigned char)s[e - 1] >= 0x80 && (unsigned char)s[e - 1] <= 0x8A) {
            e -= 3;
            moved = true;
        }
        if (!moved) break;
    }
    *start = s + i;
    *len = e - i;
}

/* The text of token id ("" if none), as transformers passes bos_token / eos_token. */
static anneal_status put_tok(anneal_strbuf *b, const anneal_tokenizer *t, int32_t id) {
    if (id < 0) return ANNEAL_OK;
    size_t n;
    const char *p = tok_bytes(t, id, &n);
    return anneal_strbuf_append(b, p, n);
}

/* Appends s with Python's strip() applied. */
static anneal_status put_stripped(anneal_strbuf *b, const char *s) {
    const char *p;
    size_t n;
    strip(s, &p, &n);
    return anneal_strbuf_append(b, p, n);
}

static const char ALTERNATE[] = "Conversation roles must alternate user/assistant/user/assistant/...";

anneal_status anneal_chat_format(const anneal_tokenizer *tok, const anneal_chat_message *msgs, size_t n,
                                 bool add_generation_prompt, char **text, size_t *len) {
    if (text) *text = NULL;
    if (len) *len = 0;
    if (!tok || !text || (!msgs && n)) return anneal_set_error(ANNEAL_ERR_ARG, "chat: NULL argument");
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return anneal_set_error(ANNEAL_ERR_ARG, "chat: message %zu has no role or no content", i);
    const char *tpl = tok->chat_template;
    if (!tpl)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED,
                                "chat: the tokenizer has no chat_template (tokenizer_config.json has none)");
    const char *why;
    int kind = recognise(tpl, &why);
    if (kind < 0)
        return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "chat: the tokenizer's chat_template is not one anneal knows: %s",
                                why);
    int32_t bos = tok->bos, eos = tok->eos >= 0 ? tok->eos : tok->eot;
    anneal_strbuf b = {0};
    anneal_status s = anneal_strbuf_append(&b, "", 0);
    switch (kind) {
    case CHAT_LLAMA3:
        for (size_t i = 0; i < n && !s; i++) {
            if (i == 0) s = put_tok(&b, tok, bos);
            if (!s) s = anneal_strbuf_printf(&b, "<|start_header_id|>%s<|end_header_id|>\n\n", msgs[i].role);
            if (!s) s = put_stripped(&b, msgs[i].content);
            if (!s) s = anneal_strbuf_puts(&b, "<|eot_id|>");
        }
        if (!s && add_generation_prompt) s = anneal_strbuf_puts(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case CHAT_CHATML: {
        char *sys = chatml_default_system(tpl);
        if (n && strcmp(msgs[0].role, "system") != 0 && sys)
            s = anneal_strbuf_printf(&b, "<|im_start|>system\n%s<|im_end|>\n", sys);
        free(sys);
        for (size_t i = 0; i < n && !s; i++)
            s = anneal_strbuf_printf(&b, "<|im_start|>%s\n%s<|im_end|>\n", msgs[i].role, msgs[i].content);
        if (!s && add_generation_prompt) s = anneal_strbuf_puts(&b, "<|im_start|>assistant\n");
        break;
    }
    case CHAT_LLAMA2: {
        size_t first = n && strcmp(msgs[0].role, "system") == 0 ? 1 : 0;
        for (size_t i = first; i < n && !s; i++) {
            bool user = strcmp(msgs[i].role, "user") == 0;
            if (user != ((i - first) % 2 == 0)) {
                s = anneal_set_error(ANNEAL_ERR_ARG, "chat: %s", ALTERNATE);
                break;
            }
            anneal_strbuf content = {0};
            if (i == first && first)
                s = anneal_strbuf_printf(&content, "<<SYS>>\n%s\n<</SYS>>\n\n%s", msgs[0].content, msgs[i].content);
            else
                s = anneal_strbuf_puts(&content, msgs[i].content);
            if (!s && user) {
                s = put_tok(&b, tok, bos);
                if (!s) s = anneal_strbuf_puts(&b, "[INST] ");
                if (!s) s = put_stripped(&b, content.data ? content.data : "");
                if (!s) s = anneal_strbuf_puts(&b, " [/INST]");
            } else if (!s && strcmp(msgs[i].role, "assistant") == 0) {
                s = anneal_strbuf_puts(&b, " ");
                if (!s) s = put_stripped(&b, content.data ? content.data : "");
                if (!s) s = anneal_strbuf_puts(&b, " ");
                if (!s) s = put_tok(&b, tok, eos);
            }
            anneal_strbuf_free(&content);
        }
        break; /* Llama 2's template has no generation prompt */
    }
    case CHAT_MISTRAL:
        s = put_tok(&b, tok, bos);
        for (size_t i = 0; i < n && !s; i++) {
            bool user = strcmp(msgs[i].role, "user") == 0;
            if (user != (i % 2 == 0)) s = anneal_set_error(ANNEAL_ERR_ARG, "chat: %s", ALTERNATE);
            else if (user) s = anneal_strbuf_printf(&b, "[INST] %s [/INST]", msgs[i].content);
            else if (strcmp(msgs[i].role, "assistant") == 0) {
                s = anneal_strbuf_puts(&b, msgs[i].content);
                if (!s) s = put_tok(&b, tok, eos);
            } else s = anneal_set_error(ANNEAL_ERR_ARG, "chat: Only user and assistant roles are supported!");
        }
        break;
    case CHAT_ZEPHYR:
        for (size_t i = 0; i < n && !s; i++) {
            const char *r = msgs[i].role;
            if (strcmp(r, "user") == 0 || strcmp(r, "system") == 0 || strcmp(r, "assistant") == 0) {
                s = anneal_strbuf_printf(&b, "<|%s|>\n%s", r, msgs[i].content);
                if (!s) s = put_tok(&b, tok, eos);
                if (!s) s = anneal_strbuf_puts(&b, "\n");
            }
            if (!s && i + 1 == n && add_generation_prompt) s = anneal_strbuf_puts(&b, "<|assistant|>\n");
        }
        break;
    }
    if (s) {
        anneal_strbuf_free(&b);
        return s;
    }
    *text = b.data;
    if (len) *len = b.len;
    return ANNEAL_OK;
}
