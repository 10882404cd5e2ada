/* The expert cache's bookkeeping in C: ExpertCache (cache.py) with one of the frequency family's
 * policies (lfu-admit, lfu-demote, lfu-cooc: policy.py, co_use.py), decision for decision.
 *
 * Why: the Python cache makes hundreds of interpreter calls per MoE layer step (co-use counts, the
 * eviction walk, the tiers' dictionaries): about 0.6 ms per layer step at Qwen3.5-397B's shape, where
 * a step has 100 us of host time in all. This file does the same walk over arrays.
 *
 * The Python classes stay the reference: tests/test_cache_core.py replays random streams of plans,
 * commits, host admissions and ticks through both and requires the same plans and counters, step by
 * step. Every floating-point operation here is the Python one, in the same order (IEEE doubles, the
 * same libm pow and log2), so scores and their ties agree exactly, not nearly.
 *
 * Keys are flat: key = layer * n_expert + expert, so (layer, expert) tuple order is integer order.
 *
 * plan_soon and commit_soon make a plan and apply one on the core's own thread (_core_worker.h), without the
 * GIL, while the caller goes on in Python; every entry point waits for that job first. So the functions a
 * job runs touch no Python object: a failure is kept on the core (core_fail) and raised by the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdarg.h>
#include <string.h>

#include "_core_worker.h"

enum { EMPTY = 0, LOADING = 1, READY = 2 };
enum { SRC_DEVICE = 0, SRC_HOST = 1, SRC_DISK = 2 };
enum { POLICY_ADMIT = 0, POLICY_DEMOTE = 1, POLICY_COOC = 2 };
/* TierCounters' fields, in cache_stats.py's order; the disk uses the first two (reads, read_bytes) */
enum { C_HITS, C_MISSES, C_HIT_BYTES, C_MISS_BYTES, C_ADMITTED, C_ADMITTED_BYTES, C_EVICTED, C_EVICTED_BYTES,
       C_DEMOTED, C_DEMOTED_BYTES, N_COUNTERS };

typedef struct { double v; int64_t t; int32_t key; } Entry;  /* FrequencyDecayPolicy's (v, t_last, key) */
typedef struct { double score; int32_t key; } Pending;        /* co_use's (score, key) */
typedef struct { int64_t seq; int32_t key; } Use;             /* a sequence's use of a key */
typedef struct { double v, f; int64_t now; } Score;           /* a key's frequency score f, at (v, now) */
typedef struct { int64_t seq; int32_t layer, start, len; } Group;

static int entry_less(const Entry *a, const Entry *b) {
    if (a->v != b->v) return a->v < b->v;
    if (a->t != b->t) return a->t < b->t;
    return a->key < b->key;
}
static int entry_same(const Entry *a, const Entry *b) { return a->v == b->v && a->t == b->t && a->key == b->key; }
static int pending_less(const Pending *a, const Pending *b) {
    if (a->score != b->score) return a->score < b->score;
    return a->key < b->key;
}

/* binary min-heaps, grown by doubling */
#define HEAP(NAME, T, LESS)                                                                                  \
    typedef struct { T *a; size_t n, cap; } NAME;                                                            \
    static int NAME##_push(NAME *h, T x) {                                                                   \
        if (h->n == h->cap) {                                                                                \
            size_t cap = h->cap ? 2 * h->cap : 64;                                                           \
            T *a = realloc(h->a, cap * sizeof(T));                                                           \
            if (!a) return -1;                                                                               \
            h->a = a, h->cap = cap;                                                                          \
        }                                                                                                    \
        size_t i = h->n++;                                                                                   \
        while (i > 0) {                                                                                      \
            size_t p = (i - 1) / 2;                                                                          \
            if (!LESS(&x, &h->a[p])) break;                                                                  \
            h->a[i] = h->a[p], i = p;                                                                        \
        }                                                                                                    \
        h->a[i] = x;                                                                                         \
        return 0;                                                                                            \
    }                                                                                                        \
    static T NAME##_pop(NAME *h) {                                                                           \
        T top = h->a[0], x = h->a[--h->n];                                                                   \
        size_t i = 0, n = h->n;                                                                              \
        for (;;) {                                                                                           \
            size_t c = 2 * i + 1;                                                                            \
            if (c >= n) break;                                                                               \
            if (c + 1 < n && LESS(&h->a[c + 1], &h->a[c])) c++;                                              \
            if (!LESS(&h->a[c], &x)) break;                                                                  \
            h->a[i] = h->a[c], i = c;                                                                        \
        }                                                                                                    \
        if (n) h->a[i] = x;                                                                                  \
        return top;                                                                                          \
    }

static int int_less(const int32_t *a, const int32_t *b) { return *a < *b; }
HEAP(EntryHeap, Entry, entry_less)
HEAP(PendingHeap, Pending, pending_less)
HEAP(KeyHeap, int32_t, int_less)

typedef struct { int32_t *a; size_t n, cap; } Keys;

static int grow(void **p, size_t *cap, size_t n, size_t size) {
    if (n < *cap) return 0;
    size_t nc = *cap ? 2 * *cap : 64;
    void *q = realloc(*p, nc * size);
    if (!q) return -1;
    *p = q, *cap = nc;
    return 0;
}

static int keys_push(Keys *k, int32_t key) {
    if (grow((void **)&k->a, &k->cap, k->n, sizeof(int32_t))) return -1;
    k->a[k->n++] = key;
    return 0;
}

/* A plan made on the core's thread (plan_soon): its input, and what Core_plan returns, as C arrays until
   take_plan makes them Python's */
typedef struct {
    int layer, invalid;  /* invalid: an id outside the layer (plan's None) */
    size_t m;
    int64_t *experts;    /* sorted, distinct */
    char *src, *tod, *toh;
    Keys dev_wanted, host_wanted, to_dev, dev_victims, to_host, host_victims, demoted, demotions;
} PlanJob;

/* A commit's arguments, copied out of its Python objects (commit_soon: applied on the core's thread) */
typedef struct {
    int layer;
    size_t m;
    int64_t *experts;
    char *src, *tod, *toh;
    int32_t *victims[3];  /* device victims, host victims, demotions */
    size_t n_victims[3];
    int64_t *seqs;        /* each item's sequences: seqs[seq_at[i] .. seq_at[i + 1]]; NULL: one, 0 */
    size_t *seq_at;
} CommitJob;

enum { FAIL_NONE, FAIL_RUNTIME, FAIL_MEMORY };

/* One tier: TierDirectory's state plus its policy's residents (the frequency order, the duplicates). */
typedef struct {
    int enabled;
    int64_t capacity, used;
    int64_t *unit;      /* bytes of one expert of each layer in this tier */
    uint8_t *state;     /* EMPTY / LOADING / READY */
    int32_t *pins;
    uint8_t *tracked;   /* the policy's residents */
    size_t n_tracked;
    EntryHeap order;    /* (v, t, key) of residents; stale entries skipped and dropped lazily */
    /* The order's smallest entries, in order, as the last eviction walk read them: a walk reads the
       merge of this and the heap, and leaves what it read here instead of pushing it back (a walk reads
       a couple of hundred entries at the 397B shape, and each pop and push-back cost a pass down or up
       the heap). Together with the heap it holds every entry once, as the heap alone did. */
    Entry *front;
    size_t n_front, cap_front;
    uint8_t *dup;       /* covered by the faster tier (the host tier's policy only) */
    KeyHeap dup_heap;   /* resident duplicates, ascending key, lazily */
    /* lfu-cooc: the residents an announcement lifts above their frequency ("announced": f + a > f at the
       co-use counts' token) that the walks of this token have met, in co_use's pending order (score, key),
       lazily; moved out of the frequency order (a_out) until the next token, so each is read once a token,
       not by every walk (the walk merges the two orders: walk_next) */
    PendingHeap announced;
    uint8_t *a_out;
    Keys a_out_keys;
} Tier;

typedef struct {
    PyObject_HEAD
    int n_layer, n_expert, n;
    int policy;
    double half_life;
    int64_t now;
    int64_t generation;
    int demote;
    Tier tier[2];       /* 0 device, 1 host */
    /* the decayed use counts, one set for both tiers (AdmittingFrequencyPolicy.learn_with) */
    double *v;
    int64_t *t_last;
    uint8_t *scored;
    /* lfu-cooc's CoUseCounts */
    double weight_next, weight_this;
    int64_t co_half_life, successors, row_cap, halved_at, counts_now;
    int32_t *row_b;     /* n x row_cap: a's successors b, in insertion order */
    double *row_c;
    int32_t *row_n;
    double *uses;       /* N[a] */
    double *announced;
    Score *scores;      /* freq_score's last result per key */
    Use *cur, *last;                  /* this token's and the last token's uses (sequence, key), in order */
    size_t n_cur, cap_cur, n_last, cap_last;
    /* the last token's keys grouped by (sequence, layer), groups in order of first use (a dict of lists),
       found through an open-addressing table */
    Group *groups;
    size_t n_groups, cap_groups;
    int32_t *table;                   /* group index + 1, 0 empty; table_size a power of two */
    size_t table_size;
    int32_t *grouped;
    size_t cap_grouped;
    /* scratch */
    uint32_t *stamp; uint32_t stamp_now;
    int64_t *counters;  /* [3][n_layer][N_COUNTERS]: device, host, disk */
    PyObject *counters_obj;
    PyObject *plan_item, *sources[3];  /* cache.PlanItem and Source's members, for plan's items */
    /* a failure, kept for the Python caller to raise (a job on the core's thread cannot set a Python error) */
    int fail_kind;
    char fail_msg[240];
    /* plan_soon and commit_soon: the job on the core's thread, and its data */
    Worker worker;
    int job;            /* JOB_PLAN, _COMMIT or _SETTLE: what the worker runs or ran last */
    PlanJob planned;
    int plan_state;     /* PLAN_STARTED from plan_soon (running, or done) until take_plan; else PLAN_NONE */
    CommitJob committing;
    int broken;         /* forked with a job in flight: its state is unknown */
    int64_t walks, walk_reads;  /* eviction walks made, and the entries they read (the walks' cost) */
} Core;

enum { JOB_PLAN = 1, JOB_COMMIT = 2, JOB_SETTLE = 3 };  /* (commit and settle keep their data in `committing`) */

static void plan_job_free(PlanJob *j);
static void commit_job_free(CommitJob *j);
enum { PLAN_NONE = 0, PLAN_STARTED = 1 };

static int core_fail(Core *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->fail_msg, sizeof c->fail_msg, fmt, ap);
    va_end(ap);
    c->fail_kind = FAIL_RUNTIME;
    return -1;
}

