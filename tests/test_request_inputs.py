import numpy as np
import pytest

from python_backend.errors import InvalidRequestError
from python_backend.serving.request_inputs import decode_stop_sequences, encode_stop_sequences, scalar, text_list


def getter(**tensors):
    return lambda name: tensors.get(name)


def test_stop_sequences_round_trip():
    sequences = [[5, 6], [7], [8, 9, 10]]
    assert decode_stop_sequences(encode_stop_sequences(sequences)) == tuple(map(tuple, sequences))
    assert decode_stop_sequences(encode_stop_sequences([])) == ()
    assert decode_stop_sequences(None) == ()


def test_scalar_reads_numbers_bytes_and_str_and_defaults():
    get = getter(a=np.array([[3]], np.int32), b=np.array([[b"caf\xc3\xa9"]], np.object_), c=np.array([["x"]]))
    assert scalar(get, "a") == 3
    assert scalar(get, "b") == "café"
    assert scalar(get, "c") == "x"
    assert scalar(get, "missing", 1.5) == 1.5


def test_scalar_rejects_several_values_and_bad_utf8():
    with pytest.raises(InvalidRequestError, match="a must hold exactly one value"):
        scalar(getter(a=np.array([[1, 2]])), "a")
    with pytest.raises(InvalidRequestError, match="b is not valid UTF-8"):
        scalar(getter(b=np.array([[b"\xff"]], np.object_)), "b")


def test_text_list():
    assert text_list(getter(s=np.array([[b"a", "b"]], np.object_)), "s") == ["a", "b"]
    assert text_list(getter(), "s") == []
