/* The units of one side of a one-group job, shared by the host-copy planner (plan_units) and
 * the kernel issuer's lone lane (issue_units), which plans and issues a job in one call.
 *
 * A job of ``size`` pieces starting ``start`` pieces into the request names one block id per
 * ``factor`` pieces on each side; a unit is block * factor + sub-block, so with factor f
 * piece i of a side whose first block is skipped ``start % f`` sub-blocks into lies at
 * ids[(i + skip) / f] * f + (i + skip) % f. Returns 0, having written nothing useful, unless
 * every id is in [0, rows) and the side names exactly the blocks the pieces need. */
#ifndef KVCACHE_OFFLOAD_UNITS_H
#define KVCACHE_OFFLOAD_UNITS_H

#include <stdint.h>
#include <string.h>

static int units_of_side(const int64_t *ids, int64_t n_ids, int64_t size, int64_t start,
                         int64_t factor, int64_t rows, int64_t *out) {
    int64_t skip = start % factor;
    if ((size + skip + factor - 1) / factor != n_ids) return 0;
    for (int64_t j = 0; j < n_ids; j++) {
        if (ids[j] < 0 || ids[j] >= rows) return 0;
    }
    if (factor == 1) {
        memcpy(out, ids, (size_t)size * 8);
        return 1;
    }
    for (int64_t i = 0; i < size; i++) {
        int64_t k = i + skip;
        out[i] = ids[k / factor] * factor + k % factor;
    }
    return 1;
}

#endif
