"""Exceptions that carry a user-facing message.

``ConfigError`` is raised for a bad configuration key; ``InvalidRequestError``
for bad input to a request.  Both name the offending field so that the CLI and
the servers can report them in one line (CLI exit code 2, gRPC
INVALID_ARGUMENT, HTTP 400).
"""


class SpecServeError(Exception):
    """Base class for errors whose message is meant for the user."""


class ConfigError(SpecServeError):
    """A configuration key has a bad value; the message names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class InvalidRequestError(SpecServeError):
    """A request field has a bad value; ``field`` names it (e.g. ``top_p``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class ModelLoadError(SpecServeError):
    """A model could not be found or loaded."""


class EngineDeadError(SpecServeError):
    """The engine loop failed; no further requests can be served."""


class QueueFullError(SpecServeError):
    """The waiting queue holds ``server.max_queue`` requests (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class EngineDrainingError(SpecServeError):
    """The server is draining for shutdown and takes no new requests (gRPC UNAVAILABLE, HTTP 503)."""


class RequestFailedError(SpecServeError):
    """Handling one request failed (not the forward): that request ends with this error
    (gRPC INTERNAL, HTTP 500, reason ``request_failed``); the engine keeps serving."""
