"""Exceptions raised by nbkv. Every error nbkv raises on purpose is an :class:`NbkvError`."""

from __future__ import annotations


class NbkvError(Exception):
    """Base class of all nbkv errors."""


class ModelNotFoundError(NbkvError, FileNotFoundError):
    """No model file at the given path, or no embedded default model installed."""


class ModelLoadError(NbkvError):
    """llama.cpp could not load the model file (corrupt, truncated, unsupported)."""


class InsufficientMemoryError(ModelLoadError, MemoryError):
    """The planned KV cache does not fit the free memory (checked before llama.cpp allocates)."""


class TemplateError(NbkvError):
    """The chat template failed to render the messages."""


class TemplateLimitError(TemplateError):
    """A chat template ran past one of the bounds on a rendering, and was stopped.

    The bounds (:mod:`nbkv.prompt.templates`): the time one rendering may take, the items
    its ``range()`` calls may yield together, and the characters it may produce or build by
    repetition. A template that needs more is runaway or hostile; the message names the bound.
    """


class InvalidRequestError(NbkvError, ValueError):
    """The messages or sampling arguments of a request are malformed."""


class ContextOverflowError(NbkvError):
    """A conversation does not fit its slot's context budget."""

    def __init__(self, prompt_tokens: int, capacity: int, reserve: int = 0,
                 at_least: bool = False) -> None:
        self.prompt_tokens = prompt_tokens  # a lower bound when ``at_least``
        self.capacity = capacity
        self.reserve = reserve
        self.at_least = at_least  # the prompt was refused from its text's length, untokenized
        size = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
        super().__init__(
            f"prompt of {size} tokens (+{reserve} reserved for the reply) does not fit "
            f"the slot's context budget of {capacity} tokens; raise n_ctx, shorten the "
            f"conversation, or pass overflow='slide' to drop the oldest turns"
        )


class SlotTimeoutError(NbkvError, TimeoutError):
    """Every slot stayed busy for longer than the request's wait limit."""


class EngineClosedError(NbkvError, RuntimeError):
    """The engine was closed; create a new one."""


class DecodeError(NbkvError, RuntimeError):
    """llama_decode failed (for example: no room left in the KV cache)."""


class KVOrderError(DecodeError):
    """A sequence's KV was to be read or written while a prefix copy from or into it waits.

    llama.cpp runs the data part of a copy between sequences at the next ``llama_decode``; a
    state written into its source (or read from its destination) before then would make the
    copy carry the wrong KV. The engine orders its work so this never happens; the error is
    the guard that stops a wrong order before it serves anything.
    """


class MediaError(NbkvError, ValueError):
    """An image could not be read or used.

    An unreadable file, corrupt data, an unsupported input type, a refused (network) URL, or
    an image sent to an engine that has no vision projector.
    """


class ProjectorError(ModelLoadError):
    """A vision projector (mmproj) file is unusable or does not fit the text model.

    Checked in Python, before llama.cpp sees the file: a wrong projector must never reach
    native code paths that abort the process.
    """


class EngineBusy(NbkvError):
    """An opportunistic export (autosave) found the engine serving or rewriting."""


class SaveError(NbkvError, OSError):
    """A save could not be written (the directory is not writable, the disk is full...).

    The previous save in that directory, if any, is left intact.
    """


class SaveOverwrittenWarning(UserWarning):
    """A save replaced one that another writer wrote since this process last saw it.

    Another process (or engine) saved to the same directory after this process last saved
    or restored there: the last writer wins, and this save did.
    """


class RestoreError(NbkvError):
    """A save cannot be restored into this engine; the engine is left unchanged.

    The save is corrupt or incomplete, from another model, for other settings, or from a
    newer nbkv: the message says what differs.
    """


class UntrustedSaveError(RestoreError):
    """A save (or parked entry) is not signed by this user's key; nothing was restored.

    It was written by someone else, by an nbkv that did not sign saves yet, or edited since
    it was signed. ``engine.restore(path, trust=True)`` (``%kvcache restore --trust``)
    restores it anyway, recomputing every slot from its tokens before serving it.
    """


class ServerError(NbkvError):
    """A remote engine's server failed a request (the message says what it answered)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class ServerUnreachableError(ServerError, ConnectionError):
    """Nothing answers at the server's address (connection refused, host unknown)."""


class ServerTimeoutError(ServerError, TimeoutError):
    """The server did not answer within the time limit."""


class ServerUnsupportedError(ServerError):
    """The server lacks an endpoint or a setting nbkv needs (the message names the flag)."""


class TemplateMismatchError(TemplateError):
    """The kernel's rendering or tokenization of a conversation differs from the server's."""


class IncompleteReplyError(ServerError):
    """A server's streamed answer ended before its final event: the reply is cut short.

    No ``finish_reason``, ``[DONE]`` or ``stop`` came: the server stopped, crashed or dropped
    the connection mid-reply. An incomplete reply is not a result: :attr:`text` keeps what
    arrived, for the user; ``%%chat`` does not store it as the assistant's turn.
    """

    def __init__(self, message: str, text: str = "") -> None:
        self.text = text
        super().__init__(message)
