#pragma once
/* Each subcommand: argv[0] is its name; returns the process exit status
 * (0 ok, 1 runtime error, 2 usage error). */
int cmd_logits(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_convert(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_bench_kv(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_router(int argc, char **argv);
int cmd_mkmodel(int argc, char **argv);
int cmd_plan(int argc, char **argv);