static int core_nomem(Core *c) {
    if (c->fail_kind == FAIL_NONE) c->fail_kind = FAIL_MEMORY;
    return -1;
}

/* the kept failure as the Python error (unless one is set already), prefixed by `during` */
static void raise_failure(Core *c, const char *during) {
    if (!PyErr_Occurred()) {
        if (c->fail_kind == FAIL_MEMORY)
            PyErr_NoMemory();
        else if (c->fail_kind == FAIL_RUNTIME)
            PyErr_Format(PyExc_RuntimeError, "%s%s", during, c->fail_msg);
        else
            PyErr_Format(PyExc_SystemError, "%scache core: a failure with no cause kept", during);
    }
    c->fail_kind = FAIL_NONE;
}

#define KEY_LAYER(c, k) ((k) / (c)->n_expert)

/* -- scores ---------------------------------------------------------------------------------------- */
static double rank_at(Core *c, int64_t now) { return isinf(c->half_life) ? 0.0 : (double)now / c->half_life; }

static double freq_score(Core *c, int32_t key, int64_t now) {
    if (!c->scored[key]) return 0.0;
    double v = c->v[key];
    if (v == -INFINITY) return 0.0;
    /* kept per key for the (v, now) it was computed at: an eviction walk scores a couple of hundred keys
       a plan at the 397B shape, most of them again at the next plan of the same token */
    Score *kept = &c->scores[key];
    if (kept->now == now && kept->v == v) return kept->f;
    double f = pow(2.0, v - rank_at(c, now));
    kept->now = now, kept->v = v, kept->f = f;
    return f;
}

static double score(Core *c, int32_t key, int64_t now) {
    double f = freq_score(c, key, now);
    return c->policy == POLICY_COOC ? f + c->announced[key] : f;
}

/* lfu-cooc: whether key's announcement lifts its score above its frequency at the co-use counts' token.
   co_use's eviction_order pushes every resident into its pending heap as the frequency order reaches it,
   and yields one once the order passes its score: a key that is not announced so comes out exactly where
   the frequency order has it, one that is comes out by (score, key) among the announced, before the first
   unannounced key whose frequency is at least its score. So the walk merges the two orders (walk_next). */
static int is_announced(Core *c, int32_t key) {
    double a = c->announced[key];
    if (!(a > 0.0)) return 0;
    double f = freq_score(c, key, c->counts_now);
    return f + a > f;
}

/* whether key belongs in tier t's announced order: an announced resident, not a duplicate (those go first) */
static int announced_member(Core *c, Tier *t, int32_t key) {
    return t->tracked[key] && !t->dup[key] && is_announced(c, key);
}

static int cmp_pending(const void *a, const void *b) {
    return pending_less(a, b) ? -1 : pending_less(b, a) ? 1 : 0;
}

/* the announced order rebuilt: each member once, at its score now (a sorted array is a heap) */
static void compact_announced(Core *c, Tier *t) {
    size_t m = 0;
    for (size_t i = 0; i < t->announced.n; i++) {
        Pending p = t->announced.a[i];
        if (!announced_member(c, t, p.key)) continue;
        p.score = freq_score(c, p.key, c->counts_now) + c->announced[p.key];
        t->announced.a[m++] = p;
    }
    qsort(t->announced.a, m, sizeof(Pending), cmp_pending);
    size_t u = 0;
    for (size_t i = 0; i < m; i++)
        if (!u || t->announced.a[u - 1].key != t->announced.a[i].key || t->announced.a[u - 1].score != t->announced.a[i].score)
            t->announced.a[u++] = t->announced.a[i];
    t->announced.n = u;
}

/* key's entry in tier t's announced order, at its score now, where it is a member. Within a token a
   member's score only rises (an announcement, a use), so an entry is never above its key's score: the
   walk moves an entry whose key has risen since as it reaches it, and a key needs an entry pushed only as
   it joins (announced first, made resident, no longer a duplicate, and at each token) */
static int push_announced(Core *c, Tier *t, int32_t key) {
    if (c->policy != POLICY_COOC || !announced_member(c, t, key)) return 0;
    Pending p = {freq_score(c, key, c->counts_now) + c->announced[key], key};
    if (PendingHeap_push(&t->announced, p)) return -1;
    if (t->announced.n > 2 * t->n_tracked + 1024) compact_announced(c, t);
    return 0;
}

/* -- a tier's frequency order ------------------------------------------------------------------------ */
static int entry_current(Core *c, Tier *t, const Entry *e) {
    return t->tracked[e->key] && c->v[e->key] == e->v && c->t_last[e->key] == e->t;
}

static int compact(Core *c, Tier *t) {
    t->order.n = 0;
    t->n_front = 0;
    for (int32_t k = 0; k < c->n; k++)
        if (t->tracked[k]) {
            Entry e = {c->v[k], c->t_last[k], k};
            if (EntryHeap_push(&t->order, e)) return -1;
        }
    return 0;
}

static int push_entry(Core *c, Tier *t, int32_t key) {
    Entry e = {c->v[key], c->t_last[key], key};
    if (EntryHeap_push(&t->order, e)) return -1;
    if (t->order.n + t->n_front > 2 * t->n_tracked + 64) return compact(c, t);
    return 0;
}

static int cmp_key(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int push_dup(Tier *t, int32_t key) {
    if (!t->tracked[key]) return 0;
    if (KeyHeap_push(&t->dup_heap, key)) return -1;
    if (t->dup_heap.n > 2 * t->n_tracked + 64) {
        /* rebuilt as the sorted, distinct resident duplicates (a sorted array is a heap); every one of them
           has an entry here, so the heap's live keys are all of them */
        size_t m = 0;
        for (size_t i = 0; i < t->dup_heap.n; i++) {
            int32_t k = t->dup_heap.a[i];
            if (t->dup[k] && t->tracked[k]) t->dup_heap.a[m++] = k;
        }
        qsort(t->dup_heap.a, m, sizeof(int32_t), cmp_key);
        size_t u = 0;
        for (size_t i = 0; i < m; i++)
            if (!u || t->dup_heap.a[u - 1] != t->dup_heap.a[i]) t->dup_heap.a[u++] = t->dup_heap.a[i];
        t->dup_heap.n = u;
    }
    return 0;
}

/* FrequencyDecayPolicy.add_use: one more use of key at now, on the shared scores */
static void add_use(Core *c, int32_t key, int64_t now) {
    double count = !c->scored[key] ? 1.0 : pow(2.0, c->v[key] - rank_at(c, now)) + 1.0;
    c->v[key] = log2(count) + rank_at(c, now);
    c->t_last[key] = now;
    c->scored[key] = 1;
}

/* AdmittingFrequencyPolicy.touch (freq.track, and a new resident duplicate joins the heap) */
static int tier_track(Core *c, Tier *t, int32_t key, int64_t now) {
    int new = !t->tracked[key];
    if (!c->scored[key]) {
        c->v[key] = -INFINITY;
        c->t_last[key] = now;
        c->scored[key] = 1;
    }
    if (new) t->n_tracked++;
    t->tracked[key] = 1;
    if (push_entry(c, t, key)) return -1;
    if (new && t->dup[key]) return push_dup(t, key);
    return 0;
}

static void tier_forget(Tier *t, int32_t key) {
    if (t->tracked[key]) t->n_tracked--;
    t->tracked[key] = 0;
    t->dup[key] = 0;
}

static int host_covered(Core *c, int32_t key, int by_faster) {
    Tier *t = &c->tier[1];
    if (by_faster) {
        if (!t->dup[key]) {
            t->dup[key] = 1;
            return push_dup(t, key);
        }
    } else if (t->dup[key]) {
        t->dup[key] = 0;
        if (t->tracked[key]) return push_entry(c, t, key);  /* (a walk may have moved its entry out) */
    }
    return 0;
}

/* -- lfu-cooc's co-use counts ------------------------------------------------------------------------ */
static void announce(Core *c, int32_t a, double weight) {
    int32_t n = c->row_n[a];
    if (!n) return;
    double scale = weight / c->uses[a];
    int32_t *b = c->row_b + (size_t)a * c->row_cap;
    double *cnt = c->row_c + (size_t)a * c->row_cap;
    for (int32_t i = 0; i < n; i++) c->announced[b[i]] = c->announced[b[i]] + cnt[i] * scale;
}

static size_t group_slot(Core *c, int64_t seq, int32_t layer) {
    uint64_t h = ((uint64_t)seq * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)layer * 0xC2B2AE3D27D4EB4Full);
    return (size_t)(h >> 17) & (c->table_size - 1);
}

/* the last token's group of (seq, layer), or NULL */
static Group *find_group(Core *c, int64_t seq, int32_t layer) {
    if (!c->n_groups) return NULL;
    for (size_t i = group_slot(c, seq, layer);; i = (i + 1) & (c->table_size - 1)) {
        int32_t g = c->table[i];
        if (!g) return NULL;
        Group *grp = &c->groups[g - 1];
        if (grp->seq == seq && grp->layer == layer) return grp;
    }
}

