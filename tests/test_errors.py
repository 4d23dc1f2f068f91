from python_backend.errors import InvalidRequestError, UnavailableError, error_from_tagged, tagged_message


def test_error_kinds_survive_a_tagged_message():
    for error in (InvalidRequestError("max_tokens must be > 0"), UnavailableError("queue is full")):
        restored = error_from_tagged(tagged_message(error))
        assert type(restored) is type(error) and str(restored) == str(error)
    other = error_from_tagged(tagged_message(KeyError("x")))
    assert type(other) is RuntimeError and "KeyError" in str(other)
