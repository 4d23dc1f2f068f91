class InvalidRequestError(ValueError):
    """A request the server refuses: the message names the offending input and is returned to the client."""