static int next_token(Core *c, int64_t now) {
    c->counts_now = now;
    /* last, current = current, {} */
    Use *tmp = c->last; size_t tcap = c->cap_last;
    c->last = c->cur, c->cap_last = c->cap_cur, c->n_last = c->n_cur;
    c->cur = tmp, c->cap_cur = tcap, c->n_cur = 0;
    if (c->n_last > c->cap_grouped) {
        int32_t *g = realloc(c->grouped, c->cap_last * sizeof(int32_t));
        if (!g) return -1;
        c->grouped = g, c->cap_grouped = c->cap_last;
    }
    if (c->n_last > c->cap_groups) {
        Group *g = realloc(c->groups, c->cap_last * sizeof(Group));
        if (!g) return -1;
        c->groups = g, c->cap_groups = c->cap_last;
    }
    size_t size = 16;
    while (size < 2 * c->n_last) size *= 2;
    if (size > c->table_size) {
        int32_t *t = realloc(c->table, size * sizeof(int32_t));
        if (!t) return -1;
        c->table = t, c->table_size = size;
    }
    memset(c->table, 0, c->table_size * sizeof(int32_t));
    /* group the last token's keys by (sequence, layer), groups in order of first use, keys in order */
    c->n_groups = 0;
    for (size_t i = 0; i < c->n_last; i++) {
        int64_t seq = c->last[i].seq;
        int32_t layer = KEY_LAYER(c, c->last[i].key);
        size_t j = group_slot(c, seq, layer);
        for (;; j = (j + 1) & (c->table_size - 1)) {
            int32_t g = c->table[j];
            if (!g) {
                c->groups[c->n_groups] = (Group){seq, layer, 0, 0};
                c->table[j] = (int32_t)++c->n_groups;
                break;
            }
            if (c->groups[g - 1].seq == seq && c->groups[g - 1].layer == layer) break;
        }
        c->groups[c->table[j] - 1].len++;
    }
    int32_t pos = 0;
    for (size_t g = 0; g < c->n_groups; g++) {
        c->groups[g].start = pos;
        pos += c->groups[g].len;
        c->groups[g].len = 0;  /* refilled below */
    }
    for (size_t i = 0; i < c->n_last; i++) {
        Group *grp = find_group(c, c->last[i].seq, KEY_LAYER(c, c->last[i].key));
        c->grouped[grp->start + grp->len++] = c->last[i].key;
    }
    if (now - c->halved_at >= c->co_half_life) {
        c->halved_at = now;
        for (int32_t a = 0; a < c->n; a++) {
            double *cnt = c->row_c + (size_t)a * c->row_cap;
            for (int32_t i = 0; i < c->row_n[a]; i++) cnt[i] *= 0.5;
            c->uses[a] *= 0.5;
        }
    }
    memset(c->announced, 0, sizeof(double) * c->n);
    for (int32_t i = 0; i < (int32_t)c->n_last; i++) announce(c, c->grouped[i], c->weight_this);
    /* a new token's scores: the announced orders start empty, and the residents walks moved into them go
       back into the frequency order (the walks move those still announced again as they meet them) */
    for (int which = 0; which < 2; which++) {
        Tier *t = &c->tier[which];
        t->announced.n = 0;
        for (size_t i = 0; i < t->a_out_keys.n; i++) {
            int32_t key = t->a_out_keys.a[i];
            t->a_out[key] = 0;
            if (t->tracked[key] && push_entry(c, t, key)) return -1;
        }
        t->a_out_keys.n = 0;
    }
    return 0;
}

/* heapq.nlargest(successors, row.items(), key=count) is sorted(..., reverse=True)[:successors]: stable */
static void truncate_row(Core *c, int32_t a) {
    int32_t *b = c->row_b + (size_t)a * c->row_cap;
    double *cnt = c->row_c + (size_t)a * c->row_cap;
    int32_t n = c->row_n[a];
    for (int32_t i = 1; i < n; i++) {
        int32_t kb = b[i];
        double kc = cnt[i];
        int32_t j = i - 1;
        while (j >= 0 && cnt[j] < kc) { b[j + 1] = b[j], cnt[j + 1] = cnt[j]; j--; }
        b[j + 1] = kb, cnt[j + 1] = kc;
    }
    c->row_n[a] = (int32_t)c->successors;
}

static int counts_observe(Core *c, int32_t key, int64_t now, int64_t seq) {
    if (now != c->counts_now && next_token(c, now)) return -1;
    Group *grp = find_group(c, seq, KEY_LAYER(c, key));
    if (grp) {
        int32_t *keys = c->grouped + grp->start;
        for (int32_t i = 0; i < grp->len; i++) {
            int32_t a = keys[i];
            int32_t *b = c->row_b + (size_t)a * c->row_cap;
            double *cnt = c->row_c + (size_t)a * c->row_cap;
            int32_t n = c->row_n[a], j = 0;
            while (j < n && b[j] != key) j++;
            if (j < n) {
                cnt[j] = cnt[j] + 1.0;
            } else {
                b[n] = key, cnt[n] = 0.0 + 1.0;
                c->row_n[a] = n + 1;
            }
            if (c->row_n[a] > 2 * c->successors) truncate_row(c, a);
        }
    }
    c->uses[key] = c->uses[key] + 1.0;
    if (c->n_cur == c->cap_cur) {
        size_t cap = c->cap_cur ? 2 * c->cap_cur : 1024;
        Use *p = realloc(c->cur, cap * sizeof(Use));
        if (!p) return -1;
        c->cur = p, c->cap_cur = cap;
    }
    c->cur[c->n_cur++] = (Use){seq, key};
    announce(c, key, c->weight_next);
    return 0;
}

/* the policies' observe: the learning tier counts the use (and, lfu-cooc, each using sequence's co-use),
   the other re-ranks the key */
static int observe(Core *c, int which, int32_t key, int64_t now, const int64_t *seqs, size_t n_seqs) {
    Tier *t = &c->tier[which];
    int learner = c->tier[0].enabled ? 0 : 1;
    if (which == learner) {
        add_use(c, key, now);
        if (t->tracked[key] && push_entry(c, t, key)) return -1;
        if (c->policy == POLICY_COOC) {
            for (size_t i = 0; i < n_seqs; i++)
                if (counts_observe(c, key, now, seqs[i])) return -1;
        }
        return 0;
    }
    return t->tracked[key] ? push_entry(c, t, key) : 0;
}

/* -- the eviction walk: duplicates first, then by score ----------------------------------------------- */
typedef struct {
    Core *c;
    Tier *t;
    int phase;          /* 0 duplicates, 1 frequency order (lfu-cooc: merged with the announced), 2 done */
    int32_t *popped_dups; size_t n_dups, cap_dups;
    Entry *popped; size_t n_popped, cap_popped;  /* the current entries read, in order */
    size_t in_front;                              /* entries of the tier's front read so far */
    int have_last;
    Entry last;
    /* lfu-cooc: the frequency order's next key not announced (cur), and the announced order's entries read */
    int have_cur, freq_done;
    int32_t cur_key;
    double cur_f;
    Pending *ann_popped; size_t n_ann_popped, cap_ann_popped;
    int failed;
} Walk;

static void walk_start(Walk *w, Core *c, Tier *t) {
    memset(w, 0, sizeof(*w));
    w->c = c, w->t = t;
    c->walks++;
}

/* the smallest entry not read yet, of the front and the heap; 0 when none is left */
static int next_entry(Walk *w, Entry *e) {
    Tier *t = w->t;
    int front = w->in_front < t->n_front;
    if (!front && !t->order.n) return 0;
    w->c->walk_reads++;
    if (front && (!t->order.n || entry_less(&t->front[w->in_front], &t->order.a[0])))
        *e = t->front[w->in_front++];
    else
        *e = EntryHeap_pop(&t->order);
    return 1;
}

/* the next resident key of the frequency order, not a duplicate; -1 at the end */
static int32_t walk_freq(Walk *w) {
    Tier *t = w->t;
    Entry e;
    while (next_entry(w, &e)) {
        if (!entry_current(w->c, t, &e) || (w->have_last && entry_same(&e, &w->last))) continue;  /* stale, or a second entry */
        if (w->c->policy == POLICY_COOC && !t->dup[e.key] && is_announced(w->c, e.key)) {
            /* announced: moved into the announced order (and out of this one, not kept in the front) until
               next_token, so that the next walks of the token do not read it again */
            if (push_announced(w->c, t, e.key)) { w->failed = 1; return -1; }
            if (!t->a_out[e.key]) {
                if (keys_push(&t->a_out_keys, e.key)) { w->failed = 1; return -1; }
                t->a_out[e.key] = 1;
            }
            continue;
        }
        w->have_last = 1, w->last = e;
        if (grow((void **)&w->popped, &w->cap_popped, w->n_popped, sizeof(Entry))) { w->failed = 1; return -1; }
        w->popped[w->n_popped++] = e;
        if (t->dup[e.key]) continue;
        return e.key;
    }
    return -1;
}

static int32_t walk_next(Walk *w) {
    Tier *t = w->t;
    Core *c = w->c;
    if (w->phase == 0) {
        while (t->dup_heap.n) {
            int32_t key = KeyHeap_pop(&t->dup_heap);
            if (!t->dup[key] || !t->tracked[key] || (w->n_dups && w->popped_dups[w->n_dups - 1] == key)) continue;
            if (grow((void **)&w->popped_dups, &w->cap_dups, w->n_dups, sizeof(int32_t))) { w->failed = 1; return -1; }
            w->popped_dups[w->n_dups++] = key;
            return key;
        }
        w->phase = 1;
    }
    if (w->phase == 1) {
        if (c->policy != POLICY_COOC) {
            int32_t key = walk_freq(w);
            if (key >= 0) return key;
            w->phase = 2;
            return -1;
        }
        /* the frequency order of the keys not announced, merged with the announced order: an announced
           key goes first once its score is at most the next one's frequency (is_announced) */
        if (!w->have_cur && !w->freq_done) {
            int32_t key = walk_freq(w);
            if (key >= 0)
                w->have_cur = 1, w->cur_key = key, w->cur_f = freq_score(c, key, c->counts_now);
            else if (w->failed)
                return -1;
            else
                w->freq_done = 1;
        }
        PendingHeap *ann = &t->announced;
        while (ann->n) {  /* the head: no member any more (dropped), risen since it was pushed (moved), or current */
            int32_t key = ann->a[0].key;
            c->walk_reads++;
            if (!announced_member(c, t, key)) {
                PendingHeap_pop(ann);
                continue;
            }
            double now = freq_score(c, key, c->counts_now) + c->announced[key];
            if (now == ann->a[0].score) break;
            PendingHeap_pop(ann);
            Pending moved = {now, key};
            if (PendingHeap_push(ann, moved)) { w->failed = 1; return -1; }
        }
        if (ann->n && (!w->have_cur || ann->a[0].score <= w->cur_f)) {
            Pending p = PendingHeap_pop(ann);
            if (grow((void **)&w->ann_popped, &w->cap_ann_popped, w->n_ann_popped, sizeof(Pending))) { w->failed = 1; return -1; }
            w->ann_popped[w->n_ann_popped++] = p;
            /* (a key pushed twice at one score: its second entry is next, and is dropped here) */
            while (ann->n && ann->a[0].key == p.key && ann->a[0].score == p.score) PendingHeap_pop(ann);
            return p.key;
        }
        if (w->have_cur) {
            w->have_cur = 0;
            return w->cur_key;
        }
        w->phase = 2;
    }
    return -1;
}

/* the walk is over: what it read becomes the front, before the front's entries it did not read (every
   one of which is at least as large); stale entries stay out */
