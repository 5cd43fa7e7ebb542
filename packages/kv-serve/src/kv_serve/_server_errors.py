"""The error every API's request checks raise: an HTTP status with OpenAI's JSON body."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["OpenAIError"]


class OpenAIError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
