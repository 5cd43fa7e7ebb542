"""``GET /v1/models``, ``/v1/models/{id}``, ``/health`` and ``/metrics``: the server itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ._server_metrics import ServerMetrics, metrics_text
from ._server_requests import model_not_found
from ._server_worker import EngineWorker
from ._serving_openai import error_response

__all__ = ["ServerEndpoints"]


@dataclass
class ServerEndpoints:
    """The served model's card, the engine's health and the server's metrics."""

    model_name: str
    max_context: int
    created: int
    worker: EngineWorker
    metrics: ServerMetrics

    def card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kv-serve",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.max_context,
        }

    def metrics_text(self) -> str:
        """The Prometheus text exposition of the server's state."""
        return metrics_text(self.worker.snapshot(), self.worker.waiting, self.metrics)

    async def health(self) -> Response:
        """``ok``, or 503 once the engine thread is down."""
        if self.worker.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    async def metrics_page(self) -> Response:
        """The metrics, in Prometheus' text format."""
        return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

    async def models(self) -> Response:
        """The list of one model."""
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model(self, model_id: str) -> Response:
        """The served model's card; 404 for any other id."""
        if model_id != self.model_name:
            return error_response(model_not_found(model_id, self.model_name))
        return JSONResponse(self.card())
