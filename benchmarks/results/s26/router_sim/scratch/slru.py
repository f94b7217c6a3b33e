"""Scan-resistant eviction: pages reused at least once (a later request's local hit, or copied / fetched for a request)
are protected; eviction takes never-reused pages in LRU order first, then protected ones. X_CAP: protected share cap."""
import os
from benchmarks.router_sim import replica as R
CAP = float(os.environ.get('X_CAP', '1.0'))
_orig_pin = R.SimReplica._pin
_orig_reuse = R.SimReplica._reuse
_orig_evict = R.SimReplica._evict
def _prot(self):
    p = getattr(self, '_protected', None)
    if p is None:
        p = self._protected = set()
    return p
def _pin(self, keys):
    _prot(self).update(keys)
    _orig_pin(self, keys)
def _reuse(self, run, count, page_ms, to_tier=True):
    start = run.num_reused
    cost = _orig_reuse(self, run, count, page_ms, to_tier)
    _prot(self).update(run.request.page_keys[start:start + count])
    return cost
def _evict(self, num_wanted):
    if num_wanted <= 0 or not self.lru:
        return
    prot = _prot(self)
    # cap: if protected cached pages exceed CAP of the pool, oldest protected lose protection
    if CAP < 1.0:
        limit = int(CAP * self.num_pages)
        over = sum(1 for k in self.key_to_refs if k in prot) - limit
        if over > 0:
            for key in self.lru:
                if key in prot:
                    prot.discard(key); over -= 1
                    if over <= 0: break
    victims = []
    for key in self.lru:
        if key not in prot:
            victims.append(key)
            if len(victims) >= num_wanted:
                break
    if victims:
        refs, lru = self.key_to_refs, self.lru
        for key in victims:
            del lru[key]; del refs[key]
        self.num_evicted += len(victims)
        self.proactive_keys.difference_update(victims)
        self.seq += 1
        self.pending_events.append(R.PagesRemoved(self.seq, tuple(victims)))
        num_wanted -= len(victims)
    if num_wanted > 0:
        before = set(self.lru)
        _orig_evict(self, num_wanted)
        prot.difference_update(before - set(self.lru))
R.SimReplica._pin = _pin
R.SimReplica._reuse = _reuse
R.SimReplica._evict = _evict