static int walk_close(Walk *w) {
    Tier *t = w->t;
    int rc = w->failed ? -1 : 0;
    for (size_t i = 0; i < w->n_dups; i++)
        if (KeyHeap_push(&t->dup_heap, w->popped_dups[i])) rc = -1;
    for (size_t i = 0; i < w->n_ann_popped; i++)  /* (the announced entries it read, all current: back) */
        if (PendingHeap_push(&t->announced, w->ann_popped[i])) rc = -1;
    size_t rest = t->n_front - w->in_front, n = w->n_popped + rest;
    if (n > t->cap_front) {
        size_t cap = t->cap_front ? t->cap_front : 64;
        while (cap < n) cap *= 2;
        Entry *a = realloc(t->front, cap * sizeof(Entry));
        if (!a) { /* no room for a longer front: what was read goes back into the heap, as it came */
            for (size_t i = 0; i < w->n_popped; i++)
                if (EntryHeap_push(&t->order, w->popped[i])) rc = -1;
            memmove(t->front, t->front + w->in_front, rest * sizeof(Entry));
            t->n_front = rest;
            goto done;
        }
        t->front = a, t->cap_front = cap;
    }
    if (n) { /* (no front yet and nothing read: no array to move within) */
        memmove(t->front + w->n_popped, t->front + w->in_front, rest * sizeof(Entry));
        memcpy(t->front, w->popped, w->n_popped * sizeof(Entry));
    }
    t->n_front = n;
done:
    free(w->popped_dups);
    free(w->popped);
    free(w->ann_popped);
    return rc;
}

/* -- TierDirectory.plan_admissions --------------------------------------------------------------------- */

static int admits(Core *c, Tier *t, int32_t key, int32_t *victims, size_t n_victims, int64_t now) {
    double worst = 0.0;
    int any = 0;
    for (size_t i = 0; i < n_victims; i++) {
        if (t->dup[victims[i]]) continue;
        double s = score(c, victims[i], now);
        if (!any || s > worst) worst = s, any = 1;
    }
    return score(c, key, now) + 1.0 > worst;
}

/* protected: stamp[key] == stamp_now */
static int plan_admissions(Core *c, Tier *t, const int32_t *wanted, size_t n_wanted, int use_protected,
                           Keys *admitted, Keys *victims) {
    if (!t->enabled || !n_wanted) return 0;
    int64_t free_bytes = t->capacity - t->used, pulled_bytes = 0;
    int32_t *pulled = malloc(sizeof(int32_t) * (t->n_tracked + 1));
    if (!pulled) return -1;
    size_t head = 0, tail = 0;
    Walk w;
    walk_start(&w, c, t);
    int exhausted = 0, rc = 0;
    for (size_t i = 0; i < n_wanted; i++) {
        int32_t key = wanted[i];
        int64_t nbytes = t->unit[KEY_LAYER(c, key)];
        if (nbytes > t->capacity) continue;
        while (free_bytes + pulled_bytes < nbytes && !exhausted) {
            int32_t cand = walk_next(&w);
            if (cand < 0) {
                exhausted = 1;
                if (w.failed) { rc = -1; goto done; }
            } else if (!t->pins[cand] && t->state[cand] == READY && !(use_protected && c->stamp[cand] == c->stamp_now)) {
                pulled[tail++] = cand;
                pulled_bytes += t->unit[KEY_LAYER(c, cand)];
            }
        }
        if (free_bytes + pulled_bytes < nbytes) continue;
        if (free_bytes < nbytes) {
            int64_t needed = nbytes - free_bytes, freed = 0;
            size_t m = head;
            while (m < tail && freed < needed) freed += t->unit[KEY_LAYER(c, pulled[m++])];
            if (!admits(c, t, key, pulled + head, m - head, c->now)) continue;
        }
        while (free_bytes < nbytes) {
            int32_t victim = pulled[head++];
            int64_t size = t->unit[KEY_LAYER(c, victim)];
            if (keys_push(victims, victim)) { rc = -1; goto done; }
            free_bytes += size, pulled_bytes -= size;
        }
        free_bytes -= nbytes;
        if (keys_push(admitted, key)) { rc = -1; goto done; }
    }
done:
    if (walk_close(&w)) rc = -1;
    free(pulled);
    return rc;
}

/* -- tier commands ------------------------------------------------------------------------------------- */
static const char *TIER_NAME[2] = {"device", "host"};

static int tier_admit(Core *c, int which, int32_t key, int state) {
    Tier *t = &c->tier[which];
    int64_t nbytes = t->unit[KEY_LAYER(c, key)];
    int layer = KEY_LAYER(c, key), e = key % c->n_expert;
    if (t->state[key] != EMPTY) {
        return core_fail(c, "tier %s: (%d, %d) admitted twice", TIER_NAME[which], layer, e);
    }
    if (nbytes > t->capacity - t->used) {
        return core_fail(c, "tier %s: admitting (%d, %d) needs %lld bytes, expected at most %lld free", TIER_NAME[which],
                         layer, e, (long long)nbytes, (long long)(t->capacity - t->used));
    }
    t->state[key] = (uint8_t)state;
    t->used += nbytes;
    if (tier_track(c, t, key, c->now)) return core_nomem(c);
    return 0;
}

/* key leaves the tier from state `from`: READY (an eviction) or LOADING (its read failed: the bytes never
   came); returns the bytes freed */
static int64_t tier_drop(Core *c, int which, int32_t key, int from) {
    Tier *t = &c->tier[which];
    int layer = KEY_LAYER(c, key), e = key % c->n_expert;
    const char *what = from == READY ? "evicting" : "cancelling";
    if (t->pins[key]) {
        return core_fail(c, "tier %s: %s (%d, %d), expected it unpinned, got %d pins", TIER_NAME[which], what, layer, e,
                         t->pins[key]);
    }
    if (t->state[key] != from) {
        return core_fail(c, "tier %s: %s (%d, %d), expected %s", TIER_NAME[which], what, layer, e,
                         from == READY ? "READY" : "LOADING");
    }
    t->state[key] = EMPTY;
    int64_t nbytes = t->unit[layer];
    t->used -= nbytes;
    tier_forget(t, key);
    return nbytes;
}

static int tier_pin(Core *c, int which, int32_t key) {
    Tier *t = &c->tier[which];
    if (t->state[key] == EMPTY) {
        return core_fail(c, "tier %s: pinning (%d, %d), expected it held, got empty", TIER_NAME[which],
                         (int)KEY_LAYER(c, key), (int)(key % c->n_expert));
    }
    t->pins[key]++;
    return 0;
}

static int tier_unpin(Core *c, int which, int32_t key) {
    Tier *t = &c->tier[which];
    if (!t->pins[key]) {
        return core_fail(c, "tier %s: unpinning (%d, %d), expected a pin, got none", TIER_NAME[which],
                         (int)KEY_LAYER(c, key), (int)(key % c->n_expert));
    }
    t->pins[key]--;
    return 0;
}

static int tier_ready(Core *c, int which, int32_t key) {
    Tier *t = &c->tier[which];
    if (t->state[key] == EMPTY) {
        return core_fail(c, "tier %s: (%d, %d) marked ready, expected LOADING, got empty", TIER_NAME[which],
                         (int)KEY_LAYER(c, key), (int)(key % c->n_expert));
    }
    t->state[key] = READY;
    return 0;
}

static int64_t *counter(Core *c, int tier, int layer) { return c->counters + ((size_t)tier * c->n_layer + layer) * N_COUNTERS; }

/* -- the Python type ------------------------------------------------------------------------------------ */
static void Core_dealloc(Core *c) {
    if (worker_busy(&c->worker)) worker_wait(&c->worker);  /* (a failure of its is moot: the core goes) */
    worker_close(&c->worker);
    plan_job_free(&c->planned);
    commit_job_free(&c->committing);
    for (int i = 0; i < 2; i++) {
        Tier *t = &c->tier[i];
        free(t->unit), free(t->state), free(t->pins), free(t->tracked), free(t->order.a), free(t->front), free(t->dup), free(t->dup_heap.a);
        free(t->announced.a), free(t->a_out), free(t->a_out_keys.a);
    }
    free(c->v), free(c->t_last), free(c->scored), free(c->row_b), free(c->row_c), free(c->row_n), free(c->uses);
    free(c->announced), free(c->scores), free(c->cur), free(c->last), free(c->groups), free(c->table), free(c->grouped), free(c->stamp);
    Py_XDECREF(c->counters_obj);
    Py_XDECREF(c->plan_item);
    for (int i = 0; i < 3; i++) Py_XDECREF(c->sources[i]);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int read_units(PyObject *seq, int n_layer, int64_t **out) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of byte sizes");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n_layer) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "expected %d byte sizes, one per layer", n_layer);
        return -1;
    }
    *out = malloc(sizeof(int64_t) * n_layer);
    if (!*out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < n_layer; i++) (*out)[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    return PyErr_Occurred() ? -1 : 0;
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *names[] = {"n_layer", "n_expert", "host_unit", "device_unit", "device_bytes", "host_bytes", "policy",
                            "half_life", "weight_next", "weight_this", "co_half_life", "successors", NULL};
    PyObject *host_unit, *device_unit;
    long long device_bytes, host_bytes, co_half_life = 1024, successors = 16;
    double weight_next = 4.0, weight_this = 2.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiOOLLid|ddLL", names, &c->n_layer, &c->n_expert, &host_unit, &device_unit,
                                     &device_bytes, &host_bytes, &c->policy, &c->half_life, &weight_next, &weight_this,
                                     &co_half_life, &successors))
        return -1;
    if (c->n_layer <= 0 || c->n_expert <= 0 || (int64_t)c->n_layer * c->n_expert > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "expected 0 < n_layer x n_expert < 2^31");
        return -1;
    }
    c->n = c->n_layer * c->n_expert;
    size_t n = (size_t)c->n;
    c->weight_next = weight_next, c->weight_this = weight_this;
    c->co_half_life = co_half_life, c->successors = successors, c->row_cap = 2 * successors + 1;
    c->counts_now = -1;
    c->demote = 0;
    if (read_units(device_unit, c->n_layer, &c->tier[0].unit) || read_units(host_unit, c->n_layer, &c->tier[1].unit)) return -1;
    int64_t caps[2] = {device_bytes, host_bytes};
    for (int i = 0; i < 2; i++) {
        Tier *t = &c->tier[i];
        t->capacity = caps[i];
        t->enabled = caps[i] > 0;
        t->state = calloc(n, 1), t->pins = calloc(n, sizeof(int32_t)), t->tracked = calloc(n, 1), t->dup = calloc(n, 1);
        t->a_out = calloc(n, 1);
        if (!t->state || !t->pins || !t->tracked || !t->dup || !t->a_out) { PyErr_NoMemory(); return -1; }
    }
    c->v = calloc(n, sizeof(double)), c->t_last = calloc(n, sizeof(int64_t)), c->scored = calloc(n, 1);
    c->uses = calloc(n, sizeof(double)), c->announced = calloc(n, sizeof(double));
    c->stamp = calloc(n, sizeof(uint32_t));
    c->scores = malloc(n * sizeof(Score));
    if (!c->scores) { PyErr_NoMemory(); return -1; }
    for (size_t i = 0; i < n; i++) c->scores[i].now = INT64_MIN;  /* none kept */
    if (c->policy == POLICY_COOC) {
        c->row_b = calloc(n * c->row_cap, sizeof(int32_t)), c->row_c = calloc(n * c->row_cap, sizeof(double));
        c->row_n = calloc(n, sizeof(int32_t));
        if (!c->row_b || !c->row_c || !c->row_n) { PyErr_NoMemory(); return -1; }
    }
    c->counters_obj = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(3 * (size_t)c->n_layer * N_COUNTERS * sizeof(int64_t)));
    if (!c->v || !c->t_last || !c->scored || !c->uses || !c->announced || !c->stamp || !c->counters_obj) {
        PyErr_NoMemory();
        return -1;
    }
    c->counters = (int64_t *)PyByteArray_AS_STRING(c->counters_obj);
    memset(c->counters, 0, 3 * (size_t)c->n_layer * N_COUNTERS * sizeof(int64_t));
    return 0;
}

