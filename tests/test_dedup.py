import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from plestore.dedup import unique_inverse


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.integers(0, 3000), elements=st.integers(0, 2**40)))
def test_matches_numpy_unique(ids):
    uniq, inv = unique_inverse(ids)
    want_u, want_inv = np.unique(ids, return_inverse=True)
    np.testing.assert_array_equal(uniq, want_u)
    np.testing.assert_array_equal(inv, want_inv.reshape(-1))
    np.testing.assert_array_equal(uniq[inv], ids)


def test_ids_too_large_to_pack_take_the_general_path():
    ids = np.array([2**61, 5, 2**61, 7], np.int64)
    uniq, inv = unique_inverse(ids)
    np.testing.assert_array_equal(uniq[inv], ids)
    assert list(uniq) == [5, 7, 2**61]


def test_is_distinct_small():
    from plestore.dedup import is_distinct_small

    assert is_distinct_small(np.array([5, 1, 9], np.int64))
    assert not is_distinct_small(np.array([5, 1, 5], np.int64))
    assert is_distinct_small(np.zeros(0, np.int64))
    assert not is_distinct_small(np.arange(300), limit=256)  # large: the caller sorts
