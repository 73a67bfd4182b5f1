"""The refusal each step of a model's registration raises: a code the wire says (`error.code`)
and a message for the caller. The steps (`sources`: what a source names, `hub`: a download,
`digests`: the files a model may hold) each name their own subclass; the registration
process reports any of them the same way (`register`)."""

from __future__ import annotations


class RegistrationError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