/* a key: the core's flat int, or a (layer, expert) pair as the Plan names evictions and demotions */
static int parse_key(Core *c, PyObject *o, int32_t *key) {
    long long k;
    if (PyTuple_Check(o)) {
        long long layer, expert;
        if (PyTuple_GET_SIZE(o) != 2) { PyErr_SetString(PyExc_ValueError, "a key pair is (layer, expert)"); return -1; }
        layer = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 0));
        if (layer == -1 && PyErr_Occurred()) return -1;
        expert = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 1));
        if (expert == -1 && PyErr_Occurred()) return -1;
        if (layer < 0 || layer >= c->n_layer || expert < 0 || expert >= c->n_expert) {
            PyErr_Format(PyExc_ValueError, "key (%lld, %lld) outside the cache", layer, expert);
            return -1;
        }
        k = layer * c->n_expert + expert;
    } else {
        k = PyLong_AsLongLong(o);
        if (k == -1 && PyErr_Occurred()) return -1;
    }
    if (k < 0 || k >= c->n) { PyErr_Format(PyExc_ValueError, "key %lld outside the cache", k); return -1; }
    *key = (int32_t)k;
    return 0;
}

/* the keys as (layer, expert) pairs, as the core names keys to Python (a plan's evictions and demotions, abort's and admit_host's keys) */
static PyObject *pairs_tuple(Core *c, Keys *k) {
    PyObject *t = PyTuple_New((Py_ssize_t)k->n);
    if (!t) return NULL;
    for (size_t i = 0; i < k->n; i++) {
        PyObject *pair = Py_BuildValue("(ii)", (int)KEY_LAYER(c, k->a[i]), (int)(k->a[i] % c->n_expert));
        if (!pair) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, pair);
    }
    return t;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static uint32_t next_stamp(Core *c) {
    if (c->stamp_now >= UINT32_MAX - 8) memset(c->stamp, 0, sizeof(uint32_t) * c->n), c->stamp_now = 0;
    return ++c->stamp_now;
}

static void plan_job_free(PlanJob *j) {
    free(j->experts), free(j->src), free(j->tod), free(j->toh);
    Keys *keys[8] = {&j->dev_wanted, &j->host_wanted, &j->to_dev, &j->dev_victims, &j->to_host, &j->host_victims, &j->demoted,
                     &j->demotions};
    for (int i = 0; i < 8; i++) free(keys[i]->a);
    memset(j, 0, sizeof *j);
}

/* a plan's input: layer and ids (an int64 buffer) as sorted, distinct experts (with the GIL: sets a Python
   error) */
static int plan_job_start(Core *c, PlanJob *j, PyObject *args) {
    int layer;
    Py_buffer ids;
    memset(j, 0, sizeof *j);
    if (!PyArg_ParseTuple(args, "iy*", &layer, &ids)) return -1;
    if (layer < 0 || layer >= c->n_layer || !c->plan_item) {
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "plan: a layer outside the cache, or set_types not called");
        return -1;
    }
    size_t n = ids.len / sizeof(int64_t), m = 0;
    j->layer = layer;
    j->experts = malloc(sizeof(int64_t) * (n + 1));
    j->src = malloc(n + 1), j->tod = malloc(n + 1), j->toh = malloc(n + 1);
    if (!j->experts || !j->src || !j->tod || !j->toh) {
        PyBuffer_Release(&ids);
        plan_job_free(j);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(j->experts, ids.buf, n * sizeof(int64_t));
    PyBuffer_Release(&ids);
    int64_t *experts = j->experts;
    qsort(experts, n, sizeof(int64_t), cmp_i64);
    for (size_t i = 0; i < n; i++)
        if (!m || experts[m - 1] != experts[i]) experts[m++] = experts[i];
    j->m = m;
    j->invalid = m && (experts[0] < 0 || experts[m - 1] >= c->n_expert);
    return 0;
}

/* ExpertCache.plan's decisions, into the job: no Python (it runs on the core's thread for plan_soon);
   changes no decision state */
static int plan_compute(Core *c, PlanJob *j) {
    if (j->invalid) return 0;
    size_t m = j->m;
    const int64_t *experts = j->experts;
    char *s = j->src, *d = j->tod, *h = j->toh;
    int32_t base = j->layer * c->n_expert;
    /* the keys this plan uses are protected from both tiers' evictions */
    uint32_t protect = next_stamp(c);
    for (size_t i = 0; i < m; i++) {
        int32_t key = base + (int32_t)experts[i];
        c->stamp[key] = protect;
        s[i] = c->tier[0].state[key] != EMPTY ? SRC_DEVICE : c->tier[1].state[key] != EMPTY ? SRC_HOST : SRC_DISK;
        if (s[i] != SRC_DEVICE && keys_push(&j->dev_wanted, key)) return core_nomem(c);
    }
    if (plan_admissions(c, &c->tier[0], j->dev_wanted.a, j->dev_wanted.n, 1, &j->to_dev, &j->dev_victims)) return core_nomem(c);
    uint32_t in_dev = next_stamp(c);
    for (size_t i = 0; i < j->to_dev.n; i++) c->stamp[j->to_dev.a[i]] = in_dev;
    for (size_t i = 0; i < m; i++) d[i] = c->stamp[base + (int32_t)experts[i]] == in_dev;
    if (c->demote) /* (demotions first or reads first, and letting reads into both tiers: within 0.1 point) */
        for (size_t i = 0; i < j->dev_victims.n; i++)
            if (c->tier[1].state[j->dev_victims.a[i]] == EMPTY &&
                (keys_push(&j->demoted, j->dev_victims.a[i]) || keys_push(&j->host_wanted, j->dev_victims.a[i])))
                return core_nomem(c);
    for (size_t i = 0; i < m; i++)
        if (s[i] == SRC_DISK && !(c->demote && d[i]) && keys_push(&j->host_wanted, base + (int32_t)experts[i])) return core_nomem(c);
    protect = next_stamp(c);
    for (size_t i = 0; i < m; i++) c->stamp[base + (int32_t)experts[i]] = protect;
    if (plan_admissions(c, &c->tier[1], j->host_wanted.a, j->host_wanted.n, 1, &j->to_host, &j->host_victims)) return core_nomem(c);
    uint32_t in_host = next_stamp(c);
    for (size_t i = 0; i < j->to_host.n; i++) c->stamp[j->to_host.a[i]] = in_host;
    for (size_t i = 0; i < m; i++) h[i] = c->stamp[base + (int32_t)experts[i]] == in_host;
    for (size_t i = 0; i < j->demoted.n; i++)
        if (c->stamp[j->demoted.a[i]] == in_host && keys_push(&j->demotions, j->demoted.a[i])) return core_nomem(c);
    return 0;
}

/* plan's value, from a computed job: None when an id is out of range, else
   (experts int64 bytes, sources bytes, to_device bytes, to_host bytes, items, device victims, host victims,
    demotions, the last three as (layer, expert) pairs). items are PlanItem(expert, source, nbytes, to_device,
   to_host), built with the types set_types gave. */
static PyObject *plan_value(Core *c, PlanJob *j) {
    if (j->invalid) Py_RETURN_NONE;
    size_t m = j->m;
    PyObject *out = NULL, *items = NULL, *ex = PyBytes_FromStringAndSize((const char *)j->experts, (Py_ssize_t)(m * sizeof(int64_t))),
             *src = PyBytes_FromStringAndSize(j->src, (Py_ssize_t)m), *tod = PyBytes_FromStringAndSize(j->tod, (Py_ssize_t)m),
             *toh = PyBytes_FromStringAndSize(j->toh, (Py_ssize_t)m);
    if (!ex || !src || !tod || !toh) goto done;
    items = PyTuple_New((Py_ssize_t)m);
    if (!items) goto done;
    PyObject *nbytes = PyLong_FromLongLong(c->tier[1].unit[j->layer]);
    if (!nbytes) goto done;
    PyTypeObject *item_type = (PyTypeObject *)c->plan_item;
    for (size_t i = 0; i < m; i++) {
        /* PlanItem(expert, source, nbytes, to_device, to_host): a named tuple is a tuple of its fields, made
           here as tuple.__new__ would make it (one allocation, not three) */
        PyObject *item = item_type->tp_alloc(item_type, 5), *expert = item ? PyLong_FromLongLong(j->experts[i]) : NULL;
        if (!expert) { Py_XDECREF(item); Py_DECREF(nbytes); goto done; }
        PyObject *fields[5] = {expert, Py_NewRef(c->sources[(int)j->src[i]]), Py_NewRef(nbytes),
                               Py_NewRef(j->tod[i] ? Py_True : Py_False), Py_NewRef(j->toh[i] ? Py_True : Py_False)};
        for (Py_ssize_t f = 0; f < 5; f++) PyTuple_SET_ITEM(item, f, fields[f]);
        PyTuple_SET_ITEM(items, (Py_ssize_t)i, item);
    }
    Py_DECREF(nbytes);
    out = Py_BuildValue("(OOOOONNN)", ex, src, tod, toh, items, pairs_tuple(c, &j->dev_victims), pairs_tuple(c, &j->host_victims),
                        pairs_tuple(c, &j->demotions));
done:
    Py_XDECREF(ex), Py_XDECREF(src), Py_XDECREF(tod), Py_XDECREF(toh), Py_XDECREF(items);
    return out;
}

static int core_join(Core *c);

