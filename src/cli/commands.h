/* Entry points of the anneal subcommands: each takes the arguments after its name
 * and returns the process exit code (0 ok, 1 failure, 2 usage error). */
#ifndef ANNEAL_CLI_COMMANDS_H
#define ANNEAL_CLI_COMMANDS_H

#include "anneal/core.h"

int anneal_cmd_train(int argc, char **argv);
int anneal_cmd_info(int argc, char **argv);
int anneal_cmd_tokenize(int argc, char **argv);      /* cmd_tokenize.c */
int anneal_cmd_tokenizer(int argc, char **argv);     /* cmd_tokenizer.c: "tokenizer train" */
int anneal_cmd_prepare(int argc, char **argv);       /* cmd_prepare.c */
int anneal_cmd_inspect(int argc, char **argv);       /* cmd_inspect.c */
int anneal_cmd_generate(int argc, char **argv);      /* cmd_generate.c */
int anneal_cmd_eval(int argc, char **argv);          /* cmd_eval.c */
int anneal_cmd_bench(int argc, char **argv);         /* cmd_bench.c: "bench peak" */
int anneal_cmd_export(int argc, char **argv);        /* cmd_export.c */
int anneal_cmd_lora(int argc, char **argv);          /* cmd_lora.c: "lora merge" */
int anneal_cmd_plot(int argc, char **argv);          /* cmd_plot.c */
int anneal_cmd_report(int argc, char **argv);        /* cmd_report.c */
int anneal_cmd_serve(int argc, char **argv);         /* cmd_serve.c */
int anneal_cmd_quantize(int argc, char **argv);      /* cmd_quantize.c */

struct anneal_model;
struct anneal_train_state;
/* cmd_generate.c, shared with eval: loads the checkpoint a --ckpt argument names (a
 * checkpoint or run directory; any registered architecture) into a new model, its
 * state and the run's config text (malloc'd, may be NULL). Prints the error naming
 * --ckpt and returns 1 on failure. */
int anneal_cli_load_checkpoint(const char *cmd, const char *arg, struct anneal_model **model,
                               struct anneal_train_state *st, char **config_json);
/* The same with the model on device dev (checkpoints are the same files on every device). */
int anneal_cli_load_checkpoint_on(const char *cmd, const char *arg, anneal_device dev, struct anneal_model **model,
                                  struct anneal_train_state *st, char **config_json);
/* cmd_generate.c, shared with eval: --device (cpu, cuda, cuda:N; anneal_train_device_resolve,
 * the one reader of the flag) into *out, the GPU chosen for cuda:N. Prints "anneal CMD: "
 * and the reason (not a device name, this build has no CUDA backend, no GPU) and
 * returns 2 when the device cannot be used, else 0. */
int anneal_cli_parse_device(const char *cmd, const char *name, anneal_device *out);
/* cmd_generate.c, shared with eval: --dtype fp32|bf16|fp16 (anneal_train_dtype_parse)
 * into *out. Prints the error and returns 2 for another name, else 0. */
int anneal_cli_parse_dtype(const char *cmd, const char *name, anneal_dtype *out);
/* --kv-dtype: f32, bf16 or int8 (anneal_dtype_parse's spellings) into *out; 0, or 2 after
 * printing the error for command cmd. */
int anneal_cli_parse_kv_dtype(const char *cmd, const char *name, anneal_dtype *out);
/* cmd_generate.c, shared with serve and bench decode: at bf16 compute on the CPU, m's
 * dense weights packed as bf16 panels and their f32 values released
 * (anneal_params_pack_bf16: half the weights' memory; the decode engine reads the panels
 * it would otherwise have copied, so the same bits). 0, or 1 after printing the error. */
int anneal_cli_pack_bf16(const char *cmd, struct anneal_model *m);
/* Bytes of a KV cache of m for slots x max_len positions stored as kv_dtype (int8: with
 * its scales), as anneal_kv_cache_bytes reports for such a cache. */
int64_t anneal_cli_kv_cache_bytes(const struct anneal_model *m, int64_t slots, int64_t max_len, anneal_dtype kv_dtype);

/* cmd_bench_decode.c: anneal bench decode (argv after "decode"). */
int anneal_cmd_bench_decode(int argc, char **argv);

/* model_arg.c: the model a --model (or --ckpt) argument names: a checkpoint or run
 * directory, a Hugging Face model directory or weights file (config.json beside it),
 * or a preset (random weights). *st and *config_json are a checkpoint's (zero / NULL
 * otherwise); *tokenizer_path (malloc'd, may be NULL; tokenizer_path may be NULL) is the
 * model's directory when a tokenizer.json sits there (anneal_tokenizer_load reads it with
 * its tokenizer_config.json). Prints the error naming --flag; returns 0,
 * 1 (failure) or 2 (usage). */
int anneal_cli_load_model(const char *cmd, const char *flag, const char *arg, struct anneal_model **model,
                          struct anneal_train_state *st, char **config_json, char **tokenizer_path);
/* The same with the model on device dev. */
int anneal_cli_load_model_on(const char *cmd, const char *flag, const char *arg, anneal_device dev,
                             struct anneal_model **model, struct anneal_train_state *st, char **config_json,
                             char **tokenizer_path);
/* model_arg.c: anneal_tokenizer_load, or the tokenizer inside a .gguf file (an
 * anneal_status; *tok set on success). */
struct anneal_tokenizer;
int anneal_cli_tokenizer_load(const char *spec, struct anneal_tokenizer **tok);
/* model_tokenizer.c: the tokenizer of a model cmd loaded: tok_spec (--tokenizer) when
 * given, else the tokenizer.json of the checkpoint or int8 directory ckpt (may be NULL),
 * else model_tok (anneal_cli_load_model's), else the one its training run used (from
 * config_text, the checkpoint's trainer config, may be NULL); a nonzero fingerprint is
 * checked. Prints the error (naming where the spec came from); returns 0, 1 or 2 (none
 * known, or another tokenizer's fingerprint). */
int anneal_cli_model_tokenizer(const char *cmd, const char *ckpt, const char *tok_spec, const char *model_tok,
                               const char *config_text, uint64_t fingerprint, struct anneal_tokenizer **out);
/* model_tokenizer.c: the tokenizer a training run used, from its trainer config (its
 * --tokenizer, else its data's prepare.json, resolved as anneal_prepare_tokenizer_spec
 * does); malloc'd or NULL. `from` (from_n bytes) says where it came from, for
 * messages ("the training run's --tokenizer", "prepare.json of DIR"). */
struct cJSON;
char *anneal_cli_run_tokenizer(const struct cJSON *config, char *from, size_t from_n);
/* model_tokenizer.c: prints "anneal CMD: --tokenizer SPEC: MSG" for a spec the user gave, else
 * "anneal CMD: tokenizer SPEC (from FROM): MSG", so a message never names a flag the
 * user did not pass. */
void anneal_cli_tokenizer_error(const char *cmd, const char *spec, const char *from, const char *msg);

#endif
