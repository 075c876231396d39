"""The one exception type the CLI turns into a message and a non-zero exit."""


class TorchPatchesError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it.

    ``exit_code`` lets callers distinguish a refused target (``3``) from other
    failures (``1``).
    """

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class PatchApplyError(TorchPatchesError):
    """A hunk does not apply (the target is not what the patch expects)."""


class PatchFormatError(TorchPatchesError):
    """A patch file cannot be parsed (corrupt or not a unified diff)."""
