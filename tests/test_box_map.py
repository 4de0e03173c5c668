"""``io.box_map.BoxMap``: a split's coordinates onto the stored array's (pure)."""

from __future__ import annotations

import numpy as np

from dataflow.io.box_map import BoxMap


def test_a_box_with_an_axis_at_one_index_maps_corners_boxes_shapes_and_rows():
    box = BoxMap(lo=(4, 2, 3, 0), dropped=(1,))  # (time, level, lat, lon), level 2
    assert box.kept == [0, 2, 3] and box.origin == (4, 3, 0) and box.moves
    los = np.array([[0, 0, 0], [1, 5, 8]])
    np.testing.assert_array_equal(box.corners(los), [[4, 2, 3, 0], [5, 2, 8, 8]])
    assert box.box([0, 1, 2], [3, 9, 10]) == ([4, 2, 4, 2], [7, 3, 12, 10])
    assert box.shape((2, 8, 8)) == (2, 1, 8, 8) and box.seen((2, 2, 16, 8)) == (2, 16, 8)
    out = np.zeros((5, 2, 8, 8))
    view = box.rows(out)
    assert view.shape == (5, 2, 1, 8, 8) and np.shares_memory(view, out)
    assert box.squeeze(np.zeros((2, 1, 8, 8))).shape == (2, 8, 8)


def test_the_whole_array_maps_to_itself():
    box = BoxMap.identity(3)
    los = np.array([[1, 2, 3]])
    assert not box.moves and box.corners(los) is los and box.origin == (0, 0, 0)
    assert box.box([1, 2, 3], [4, 5, 6]) == ([1, 2, 3], [4, 5, 6])
    out = np.zeros((2, 3, 4, 5))
    assert box.rows(out) is out and box.squeeze(out) is out
