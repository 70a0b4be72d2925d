"""hvd.elastic.ElasticSampler's cut of what is left of an epoch, in one process: every rank
must get as many samples as every other, or ranks leave the epoch at different steps (the
ones with fewer meet hvd.join() while the others step, and the job hangs)."""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sgp.torch.elastic import shard


@settings(deadline=None)
@given(st.integers(0, 60), st.integers(1, 16))
def test_every_rank_gets_as_many_samples_and_all_are_covered(left, replicas):
    indices = list(range(100, 100 + left))
    shares = [shard(indices, replicas, rank) for rank in range(replicas)]
    assert {len(share) for share in shares} == {math.ceil(left / replicas)}
    assert set().union(*shares) == set(indices)  # nothing left out
    if left >= replicas:  # a full round repeats nothing but the last round's padding
        assert sum(map(len, shares)) - left < replicas


def test_three_samples_left_over_eight_ranks():
    """The chaos run's case: 1347 samples, 1344 done when 8 ranks took over from 7."""
    indices = list(range(1347))[1344:]
    assert [shard(indices, 8, rank) for rank in range(8)] == [[1344], [1345], [1346], [1344],
                                                              [1345], [1346], [1344], [1345]]
