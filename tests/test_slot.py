"""A model process's shared-memory slot: what is packed is what is unpacked."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from vega.modelproc import slot


@pytest.fixture
def buffer() -> memoryview:
    return memoryview(mmap.mmap(-1, 1 << 16))


def test_arrays_of_one_shape_come_back_as_rows_of_one_block(buffer: memoryview) -> None:
    arrays = list(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    header = slot.pack(buffer, arrays)
    assert header["count"] == 5 and slot.nbytes(header) == 5 * 4 * 4
    back = slot.unpack(buffer, header, copy=True)
    assert [a.tolist() for a in back] == [a.tolist() for a in arrays]


def test_arrays_of_many_shapes_come_back_each_as_it_was(buffer: memoryview) -> None:
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((length, 8)).astype(np.float32) for length in (3, 17, 1, 64)]
    header = slot.pack(buffer, arrays)
    assert header["shapes"] == [[3, 8], [17, 8], [1, 8], [64, 8]]
    for copy in (True, False):
        back = slot.unpack(buffer, header, copy=copy)
        assert [a.shape for a in back] == [a.shape for a in arrays]
        assert all(np.array_equal(a, b) for a, b in zip(back, arrays))


def test_a_block_takes_the_first_arrays_dtype_and_refuses_an_unsafe_cast(
        buffer: memoryview) -> None:
    header = slot.pack(buffer, [np.ones(3, np.float32), np.full(3, 2.0, np.float64)])
    assert header["dtype"] == "<f4"
    assert [a.tolist() for a in slot.unpack(buffer, header, copy=True)] == [[1.0] * 3, [2.0] * 3]
    with pytest.raises(TypeError):
        slot.pack(buffer, [np.ones(3, np.int32), np.full(3, 0.5)])


def test_what_does_not_fit_is_refused(buffer: memoryview) -> None:
    with pytest.raises(slot.SlotOverflow):
        slot.pack(buffer, [np.zeros((1024, 16), np.float32)] * 2)
    with pytest.raises(slot.SlotOverflow):
        slot.unpack(buffer, {"dtype": "<f4", "shape": [1024, 16], "count": 2}, copy=True)