/* plan(layer, ids int64 buffer) -> plan_value's: ExpertCache.plan */
static PyObject *Core_plan(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    PlanJob j;
    if (plan_job_start(c, &j, args)) return NULL;
    PyObject *out = NULL;
    if (plan_compute(c, &j))
        raise_failure(c, "");
    else
        out = plan_value(c, &j);
    plan_job_free(&j);
    return out;
}

static int run_plan(void *arg) {
    Core *c = arg;
    return plan_compute(c, &c->planned);
}

/* plan_soon(layer, ids int64 buffer): plan's, made on the core's thread while the caller goes on; take_plan()
   gives its value. Whatever calls into the core next waits for it, so nothing sees the core mid-plan. */
static PyObject *Core_plan_soon(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    plan_job_free(&c->planned);  /* (a plan started and never taken: its step failed before it needed it) */
    c->plan_state = PLAN_NONE;
    if (plan_job_start(c, &c->planned, args)) return NULL;
    c->plan_state = PLAN_STARTED;
    c->job = JOB_PLAN;
    worker_submit(&c->worker, run_plan, c);
    Py_RETURN_NONE;
}

/* take_plan() -> the value of the plan plan_soon started (plan's) */
static PyObject *Core_take_plan(Core *c, PyObject *unused) {
    if (core_join(c)) return NULL;
    if (c->plan_state != PLAN_STARTED) {
        PyErr_SetString(PyExc_RuntimeError, "take_plan: no plan was started (plan_soon), or it was taken");
        return NULL;
    }
    PyObject *out = plan_value(c, &c->planned);
    plan_job_free(&c->planned);
    c->plan_state = PLAN_NONE;
    return out;
}

/* set_types(PlanItem, (Source.DEVICE, Source.HOST, Source.DISK)) */
static PyObject *Core_set_types(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    PyObject *item, *sources;
    if (!PyArg_ParseTuple(args, "OO", &item, &sources)) return NULL;
    if (!PyType_Check(item) || !PyType_IsSubtype((PyTypeObject *)item, &PyTuple_Type) || !PyTuple_Check(sources) ||
        PyTuple_GET_SIZE(sources) != 3) {
        PyErr_SetString(PyExc_TypeError, "set_types(a tuple subclass, a tuple of 3 sources)");
        return NULL;
    }
    Py_XSETREF(c->plan_item, Py_NewRef(item));
    for (int i = 0; i < 3; i++) Py_XSETREF(c->sources[i], Py_NewRef(PyTuple_GET_ITEM(sources, i)));
    Py_RETURN_NONE;
}

static void count_item(Core *c, int layer, int source, int to_device, int to_host, int64_t nbytes) {
    int64_t *dev = counter(c, 0, layer), *host = counter(c, 1, layer), *disk = counter(c, 2, layer);
    if (source == SRC_DEVICE) {
        dev[C_HITS]++, dev[C_HIT_BYTES] += nbytes;
        return;
    }
    if (c->tier[0].enabled) dev[C_MISSES]++, dev[C_MISS_BYTES] += nbytes;
    if (to_device) dev[C_ADMITTED]++, dev[C_ADMITTED_BYTES] += nbytes;
    if (source == SRC_HOST) {
        host[C_HITS]++, host[C_HIT_BYTES] += nbytes;
        return;
    }
    if (c->tier[1].enabled) host[C_MISSES]++, host[C_MISS_BYTES] += nbytes;
    if (to_host) host[C_ADMITTED]++, host[C_ADMITTED_BYTES] += nbytes;
    disk[0]++, disk[1] += nbytes;
}

typedef struct { const int64_t *experts; const char *src, *tod, *toh; size_t m; Py_buffer bufs[4]; int n_bufs; } PlanArgs;

static int plan_args(PyObject *e, PyObject *s, PyObject *d, PyObject *h, PlanArgs *p) {
    PyObject *objs[4] = {e, s, d, h};
    p->n_bufs = 0;
    for (int i = 0; i < 4; i++) {
        if (PyObject_GetBuffer(objs[i], &p->bufs[i], PyBUF_SIMPLE)) return -1;
        p->n_bufs++;
    }
    p->experts = p->bufs[0].buf, p->src = p->bufs[1].buf, p->tod = p->bufs[2].buf, p->toh = p->bufs[3].buf;
    p->m = p->bufs[0].len / sizeof(int64_t);
    return 0;
}

static void plan_args_release(PlanArgs *p) {
    for (int i = 0; i < p->n_bufs; i++) PyBuffer_Release(&p->bufs[i]);
}

static int for_keys(Core *c, PyObject *seq, int32_t **out, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "expected a tuple of keys");
    if (!fast) return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    *out = malloc(sizeof(int32_t) * (*n + 1));
    if (!*out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++)
        if (parse_key(c, PySequence_Fast_GET_ITEM(fast, i), &(*out)[i])) { Py_DECREF(fast); free(*out); return -1; }
    Py_DECREF(fast);
    return 0;
}

static void commit_job_free(CommitJob *j) {
    free(j->experts), free(j->src), free(j->tod), free(j->toh), free(j->seqs), free(j->seq_at);
    for (int i = 0; i < 3; i++) free(j->victims[i]);
    memset(j, 0, sizeof *j);
}

