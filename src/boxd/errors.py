"""The one exception hierarchy of boxd.

Every error carries a stable ``code``. The daemon turns an error into an HTTP answer by
its code (``status``) and the SDK turns the answer back into the same class by the code
again, so nothing ever depends on the wording of a message.
"""

from __future__ import annotations

from typing import Any, ClassVar


class BoxdError(Exception):
    """Root of every error boxd raises, on the client side and in the daemon alike."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init__(self, message: str, *, field: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        if self.details:
            body["details"] = self.details
        return body


class InvalidInput(BoxdError):
    """A request field is wrong; ``field`` names it."""

    code = "invalid_input"
    status = 422


class NotFound(BoxdError):
    code = "not_found"
    status = 404


class Conflict(BoxdError):
    """The request clashes with the current state (a duplicate name, a machine not running)."""

    code = "conflict"
    status = 409


class QuotaExceeded(BoxdError):
    code = "quota_exceeded"
    status = 429


class Forbidden(BoxdError):
    """The caller is known but may not do this here (admin calls over TCP)."""

    code = "forbidden"
    status = 403


class TooLarge(BoxdError):
    """A request body is over the daemon's limit; ``field`` names what was too large."""

    code = "too_large"
    status = 413


class DaemonUnavailable(BoxdError):
    """The SDK could not reach a daemon (or start the local one)."""

    code = "daemon_unavailable"
    status = 503


class AuthError(BoxdError):
    code = "unauthorized"
    status = 401


class Timeout(BoxdError):
    """Something did not happen in time: a machine that never became ready, a command."""

    code = "timeout"
    status = 504


class CommandFailed(BoxdError):
    """A command ran and exited non-zero where the caller asked for success."""

    code = "command_failed"
    status = 422


class Unreachable(BoxdError):
    """Nothing answered where a request was to be passed on (a machine's URL port)."""

    code = "bad_gateway"
    status = 502


class Unsupported(BoxdError):
    code = "unsupported"
    status = 501


class HostError(BoxdError):
    """The host lacks what boxd needs (a tool, disk space, a device); the message names it."""

    code = "host_error"
    status = 500


class ImageError(BoxdError):
    """A guest image could not be built, or an image on disk is unknown or corrupt."""

    code = "image_error"
    status = 500


class SnapshotUnusable(BoxdError):
    """A snapshot that cannot be used here: corrupt, or made by another QEMU, machine type or accelerator."""

    code = "snapshot_unusable"
    status = 409


class VMError(BoxdError):
    """A virtual machine failed: QEMU would not start, died, or its agent broke the protocol."""

    code = "vm_error"
    status = 500


class VMLaunchFailure(VMError):
    code = "vm_launch_failed"

    def __init__(self, message: str, *, exitcode: int | None, command: list[str], output: str) -> None:
        super().__init__(message, exitcode=exitcode, command=command, output=output)
        self.exitcode = exitcode
        self.command = command
        self.output = output


class AgentUnavailable(VMError):
    """The in-guest agent does not answer (the machine is still booting, or it is broken)."""

    code = "agent_unavailable"
    status = 503


def _all_subclasses(cls: type[BoxdError]) -> list[type[BoxdError]]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def error_from_dict(body: dict[str, Any]) -> BoxdError:
    """Rebuild the error a daemon sent, choosing the class by its code."""
    by_code = {cls.code: cls for cls in [BoxdError, *_all_subclasses(BoxdError)]}
    cls = by_code.get(str(body.get("code")), BoxdError)
    error = BoxdError.__new__(cls)
    BoxdError.__init__(
        error, str(body.get("message", "")), field=body.get("field"), **(body.get("details") or {})
    )
    return error
