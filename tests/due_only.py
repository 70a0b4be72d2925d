"""An Overlap SGP timing part for tests that sums in only the messages due (iterations <=
stale), never one that arrived early, so that what is summed where does not depend on arrival
times: the copying and the in-place push then take the same steps."""
from hvd_sgp.common.overlap import Overlap


class DueOnly(Overlap):
    def _collect(self, stale: int) -> None:
        early = [p for p in self.in_flight if p.iteration > stale]  # (in order, at the back)
        for pending in early:
            self.in_flight.remove(pending)
        super()._collect(stale)
        self.in_flight.extend(early)
