"""Sim patch: a holder's pages that a peer copied lose their protection (back to probation's tail)."""
from benchmarks.router_sim import replica as R
_orig = R.SimReplica._reuse
def _reuse(self, run, count, page_ms, to_tier=True):
    start = run.num_reused
    cost = _orig(self, run, count, page_ms, to_tier)
    hint = getattr(run.request, "peer_hint", None)
    if page_ms == self.cost.peer_copy_page_ms and hint is not None and hint is not self:
        for key in run.request.page_keys[start:start + count]:
            if key in hint.reused:
                hint.reused.discard(key)
                if key in hint.protected:
                    del hint.protected[key]
                    hint.lru[key] = None
    return cost
R.SimReplica._reuse = _reuse
