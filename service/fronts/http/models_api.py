"""The HTTP front's model endpoints: `GET /v1/models` and `/v1/models/{model}` (OpenAI's model objects, with
each model's `state` and `max_model_len` whether or not it is loaded), and the admin calls `POST /models/load`
and `POST /models/unload` (body `{"model": name}`; absent: the default model), which answer with the model's
object once it is loaded or unloaded (`model_admin.py`: they need the server's bearer token).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.fronts.call import Call
from service.fronts.http.request_body import read_json, validated
from service.fronts.model_admin import described, load_model, unload_model
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext


class ModelName(BaseModel):
    """An admin call's body."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None


class ModelsApi:
    def __init__(self, serving: ServingContext):
        self.serving = serving

    async def list(self, request: Request, call: Call) -> Response:
        self.serving.ready()
        return self._ok(call, {"object": "list", "data": [self.card(m) for m in self.serving.models.values()]})

    async def one(self, request: Request, call: Call) -> Response:
        self.serving.ready()
        return self._ok(call, self.card(self.serving.resolve(request.path_params["model"])))

    async def load(self, request: Request, call: Call) -> Response:
        return self._ok(call, self.card(await load_model(self.serving, await self._name(request))))

    async def unload(self, request: Request, call: Call) -> Response:
        return self._ok(call, self.card(await unload_model(self.serving, await self._name(request))))

    def card(self, model: ModelContext) -> dict[str, Any]:
        """OpenAI's model object, with the context it serves (`max_model_len`, loaded or not) and its `state`
        (serving, loading, unloading, unloaded, failed)."""
        created = int(time.time() - (time.monotonic() - self.serving.started))
        card = {"id": model.name, "object": "model", "created": created, "owned_by": "attnserve", "state": model.state}
        _, context = described(model, self.serving.settings)
        return card | ({"max_model_len": context} if context else {})

    async def _name(self, request: Request) -> str:
        data, _ = await read_json(request, self.serving)
        return validated(ModelName, data).model or ""

    @staticmethod
    def _ok(call: Call, body: dict[str, Any]) -> Response:
        call.finished("200", True)
        return JSONResponse(body)
