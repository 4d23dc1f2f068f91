from python_backend.errors import InvalidRequestError, UnavailableError, error_from_tagged, tagged_message


def test_error_kinds_survive_a_tagged_message():
    for error in (InvalidRequestError("max_tokens must be > 0"), UnavailableError("queue is full")):
        restored = error_from_tagged(tagged_message(error))
        assert type(restored) is type(error) and str(restored) == str(error)
    other = error_from_tagged(tagged_message(KeyError("x")))
    assert type(other) is RuntimeError and "KeyError" in str(other)


def test_a_dead_model_process_is_unavailable_not_internal():
    restored = error_from_tagged("Stub process 'llm_0_0' is not healthy.")
    assert type(restored) is UnavailableError and "llm_0_0" in str(restored)
