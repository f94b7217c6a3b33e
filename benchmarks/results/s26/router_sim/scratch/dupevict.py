"""Oracle duplicate-first eviction: a replica evicts LRU pages that another replica also holds before singlets."""
import os
from benchmarks.router_sim import replica as R, sim as S
_orig_init = S.Simulation.__init__
MODE = os.environ.get('X_MODE', 'dup')  # dup: held elsewhere (any refs); dupidle: held elsewhere and only when reachable
def _init(self, *a, **k):
    _orig_init(self, *a, **k)
    for r in self.replicas:
        r._others = [o for o in self.replicas if o is not r]
S.Simulation.__init__ = _init
_orig_evict = R.SimReplica._evict
def _evict(self, num_wanted):
    if num_wanted <= 0 or not self.lru:
        return
    others = self._others
    dups = []
    for key in self.lru:
        if any(key in o.key_to_refs for o in others):
            dups.append(key)
            if len(dups) >= num_wanted:
                break
    if dups:
        refs, lru = self.key_to_refs, self.lru
        for key in dups:
            del lru[key]; del refs[key]
        self.num_evicted += len(dups)
        self.proactive_keys.difference_update(dups)
        self.seq += 1
        self.pending_events.append(R.PagesRemoved(self.seq, tuple(dups)))
        num_wanted -= len(dups)
    if num_wanted > 0:
        _orig_evict(self, num_wanted)
R.SimReplica._evict = _evict