/* a plan's arrays (experts, sources, to_device, to_host: bytes-likes), copied into the job (with the GIL) */
static int job_arrays(CommitJob *j, PyObject *e, PyObject *s, PyObject *d, PyObject *h) {
    PlanArgs p;
    if (plan_args(e, s, d, h, &p)) { plan_args_release(&p); return -1; }
    size_t m = j->m = p.m;
    j->experts = malloc(sizeof(int64_t) * (m + 1));
    j->src = malloc(m + 1), j->tod = malloc(m + 1), j->toh = malloc(m + 1);
    if (!j->experts || !j->src || !j->tod || !j->toh) {
        plan_args_release(&p);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(j->experts, p.experts, m * sizeof(int64_t));
    memcpy(j->src, p.src, m), memcpy(j->tod, p.tod, m), memcpy(j->toh, p.toh, m);
    plan_args_release(&p);
    return 0;
}

/* commit's arguments (layer, experts, sources, to_device, to_host, device_victims, host_victims, demotions
   [, users]), copied into the job: users, when given, is a tuple per item of the sequences (ints) whose rows
   chose it; else one sequence, 0. With the GIL: sets a Python error. */
static int commit_job_parse(Core *c, PyObject *args, CommitJob *j) {
    PyObject *e, *s, *d, *h, *lists[3], *users = NULL;
    memset(j, 0, sizeof *j);
    if (!PyArg_ParseTuple(args, "iOOOOOOO|O", &j->layer, &e, &s, &d, &h, &lists[0], &lists[1], &lists[2], &users)) return -1;
    if (j->layer < 0 || j->layer >= c->n_layer) {
        PyErr_SetString(PyExc_ValueError, "commit: a layer outside the cache");
        return -1;
    }
    if (users == Py_None || (users && PyTuple_Check(users) && PyTuple_GET_SIZE(users) == 0)) users = NULL;
    if (job_arrays(j, e, s, d, h)) goto fail;
    size_t m = j->m;
    for (int k = 0; k < 3; k++) {
        Py_ssize_t n;
        if (for_keys(c, lists[k], &j->victims[k], &n)) goto fail;
        j->n_victims[k] = (size_t)n;
    }
    if (users) {
        if (!PyTuple_Check(users) || (size_t)PyTuple_GET_SIZE(users) != m) {
            PyErr_SetString(PyExc_ValueError, "commit: expected a tuple of sequences per plan item");
            goto fail;
        }
        size_t total = 0;
        for (size_t i = 0; i < m; i++) {
            PyObject *u = PyTuple_GET_ITEM(users, (Py_ssize_t)i);
            if (!PyTuple_Check(u)) { PyErr_SetString(PyExc_ValueError, "commit: an item's sequences must be a tuple"); goto fail; }
            total += (size_t)PyTuple_GET_SIZE(u);
        }
        j->seqs = malloc(sizeof(int64_t) * (total + 1)), j->seq_at = malloc(sizeof(size_t) * (m + 1));
        if (!j->seqs || !j->seq_at) { PyErr_NoMemory(); goto fail; }
        size_t at = 0;
        for (size_t i = 0; i < m; i++) {
            PyObject *u = PyTuple_GET_ITEM(users, (Py_ssize_t)i);
            j->seq_at[i] = at;
            for (Py_ssize_t q = 0; q < PyTuple_GET_SIZE(u); q++) {
                j->seqs[at] = PyLong_AsLongLong(PyTuple_GET_ITEM(u, q));
                if (j->seqs[at] == -1 && PyErr_Occurred()) goto fail;
                at++;
            }
        }
        j->seq_at[m] = at;
    }
    return 0;
fail:
    commit_job_free(j);
    return -1;
}

/* apply a plan (ExpertCache.commit): no Python (it runs on the core's thread for commit_soon); a failure is
   kept on the core */
static int commit_apply(Core *c, const CommitJob *j) {
    static const int64_t one_sequence[1] = {0};
    int layer = j->layer;
    c->generation++;
    int64_t now = c->now;
    for (int which = 0; which < 2; which++) {
        for (size_t i = 0; i < j->n_victims[which]; i++) {
            int32_t victim = j->victims[which][i];
            int64_t freed = tier_drop(c, which, victim, READY);
            if (freed < 0) return -1;
            int64_t *cnt = counter(c, which, KEY_LAYER(c, victim));
            cnt[C_EVICTED]++, cnt[C_EVICTED_BYTES] += freed;
            if (which == 0 && host_covered(c, victim, 0)) return core_nomem(c);
        }
    }
    for (size_t i = 0; i < j->n_victims[2]; i++) {
        int32_t key = j->victims[2][i];
        if (tier_admit(c, 1, key, LOADING)) return -1;
        int l = KEY_LAYER(c, key);
        int64_t *cnt = counter(c, 1, l);
        cnt[C_DEMOTED]++, cnt[C_DEMOTED_BYTES] += c->tier[1].unit[l];
    }
    int64_t nbytes = c->tier[1].unit[layer];
    for (size_t i = 0; i < j->m; i++) {
        int32_t key = layer * c->n_expert + (int32_t)j->experts[i];
        const int64_t *item_seqs = j->seqs ? j->seqs + j->seq_at[i] : one_sequence;
        size_t n_seqs = j->seqs ? j->seq_at[i + 1] - j->seq_at[i] : 1;
        /* a tier of size 0 never asks its policy, so it learns nothing */
        if (c->tier[0].enabled && observe(c, 0, key, now, item_seqs, n_seqs)) return core_nomem(c);
        if (c->tier[1].enabled && observe(c, 1, key, now, item_seqs, n_seqs)) return core_nomem(c);
        if (j->toh[i]) {
            if (tier_admit(c, 1, key, LOADING) || tier_pin(c, 1, key)) return -1;
        } else if (j->src[i] == SRC_HOST) {
            if (tier_track(c, &c->tier[1], key, now)) return core_nomem(c);
            if (tier_pin(c, 1, key)) return -1;
        }
        if (j->tod[i]) {
            if (tier_admit(c, 0, key, LOADING) || tier_pin(c, 0, key)) return -1;
            if (host_covered(c, key, 1)) return core_nomem(c);
        } else if (j->src[i] == SRC_DEVICE) {
            if (tier_track(c, &c->tier[0], key, now)) return core_nomem(c);
            if (tier_pin(c, 0, key)) return -1;
        }
        count_item(c, layer, j->src[i], j->tod[i], j->toh[i], nbytes);
    }
    return 0;
}

/* commit(layer, experts, sources, to_device, to_host, device_victims, host_victims, demotions[, users]) */
static PyObject *Core_commit(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    CommitJob j;
    if (commit_job_parse(c, args, &j)) return NULL;
    int rc = commit_apply(c, &j);
    commit_job_free(&j);
    if (rc) {
        raise_failure(c, "");
        return NULL;
    }
    Py_RETURN_NONE;
}

static int run_commit(void *arg) {
    Core *c = arg;
    return commit_apply(c, &c->committing);
}

/* commit_soon(...commit's arguments): the commit, applied on the core's thread while the caller goes on.
   Whatever calls into the core next waits for it, and raises its failure if it failed. */
static PyObject *Core_commit_soon(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    if (commit_job_parse(c, args, &c->committing)) return NULL;
    c->job = JOB_COMMIT;
    worker_submit(&c->worker, run_commit, c);
    Py_RETURN_NONE;
}

/* wait for the job on the core's thread, if there is one; its failure (or a fork's) as the Python error */
static int core_join(Core *c) {
    if (c->broken) {
        PyErr_SetString(PyExc_RuntimeError, "the expert cache was forked while its thread applied a plan: its state is unknown");
        return -1;
    }
    if (!worker_busy(&c->worker)) return 0;
    int rc = worker_wait(&c->worker), layer = c->committing.layer;
    if (rc == WORKER_TAKEN) return 0;  /* (another Python thread waited for it and saw to it) */
    if (c->job != JOB_PLAN) commit_job_free(&c->committing);
    if (rc == WORKER_FORKED) {
        c->broken = 1;
        return core_join(c);
    }
    if (!rc) return 0;
    char during[64];
    if (c->job != JOB_PLAN) {
        snprintf(during, sizeof during, "the cache's %s of layer %d failed: ", c->job == JOB_COMMIT ? "commit" : "settling", layer);
    } else {
        snprintf(during, sizeof during, "the cache's plan of layer %d failed: ", c->planned.layer);
        plan_job_free(&c->planned);
        c->plan_state = PLAN_NONE;
    }
    raise_failure(c, during);
    return -1;
}

/* mark_ready(layer, experts, to_device, to_host, demotions) */
/* a plan's items as mark_ready and release read them: a job's copies, or a Python plan's buffers in place */
typedef struct { int layer; size_t m; const int64_t *experts; const char *src, *tod, *toh; } Items;

/* mark_ready's changes: the demoted experts and the plan's admissions LOADING -> READY (no Python) */
static int ready_apply(Core *c, const Items *it, const int32_t *demoted, size_t n_demoted) {
    for (size_t i = 0; i < n_demoted; i++)
        if (tier_ready(c, 1, demoted[i])) return -1;
    for (size_t i = 0; i < it->m; i++) {
        int32_t key = it->layer * c->n_expert + (int32_t)it->experts[i];
        if (it->tod[i] && tier_ready(c, 0, key)) return -1;
        if (it->toh[i] && tier_ready(c, 1, key)) return -1;
    }
    return 0;
}

/* release's changes: the plan's experts unpinned (no Python) */
static int release_apply(Core *c, const Items *it) {
    for (size_t i = 0; i < it->m; i++) {
        int32_t key = it->layer * c->n_expert + (int32_t)it->experts[i];
        if ((it->toh[i] || it->src[i] == SRC_HOST) && tier_unpin(c, 1, key)) return -1;
        if ((it->tod[i] || it->src[i] == SRC_DEVICE) && tier_unpin(c, 0, key)) return -1;
    }
    return 0;
}

static PyObject *Core_mark_ready(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int layer;
    PyObject *e, *d, *h, *dm;
    if (!PyArg_ParseTuple(args, "iOOOO", &layer, &e, &d, &h, &dm)) return NULL;
    PlanArgs p;
    int32_t *keys = NULL;
    Py_ssize_t nk;
    PyObject *result = NULL;
    if (plan_args(e, d, d, h, &p)) goto out;
    if (for_keys(c, dm, &keys, &nk)) goto out;
    Items it = {layer, p.m, p.experts, p.src, p.tod, p.toh};
    if (ready_apply(c, &it, keys, (size_t)nk)) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    free(keys);
    plan_args_release(&p);
    if (!result) raise_failure(c, "");
    return result;
}

/* release(layer, experts, sources, to_device, to_host) */
static PyObject *Core_release(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int layer;
    PyObject *e, *s, *d, *h;
    if (!PyArg_ParseTuple(args, "iOOOO", &layer, &e, &s, &d, &h)) return NULL;
    PlanArgs p;
    PyObject *result = NULL;
    if (plan_args(e, s, d, h, &p)) goto out;
    Items it = {layer, p.m, p.experts, p.src, p.tod, p.toh};
    if (release_apply(c, &it)) goto out;
    result = Py_None;
    Py_INCREF(result);
out:
    plan_args_release(&p);
    if (!result) raise_failure(c, "");
    return result;
}

/* a landed and computed plan settled: mark_ready's then release's changes (no Python: settle_soon's job) */
static int settle_apply(Core *c, const CommitJob *j) {
    Items it = {j->layer, j->m, j->experts, j->src, j->tod, j->toh};
    return ready_apply(c, &it, j->victims[2], j->n_victims[2]) || release_apply(c, &it) ? -1 : 0;
}

static int run_settle(void *arg) {
    Core *c = arg;
    return settle_apply(c, &c->committing);
}

/* settle_soon(layer, experts, sources, to_device, to_host, demotions): mark_ready and release of a step
   whose reads landed, applied on the core's thread while the caller goes on (commit_soon's way) */
static PyObject *Core_settle_soon(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    CommitJob *j = &c->committing;
    PyObject *e, *s, *d, *h, *dm;
    memset(j, 0, sizeof *j);
    if (!PyArg_ParseTuple(args, "iOOOOO", &j->layer, &e, &s, &d, &h, &dm)) return NULL;
    if (j->layer < 0 || j->layer >= c->n_layer) {
        PyErr_SetString(PyExc_ValueError, "settle_soon: a layer outside the cache");
        return NULL;
    }
    if (job_arrays(j, e, s, d, h)) { commit_job_free(j); return NULL; }
    Py_ssize_t n;
    if (for_keys(c, dm, &j->victims[2], &n)) { commit_job_free(j); return NULL; }
    j->n_victims[2] = (size_t)n;
    c->job = JOB_SETTLE;
    worker_submit(&c->worker, run_settle, c);
    Py_RETURN_NONE;
}

/* abort(layer, experts, to_device, to_host, demotions): ExpertCache.abort; returns the device keys dropped,
   as (layer, expert) pairs */
static PyObject *Core_abort(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int layer;
    PyObject *e, *d, *h, *dm;
    if (!PyArg_ParseTuple(args, "iOOOO", &layer, &e, &d, &h, &dm)) return NULL;
    PlanArgs p;
    int32_t *keys = NULL;
    Py_ssize_t nk;
    Keys dropped = {0};
    PyObject *result = NULL;
    int changed = 0;
    if (plan_args(e, d, d, h, &p)) goto out;
    if (for_keys(c, dm, &keys, &nk)) goto out;
    for (Py_ssize_t i = 0; i < nk; i++) {
        if (c->tier[1].state[keys[i]] != LOADING || c->tier[1].pins[keys[i]]) continue;
        int64_t freed = tier_drop(c, 1, keys[i], LOADING);
        if (freed < 0) goto out;
        int64_t *cnt = counter(c, 1, KEY_LAYER(c, keys[i]));
        cnt[C_EVICTED]++, cnt[C_EVICTED_BYTES] += freed;
        changed = 1;
    }
    for (size_t i = 0; i < p.m; i++) {
        int32_t key = layer * c->n_expert + (int32_t)p.experts[i];
        for (int which = 0; which < 2; which++) {
            if (!(which == 0 ? p.tod[i] : p.toh[i]) || c->tier[which].state[key] != LOADING || c->tier[which].pins[key]) continue;
            int64_t freed = tier_drop(c, which, key, LOADING);
            if (freed < 0) goto out;
            int64_t *cnt = counter(c, which, layer);
            cnt[C_EVICTED]++, cnt[C_EVICTED_BYTES] += freed;
            if (which == 0 && (host_covered(c, key, 0) || keys_push(&dropped, key))) { PyErr_NoMemory(); goto out; }
            changed = 1;
        }
    }
    if (changed) c->generation++;
    result = pairs_tuple(c, &dropped);
out:
    free(keys), free(dropped.a);
    plan_args_release(&p);
    if (!result) raise_failure(c, "");
    return result;
}

/* admit_outside(which, keys): ExpertCache.admit_host (which 1) or admit_device (which 0): keys read outside
   any plan into a tier, READY; returns (admitted, evicted), as (layer, expert) pairs */
static PyObject *admit_outside(Core *c, PyObject *args, int which) {
    if (core_join(c)) return NULL;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O", &seq)) return NULL;
    Tier *tier = &c->tier[which];
    if (!tier->enabled) return Py_BuildValue("(()())");
    int32_t *keys = NULL;
    Py_ssize_t nk;
    if (for_keys(c, seq, &keys, &nk)) return NULL;
    Keys wanted = {0}, admitted = {0}, victims = {0};
    PyObject *out = NULL;
    uint32_t seen = next_stamp(c);
    for (Py_ssize_t i = 0; i < nk; i++) {  /* dict.fromkeys: first occurrence */
        int32_t key = keys[i];
        if (c->stamp[key] == seen) continue;
        c->stamp[key] = seen;
        if (c->tier[0].state[key] == EMPTY && c->tier[1].state[key] == EMPTY && keys_push(&wanted, key)) goto nomem;
    }
    if (plan_admissions(c, tier, wanted.a, wanted.n, 0, &admitted, &victims)) goto nomem;
    for (size_t i = 0; i < victims.n; i++) {
        int64_t freed = tier_drop(c, which, victims.a[i], READY);
        if (freed < 0) goto fail;
        int64_t *cnt = counter(c, which, KEY_LAYER(c, victims.a[i]));
        cnt[C_EVICTED]++, cnt[C_EVICTED_BYTES] += freed;
        if (which == 0 && host_covered(c, victims.a[i], 0)) goto nomem;
    }
    for (size_t i = 0; i < admitted.n; i++) {
        if (tier_admit(c, which, admitted.a[i], READY)) goto fail;
        if (which == 0 && host_covered(c, admitted.a[i], 1)) goto nomem;
    }
    if (admitted.n) c->generation++;
    out = Py_BuildValue("(NN)", pairs_tuple(c, &admitted), pairs_tuple(c, &victims));
    goto done;
nomem:
    if (!PyErr_Occurred()) PyErr_NoMemory();
fail:
    raise_failure(c, "");
    out = NULL;
done:
    free(keys), free(wanted.a), free(admitted.a), free(victims.a);
    return out;
}

static PyObject *Core_admit_host(Core *c, PyObject *args) { return admit_outside(c, args, 1); }

static PyObject *Core_admit_device(Core *c, PyObject *args) { return admit_outside(c, args, 0); }

/* seed_one(key): ExpertCache.seed's placement of one key (device, then host; nothing evicted);
   returns 0 device, 1 host, -1 not placed */
static PyObject *Core_seed_one(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    PyObject *o;
    int32_t key;
    if (!PyArg_ParseTuple(args, "O", &o) || parse_key(c, o, &key)) return NULL;
    for (int which = 0; which < 2; which++) {
        Tier *t = &c->tier[which];
        if (t->state[key] != EMPTY) return PyLong_FromLong(-1);
        if (t->unit[KEY_LAYER(c, key)] <= t->capacity - t->used) {
            if (tier_admit(c, which, key, READY)) {
                raise_failure(c, "");
                return NULL;
            }
            if (which == 0 && host_covered(c, key, 1)) return PyErr_NoMemory();
            return PyLong_FromLong(which);
        }
    }
    return PyLong_FromLong(-1);
}

/* held(which, layer) -> bytes of n_expert flags: the experts of layer the tier holds (LOADING or READY) */
static PyObject *Core_held(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int which, layer;
    if (!PyArg_ParseTuple(args, "ii", &which, &layer)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, c->n_expert);
    if (!out) return NULL;
    char *p = PyBytes_AS_STRING(out);
    const uint8_t *state = c->tier[which].state + (size_t)layer * c->n_expert;
    for (int i = 0; i < c->n_expert; i++) p[i] = state[i] != EMPTY;
    return out;
}

/* uncached(layer, experts: an iterable of ints) -> the list of those neither tier holds, in order (a step
   asks twice: its reads, and the next layer's guesses to read ahead; CoreCache.uncached is this, bound) */
static PyObject *Core_uncached(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int layer;
    PyObject *given;
    if (!PyArg_ParseTuple(args, "iO", &layer, &given)) return NULL;
    if (layer < 0 || layer >= c->n_layer) return PyErr_Format(PyExc_ValueError, "uncached: layer %d outside the cache", layer);
    PyObject *experts = PySequence_Fast(given, "uncached: experts is an iterable of ints");
    if (!experts) return NULL;
    const uint8_t *dev = c->tier[0].state + (size_t)layer * c->n_expert, *host = c->tier[1].state + (size_t)layer * c->n_expert;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < PySequence_Fast_GET_SIZE(experts); i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(experts, i);
        long e = PyLong_AsLong(o);
        /* (an id outside the layer no tier holds, as ExpertCache.uncached says: the plan names it wrong) */
        int held = e >= 0 && e < c->n_expert && (dev[e] != EMPTY || host[e] != EMPTY);
        if ((e == -1 && PyErr_Occurred()) || (!held && PyList_Append(out, o))) Py_CLEAR(out);
    }
    Py_DECREF(experts);
    return out;
}

