// Least-loaded routing policy, written in C, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
// `pd_policy::native::least_loaded`; the gateway's tests (gateway/policy/tests/languages.rs)
// check that all of them give the same decision on the same inputs. Written against
// `pd:policy@1.0.0` (`wit/policy.wit`): the view comes as columns, node `i` at index `i` of each
// per-node list, and each role's nodes as a list of indices.
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
// bindings' post-return function frees them once the host has copied the answer. So the
// decision's lists are new ones, never the view's (which `decide` frees before returning).

#include <stdlib.h>
#include <string.h>

#include "policy.h"

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

// Requests on node `i`: queued, running, and parked waiting for KV (in 64 bits, so the sum of
// three 32-bit counts cannot wrap).
static uint64_t load(const policy_view_t *v, uint32_t i) {
    return (uint64_t)v->waiting.ptr[i] + v->running.ptr[i] + v->waiting_remote_kv.ptr[i];
}

// The view `qsort`'s comparison reads (qsort takes no context argument; an instance serves
// one call, on one thread).
static const policy_view_t *sort_view;

// Least load first, then most free blocks, then lowest index.
static int by_least_loaded(const void *a, const void *b) {
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    uint64_t li = load(sort_view, i), lj = load(sort_view, j);
    if (li != lj) {
        return li < lj ? -1 : 1;
    }
    uint32_t fi = sort_view->free_blocks.ptr[i], fj = sort_view->free_blocks.ptr[j];
    if (fi != fj) {
        return fi > fj ? -1 : 1;
    }
    return i < j ? -1 : (i > j);
}

// The nodes of `role` (one of the view's role lists), best first: the ones not draining, or
// all of them when every one drains; as a new list, from malloc, that the caller owns. Keys are
// unique (the index is part of them), so qsort, which is not stable, is exact.
static policy_list_u32_t ranked(const policy_view_t *v, const policy_list_u32_t *role) {
    policy_list_u32_t c = {.ptr = xmalloc(role->len * sizeof(uint32_t)), .len = 0};
    // Both lists are ascending: one cursor walks `draining` beside the role's nodes.
    const policy_list_u32_t *draining = &v->draining;
    size_t d = 0;
    for (size_t k = 0; k < role->len; k++) {
        uint32_t i = role->ptr[k];
        while (d < draining->len && draining->ptr[d] < i) {
            d++;
        }
        if (d == draining->len || draining->ptr[d] != i) {
            c.ptr[c.len++] = i;
        }
    }
    if (c.len == 0 && role->len > 0) {
        memcpy(c.ptr, role->ptr, role->len * sizeof(uint32_t));
        c.len = role->len;
    }
    sort_view = v;
    qsort(c.ptr, c.len, sizeof(uint32_t), by_least_loaded);
    return c;
}

// Decides where `request` goes, given `view`: the world's `decide` export.
void exports_policy_decide(policy_request_t *request, policy_view_t *view, policy_decision_t *ret) {
    pd_policy_types_route_t *route = &ret->route;

    if (view->prefill.len > 0 && view->decode.len > 0) {
        uint32_t children = request->n > 1 ? request->n : 1;
        pd_policy_types_split_t *split = &route->val.split;
        route->tag = PD_POLICY_TYPES_ROUTE_SPLIT;
        split->prefill = ranked(view, &view->prefill);
        split->decode = ranked(view, &view->decode);
        split->children.ptr = xmalloc(split->decode.len * sizeof(uint32_t));
        split->children.len = split->decode.len;
        for (size_t j = 0; j < split->children.len; j++) {
            split->children.ptr[j] = children;
        }
    } else if (view->standalone.len > 0) {
        route->tag = PD_POLICY_TYPES_ROUTE_WHOLE;
        route->val.whole = ranked(view, &view->standalone);
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
