"""What the HTTP handlers serve with, as FastAPI dependencies: the served context (`Served`: engine, chat format,
model name, API keys, stored responses, reasoning memory, thinking budgets — set on the app by http.build_app), the
API-key check (Authorization: Bearer …, and Anthropic's x-api-key; it gives the request's tenant, whose prefix cache it
uses) and the request body whose `model` must be the one served."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from fastapi import Depends, Header, Request

from expertmesh.chat.format import ChatFormat
from expertmesh.chat.thinking import DEFAULT_BUDGETS, ThinkingBudgets
from expertmesh.router.engine import Engine
from expertmesh.router.image_decode import ImageDecoder
from expertmesh.router.images import ImageBudget, request_images
from expertmesh.router.response_store import ReasoningMemory, ResponseStore, owner_of
from expertmesh.router.serving import check_key, check_model


@dataclass
class Served:
    engine: Engine
    fmt: ChatFormat
    name: str  # the model name the APIs answer to
    api_key: str | tuple[str, ...] | None  # one key, several (--api-key-file: one a line), or None: anyone
    store: ResponseStore  # the Responses API's stored responses
    memory: ReasoningMemory | None  # reasoning given back to chat histories that drop it (None: off)
    created: int  # /v1/models `created`
    decoder: ImageDecoder | None = None  # the pool images are decoded in (router/image_decode.py)
    budgets: ThinkingBudgets = DEFAULT_BUDGETS  # reasoning-token limits of the thinking tiers

    async def images(self, urls: dict[str, str]) -> ImageBudget:
        """A request's image budget (router/images.py): its remote URLs fetched, its limits and the context."""
        engine = self.engine
        return await request_images(
            engine.cfg.vision, engine.image_limits, urls, decoder=self.decoder, context=engine.cfg.max_context
        )


def served(request: Request) -> Served:
    return request.app.state.served


def bearer_token(authorization: str | None) -> str:
    """The token of `Authorization: Bearer TOKEN` (the scheme is case-insensitive, RFC 7235); "" for anything else."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def given_key(x_api_key: str | None, authorization: str | None) -> str:
    """The API key a request presents: Anthropic's x-api-key header, else the bearer token."""
    return x_api_key.strip() if x_api_key else bearer_token(authorization)


def caller(authorization: str | None = Header(default=None)) -> str:
    """Whose stored responses a request may see: a hash of its API key (response_store.owner_of)."""
    return owner_of(bearer_token(authorization))


def openai_key(request: Request, authorization: str | None = Header(default=None)) -> str:
    """OpenAI's routes: the key as a bearer token. Returns the request's tenant (serving.check_key: the key checked,
    "" with no keys configured) — a route that declares this dependency too gets it (FastAPI runs it once)."""
    key = bearer_token(authorization)
    return check_key(served(request).api_key, key)


def anthropic_key(
    request: Request, x_api_key: str | None = Header(default=None), authorization: str | None = Header(default=None)
) -> str:
    """Anthropic's routes: x-api-key, or a bearer token. Returns the request's tenant, as `openai_key`."""
    key = given_key(x_api_key, authorization)
    return check_key(served(request).api_key, key)


def served_model(body_type: type):
    """A dependency giving the request body parsed as `body_type`, its `model` checked against the served one (404
    naming it; a body whose `model` is optional and absent means the served model)."""

    def dependency(request: Request, body):
        check_model(served(request).name, body.model)
        return body

    dependency.__signature__ = inspect.Signature(
        [
            inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
            inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body_type),
        ]
    )
    return Depends(dependency)
