"""What the gateway's translated protocols (responses_wire.py, anthropic_wire.py) share: their 400, the chat form
of a tool, and the server-sent event both stream."""

from __future__ import annotations

import json
from typing import Any

from server_kit.errors import ApiError


class WireError(ApiError):
    """A request the translation cannot take: a 400 naming what is wrong."""

    status = 400


def chat_function(index: int, tool: dict[str, Any], parameters: Any) -> dict[str, Any]:
    """`tool` (the request's `tools[index]`) as the chat form's function tool, which the template renders."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise WireError(f"tools[{index}]: a tool needs a name")
    function: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def event_bytes(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI's Responses API and Anthropic send theirs: its type, then its data."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def refuse_unserved(body: Any, unserved: dict[str, str]) -> Any:
    """A request body (a pydantic `model_validator(mode="before")`'s input) that sets any field of `unserved`
    (name -> why it is not served) is refused naming it: such a field changes what the policy would see or must
    answer, and ignoring it would answer another request than the one sent."""
    if isinstance(body, dict):
        for name, why in unserved.items():
            if body.get(name) not in (None, False, [], {}):
                raise ValueError(f"{name} is not served: {why}")
    return body