/* state(which, key): 0 EMPTY, 1 LOADING, 2 READY */
static PyObject *Core_state(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int which;
    PyObject *o;
    int32_t key;
    if (!PyArg_ParseTuple(args, "iO", &which, &o) || parse_key(c, o, &key)) return NULL;
    return PyLong_FromLong(c->tier[which].state[key]);
}

/* count_hits(layer, n): n device hits counted as plans count them (a step that made no plan) */
static PyObject *Core_count_hits(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    int layer;
    long long n;
    if (!PyArg_ParseTuple(args, "iL", &layer, &n)) return NULL;
    if (layer < 0 || layer >= c->n_layer) {
        PyErr_SetString(PyExc_ValueError, "count_hits: a layer outside the cache");
        return NULL;
    }
    int64_t *dev = counter(c, 0, layer);
    dev[C_HITS] += n, dev[C_HIT_BYTES] += n * c->tier[1].unit[layer];
    Py_RETURN_NONE;
}

static PyObject *Core_tick(Core *c, PyObject *args) {
    if (core_join(c)) return NULL;
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    c->now += n;
    Py_RETURN_NONE;
}

/* (every getter waits for the core's thread too: what it reads, a commit there may be changing) */
static PyObject *Core_get_counters(Core *c, void *closure) {
    if (core_join(c)) return NULL;
    Py_INCREF(c->counters_obj);
    return c->counters_obj;
}
static PyObject *Core_get_now(Core *c, void *closure) { return core_join(c) ? NULL : PyLong_FromLongLong(c->now); }
static PyObject *Core_get_generation(Core *c, void *closure) { return core_join(c) ? NULL : PyLong_FromLongLong(c->generation); }
static PyObject *Core_get_demote(Core *c, void *closure) { return core_join(c) ? NULL : PyBool_FromLong(c->demote); }
/* (eviction walks made, entries of the residents' orders they read) */
static PyObject *Core_get_walk_counts(Core *c, void *closure) {
    return core_join(c) ? NULL : Py_BuildValue("(LL)", (long long)c->walks, (long long)c->walk_reads);
}
/* jobs the core's own thread has run (plan_soon, commit_soon; none where they run inline) */
static PyObject *Core_get_thread_jobs(Core *c, void *closure) { return core_join(c) ? NULL : PyLong_FromLongLong(c->worker.runs); }
static int Core_set_demote(Core *c, PyObject *v, void *closure) {
    if (core_join(c)) return -1;
    int b = PyObject_IsTrue(v);
    if (b < 0) return -1;
    c->demote = b;
    return 0;
}
static PyObject *Core_get_used(Core *c, void *closure) {
    if (core_join(c)) return NULL;
    return Py_BuildValue("(LL)", (long long)c->tier[0].used, (long long)c->tier[1].used);
}

static PyMethodDef Core_methods[] = {
    {"plan", (PyCFunction)Core_plan, METH_VARARGS, "plan(layer, experts int64 bytes) -> sources, to_device, to_host, victims..."},
    {"set_types", (PyCFunction)Core_set_types, METH_VARARGS, "set_types(PlanItem, (DEVICE, HOST, DISK))"},
    {"commit", (PyCFunction)Core_commit, METH_VARARGS, "apply a plan"},
    {"plan_soon", (PyCFunction)Core_plan_soon, METH_VARARGS, "plan_soon(layer, ids): plan on the core's thread; take_plan() gives it"},
    {"take_plan", (PyCFunction)Core_take_plan, METH_NOARGS, "the value of the plan plan_soon started"},
    {"commit_soon", (PyCFunction)Core_commit_soon, METH_VARARGS, "commit, applied on the core's thread"},
    {"settle_soon", (PyCFunction)Core_settle_soon, METH_VARARGS, "mark_ready and release, applied on the core's thread"},
    {"mark_ready", (PyCFunction)Core_mark_ready, METH_VARARGS, "admitted slots LOADING -> READY"},
    {"release", (PyCFunction)Core_release, METH_VARARGS, "unpin a plan's experts"},
    {"abort", (PyCFunction)Core_abort, METH_VARARGS, "drop a failed plan's admissions still loading"},
    {"admit_host", (PyCFunction)Core_admit_host, METH_VARARGS, "admit keys read outside a plan into the host tier"},
    {"admit_device", (PyCFunction)Core_admit_device, METH_VARARGS, "admit keys read outside a plan into the device tier"},
    {"seed_one", (PyCFunction)Core_seed_one, METH_VARARGS, "seed one key: 0 device, 1 host, -1 not placed"},
    {"held", (PyCFunction)Core_held, METH_VARARGS, "flags of a layer's experts a tier holds"},
    {"uncached", (PyCFunction)Core_uncached, METH_VARARGS, "uncached(layer, experts list) -> those neither tier holds"},
    {"state", (PyCFunction)Core_state, METH_VARARGS, "a key's slot state in a tier: 0 empty, 1 loading, 2 ready"},
    {"tick", (PyCFunction)Core_tick, METH_VARARGS, "advance logical time"},
    {"count_hits", (PyCFunction)Core_count_hits, METH_VARARGS, "count device hits made without a plan"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"counters", (getter)Core_get_counters, NULL, "int64 [3][n_layer][10]: device, host, disk counters", NULL},
    {"now", (getter)Core_get_now, NULL, "logical time", NULL},
    {"thread_jobs", (getter)Core_get_thread_jobs, NULL, "jobs run on the core's own thread", NULL},
    {"walk_counts", (getter)Core_get_walk_counts, NULL, "(eviction walks, entries they read)", NULL},
    {"generation", (getter)Core_get_generation, NULL, "commits and admissions so far", NULL},
    {"demote", (getter)Core_get_demote, (setter)Core_set_demote, "exclusive tiers", NULL},
    {"used", (getter)Core_get_used, NULL, "(device bytes used, host bytes used)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fomoepy.experts._cache_core.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The expert cache's tiers and frequency-family policy (fomoepy.experts.fast_cache drives it).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cache_core", "The expert cache's bookkeeping in C.", -1, NULL};

PyMODINIT_FUNC PyInit__cache_core(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddType(m, &CoreType) < 0) {  /* (readies the type; added under its tp_name's last part) */
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "POLICY_ADMIT", POLICY_ADMIT);
    PyModule_AddIntConstant(m, "POLICY_DEMOTE", POLICY_DEMOTE);
    PyModule_AddIntConstant(m, "POLICY_COOC", POLICY_COOC);
    return m;
}
