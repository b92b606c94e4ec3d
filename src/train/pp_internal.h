/* The pipeline's state (pipeline.c), shared with its other files (pp_ckpt.c). */
#ifndef ANNEAL_TRAIN_PP_INTERNAL_H
#define ANNEAL_TRAIN_PP_INTERNAL_H

#include "train_internal.h"

/* Tags of the point-to-point messages of micro-batch k: activations and gradients. */
#define TAG_SPAN 16000
#define ACT_TAG(k) ((int)((k) % TAG_SPAN))
#define GRAD_TAG(k) (TAG_SPAN + (int)((k) % TAG_SPAN))

struct train_pp {
    int n, stage, replicas, replica; /* N stages, this rank's stage, D replicas, this rank's replica */
    int tp, tp_rank;                 /* --tp T: the tensor-parallel group's size (1 without), this rank's index */
    int first, last;                 /* this stage's blocks [first, last) */
    anneal_comm *pipe, *data, *embed; /* pipeline group, data group, tied-embedding group (or NULL) */
    anneal_params view;              /* the owned parameters (aliases of the model's; not freed here) */
    int *view_of;                    /* view item -> model parameter index */
    int *owner;                      /* model parameter -> its first owning stage */
    bool *tied;                      /* model parameter -> owned by the first and the last stage */
    int64_t act;                     /* elements of one micro-batch's hidden state: B x T x C */
    float *send_act, *send_grad;     /* M slots of act each: what was sent this step */
    anneal_comm_request **reqs;      /* the step's sends (2M at most) */
    int n_reqs;
    anneal_scope **scopes;           /* per micro-batch: its graph, from its forward to its backward */
    anneal_tensor **in, **out;       /* per micro-batch: the stage's input leaf (stage > 0), output */
    double *ss, *ss_all;             /* sums of squares: this stage's, every stage's (n params each) */
    double *ss_tp;                   /* --tp: this stage's sums of every rank of the group (n x T) */
    double idle_ms, step_ms;         /* the last step: time waiting for peers, and in all */
    double bubble_mean, bubble_max;  /* the last step's idle fraction over the ranks */
    double bubble_sum;               /* bubble_mean summed over this run's steps */
    int64_t bubble_steps;
    bool tied_before_sync;           /* tied gradients summed before the data group's sync (ZeRO 1-2: the
                                      * sync, without overlap, reads .grad in anneal_ddp_finish) */
    double *view_ss, *view_ss_all;   /* ZeRO 1-2: per view parameter, this rank's and every replica's shard sums */
    int64_t step;                    /* the step being run (--deterministic: the micro-batches' generators) */
};

#endif
