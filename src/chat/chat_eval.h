/*
 * chat_eval.h - the chat-template evaluator's private state, shared by chat_eval.c
 * (statements, expressions) and chat_builtin.c (filters, tests, methods, globals).
 *
 * Owns: the render context and its error exits.
 * Must not: be included outside src/chat/chat_eval.c and chat_builtin.c.
 */
#ifndef TQKV_CHAT_EVAL_H
#define TQKV_CHAT_EVAL_H

#include <setjmp.h>

#include "chat/chat_internal.h"

#define CHAT_MAX_DEPTH 200       /* macro calls / nested evaluation */
#define CHAT_MAX_RANGE 1000000   /* range() length */
#define CHAT_MAX_STEPS 200000000 /* statements + expression nodes evaluated in one render */

typedef struct chat_frame chat_frame;
struct chat_frame {
    chat_frame *parent;
    chat_dict  *vars;
};

typedef struct {
    chat_arena *a;
    jmp_buf     jb;
    tqkv_status err;
    chat_frame *root;     /* template-level variables */
    int         depth;
    int         loop_ctl; /* 0, 1 = break, 2 = continue pending */
    int64_t     steps;    /* work done so far, bounded by CHAT_MAX_STEPS */
} chat_ev;

/* Error exits: set the thread's message and unwind to the render's entry. */
_Noreturn void chat_ev_fail(chat_ev *E, const chat_node *at, tqkv_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
_Noreturn void chat_ev_oom(chat_ev *E);
/* Fails with an undefined value's message ("'x' is undefined"). */
_Noreturn void chat_ev_undefined(chat_ev *E, const chat_node *at, chat_value u);

/* Checked helpers (fail on OOM). */
void       *chat_ev_alloc(chat_ev *E, size_t n);
chat_value  chat_ev_undef(const char *msg, size_t n);
chat_value  chat_ev_list(chat_ev *E, size_t n);     /* list with n zeroed items */
chat_value  chat_ev_new_dict(chat_ev *E, chat_kind kind);
void        chat_ev_dict_set(chat_ev *E, chat_dict *d, const char *k, size_t kn, chat_value v);
/* str(v) as a string value (undefined -> ""). */
chat_value  chat_ev_to_str(chat_ev *E, chat_value v);
/* The items a for loop / filter iterates: list items, dict keys, string characters. */
chat_value  chat_ev_iterable(chat_ev *E, const chat_node *at, chat_value v);
/* Attribute / item lookup as Jinja's getattr / getitem. */
chat_value  chat_ev_getattr(chat_ev *E, const chat_node *at, chat_value obj, const char *name, size_t n);

/* Builtins (chat_builtin.c). args[n_args] positional, kw[n_kw] with names. */
chat_value chat_ev_filter(chat_ev *E, const chat_node *at, const char *name, size_t name_n, chat_value v,
                          const chat_value *args, int n_args, const char *const *kwn, const size_t *kwl,
                          const chat_value *kw, int n_kw);
int        chat_ev_test(chat_ev *E, const chat_node *at, const char *name, size_t name_n, chat_value v,
                        const chat_value *args, int n_args);
chat_value chat_ev_method(chat_ev *E, const chat_node *at, chat_value obj, const char *name, size_t name_n,
                          const chat_value *args, int n_args, const char *const *kwn, const size_t *kwl,
                          const chat_value *kw, int n_kw);
chat_value chat_ev_func(chat_ev *E, const chat_node *at, int func, const chat_value *args, int n_args,
                        const char *const *kwn, const size_t *kwl, const chat_value *kw, int n_kw);

#endif /* TQKV_CHAT_EVAL_H */
