// Least-loaded routing policy, written in C, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
// `pd_policy::native::least_loaded`; the gateway's tests (gateway/policy/tests/languages.rs)
// check that all of them give the same decision on the same inputs.
//
// - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//   them is draining.
// - Route: if the view has a prefill and a decode node, split (prefill ranked, decode ranked,
//   each decode entry taking all `n` children: one pull, children forked on that node, the
//   other entries are failover); else, if it has a standalone node, whole (standalone ranked);
//   else reject with 503.
// - Rank: load = `waiting + running + waiting-remote-kv`, lowest first; then most
//   `free-blocks` first; then lowest index first.
//
// Build it with policies/c/build.sh, which generates "policy.h" (`wit-bindgen c`).
//
// Memory, as the C bindings want it: `decide` owns its arguments and frees them (each call runs
// in a fresh instance, so skipping that would leak nothing for long, but it is the contract and
// cheap); every list or string of the returned decision must come from malloc, because the
// bindings' post-return function frees them once the host has copied the answer.

#include <stdlib.h>
#include <string.h>

#include "policy.h"

typedef pd_policy_types_node_t node_t;
typedef pd_policy_types_role_t role_t;

// Message of the 503 when no node can serve the request.
static const char NO_NODES[] =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

// malloc that traps when memory runs out (the gateway then counts the failure and its built-in
// policy decides). Never asks for 0 bytes, whose result may be NULL.
static void *xmalloc(size_t size) {
    void *p = malloc(size ? size : 1);
    if (!p) {
        abort();
    }
    return p;
}

// Whether the view has a node of `role` (draining or not).
static bool has(const node_t *nodes, size_t len, role_t role) {
    for (size_t i = 0; i < len; i++) {
        if (nodes[i].role == role) {
            return true;
        }
    }
    return false;
}

// Requests on a node: queued, running, and parked waiting for KV (in 64 bits, so the sum of
// three 32-bit counts cannot wrap).
static uint64_t load(const node_t *n) {
    return (uint64_t)n->waiting + n->running + n->waiting_remote_kv;
}

// The indices of the nodes of `role`, not draining ones unless all of them drain, in index
// order, as a list the caller owns.
static policy_list_u32_t candidates(const node_t *nodes, size_t len, role_t role) {
    policy_list_u32_t c = {.ptr = xmalloc(len * sizeof(uint32_t)), .len = 0};
    for (size_t i = 0; i < len; i++) {
        if (nodes[i].role == role && !nodes[i].draining) {
            c.ptr[c.len++] = (uint32_t)i;
        }
    }
    if (c.len == 0) {
        for (size_t i = 0; i < len; i++) {
            if (nodes[i].role == role) {
                c.ptr[c.len++] = (uint32_t)i;
            }
        }
    }
    return c;
}

// The nodes `qsort`'s comparison reads (qsort takes no context argument; an instance serves
// one call, on one thread).
static const node_t *sort_nodes;

// Least load first, then most free blocks, then lowest index.
static int by_least_loaded(const void *a, const void *b) {
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    const node_t *ni = &sort_nodes[i], *nj = &sort_nodes[j];
    uint64_t li = load(ni), lj = load(nj);
    if (li != lj) {
        return li < lj ? -1 : 1;
    }
    if (ni->free_blocks != nj->free_blocks) {
        return ni->free_blocks > nj->free_blocks ? -1 : 1;
    }
    return i < j ? -1 : (i > j);
}

// Sorts `c` in least-loaded order (keys are unique: the index is part of them, so qsort, which
// is not stable, is exact) and returns it.
static policy_list_u32_t ranked(const node_t *nodes, policy_list_u32_t c) {
    sort_nodes = nodes;
    qsort(c.ptr, c.len, sizeof(uint32_t), by_least_loaded);
    return c;
}

// Decides where `request` goes, given `view`: the world's `decide` export.
void exports_policy_decide(policy_request_t *request, policy_view_t *view, policy_decision_t *ret) {
    const node_t *nodes = view->nodes.ptr;
    size_t len = view->nodes.len;
    pd_policy_types_route_t *route = &ret->route;

    if (has(nodes, len, PD_POLICY_TYPES_ROLE_PREFILL) && has(nodes, len, PD_POLICY_TYPES_ROLE_DECODE)) {
        uint32_t children = request->n > 1 ? request->n : 1;
        policy_list_u32_t decode = ranked(nodes, candidates(nodes, len, PD_POLICY_TYPES_ROLE_DECODE));
        route->tag = PD_POLICY_TYPES_ROUTE_SPLIT;
        route->val.split.prefill = ranked(nodes, candidates(nodes, len, PD_POLICY_TYPES_ROLE_PREFILL));
        route->val.split.decode.ptr = xmalloc(decode.len * sizeof(pd_policy_types_decode_target_t));
        route->val.split.decode.len = decode.len;
        for (size_t k = 0; k < decode.len; k++) {
            route->val.split.decode.ptr[k] =
                (pd_policy_types_decode_target_t){.node = decode.ptr[k], .children = children};
        }
        policy_list_u32_free(&decode);
    } else if (has(nodes, len, PD_POLICY_TYPES_ROLE_STANDALONE)) {
        route->tag = PD_POLICY_TYPES_ROUTE_WHOLE;
        route->val.whole = ranked(nodes, candidates(nodes, len, PD_POLICY_TYPES_ROLE_STANDALONE));
    } else {
        route->tag = PD_POLICY_TYPES_ROUTE_REJECT;
        route->val.reject.status = 503;
        // A malloc'd copy: the post-return function frees it.
        policy_string_dup(&route->val.reject.message, NO_NODES);
    }
    ret->reverse_pull.is_some = false;

    policy_request_free(request);
    policy_view_free(view);
}
