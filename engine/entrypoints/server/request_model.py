"""What the typed request models of every API share: the base model, the field policies, the
caps, and a validation error as the client's 400 (``validated``).

Each API declares its request as pydantic models (``openai_types``, ``responses_types``,
``anthropic_types``), so every field's type is checked before any logic reads it: a list or an
object where a string belongs is a 400 naming the field, never a ``TypeError`` deep in a handler.
Types are strict (``"3"`` is no integer, ``true`` no number; an integer is a number). A field of
no API served is refused (``extra="forbid"``; objects whose keys clients vary, such as chat
messages, say otherwise); fields that mean nothing to this server are declared ``Ignored``;
fields it knows and does not implement are ``refused`` unless they ask for nothing.

Lists are capped before their items are read: ``capped(name)`` by the server's ``RequestLimits``
(passed as the validation context), ``at_most(n, what)`` by a fixed engine cap; each is a 400
naming the field and the cap. The error of a validation names the path the client sent
(``messages[1].content[0].type``), found by walking the client's own body (``client_path``), with
a message that shows at most a few dozen characters of the value. The kinds of an API's items or
blocks are told apart by their ``type`` (``tagged_kind``: an error names that ``type``). A request
read as another API's (a Responses or Messages request as a chat request) maps the errors of that
reading back to its own paths with a ``PathMap``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    ValidationError,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

from engine.entrypoints.server.request_body import APIError, RequestLimits, clipped, shown

Model = TypeVar("Model", bound=BaseModel)


class RequestModel(BaseModel):
    """A request object: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LenientModel(BaseModel):
    """An object inside a request whose other keys clients vary (ids, statuses, cache hints):
    strict types for what is declared, any other key ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


Ignored = Any  # a field of the API that means nothing to this server: accepted, never read


def refused(*nothing: Any, why: str = "") -> Any:
    """A field this server knows and does not implement: accepted only with one of the values
    that ask for nothing (``None`` included), else a 400 "is not supported by this server" + ``why``."""
    def check(value: Any) -> Any:
        if value is not None and not any(value == v and type(value) is type(v) for v in nothing):
            raise PydanticCustomError("not_supported", "is not supported by this server" + why)
        return value

    return Annotated[Any, AfterValidator(check)]


def capped(limit: str) -> BeforeValidator:
    """A list field holding at most ``RequestLimits.<limit>`` items (the validation context's
    limits), checked before any item is read."""
    flag = "--max-" + limit.replace("_", "-")

    def check(value: Any, info: ValidationInfo) -> Any:
        cap = getattr(info.context["limits"], limit)
        if isinstance(value, (list, dict)) and len(value) > cap:
            raise PydanticCustomError("too_many_items",
                                      "holds {count} items; this server takes at most {cap} (serve {flag})",
                                      {"count": len(value), "cap": cap, "flag": flag})
        return value

    return BeforeValidator(check)


def at_most(cap: int, what: str) -> BeforeValidator:
    """A list field holding at most ``cap`` ``what`` (a fixed engine cap), checked before any item is read."""
    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > cap:
            raise PydanticCustomError("too_many_items", "must hold at most {cap} " + what, {"cap": cap})
        return value

    return BeforeValidator(check)


def tagged_kind(kind_of, kinds: tuple[str, ...]) -> Discriminator:
    """The discriminator of a union of item kinds: ``kind_of(value)`` is a value's tag; a value of
    no kind in ``kinds`` is a 400 naming its ``type``."""
    return Discriminator(kind_of, custom_error_type="tagged_kind",
                         custom_error_message="must be one of " + ", ".join(kinds))


def validated(model: type[Model], body: dict, limits: RequestLimits) -> Model:
    """``body`` as a ``model``; a 400 naming the client's field path when it is not one."""
    try:
        return model.model_validate(body, context={"limits": limits})
    except ValidationError as e:
        raise api_error(e, body) from None


_DESCRIPTIONS = {"string_type": "must be a string", "int_type": "must be an integer",
                 "float_type": "must be a number", "bool_type": "must be a boolean", "list_type": "must be an array",
                 "dict_type": "must be an object", "model_type": "must be an object",
                 "model_attributes_type": "must be an object", "missing": "is required",
                 "extra_forbidden": "is not a field this server knows", "int_from_float": "must be an integer",
                 "string_too_long": "must be at most {max_length} characters"}
_TYPE_ERRORS = {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type",
                "model_attributes_type", "literal_error", "int_from_float", "greater_than_equal", "less_than_equal",
                "greater_than", "less_than"}
_BOUNDS = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}


def api_error(error: ValidationError, body: Any) -> APIError:
    """The 400 of a failed validation of ``body``: the most specific failure (the deepest path;
    the alternatives of a union at one path joined with "or"), naming the client's path."""
    found: dict[str, list[dict]] = {}
    for item in error.errors(include_url=False):
        found.setdefault(client_path(body, item["loc"], item["type"] == "missing"), []).append(item)
    deepest = max(found, key=_depth)
    items = found[deepest]
    if items[0]["type"] == "tagged_kind" and isinstance(items[0]["input"], dict) and "type" in items[0]["input"]:
        deepest += ".type"  # an item or block of a kind no API reads: its type is what is wrong
    path = clipped(deepest, 128)  # a client's key may be megabytes long
    if items[0]["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{clipped(path, 64)}'", param=path)
    described = " or ".join(dict.fromkeys(_described(item) for item in items)).replace(" or must be ", " or ")
    got = f", got {shown(items[0]['input'])}" if all(item["type"] in _TYPE_ERRORS for item in items) else ""
    code = "too_many_items" if items[0]["type"] == "too_many_items" else None
    return APIError(400, f"'{path}' {described}{got}", param=path or None, code=code)


def _described(item: dict) -> str:
    kind, context = item["type"], item.get("ctx") or {}
    if kind == "literal_error":
        return f"must be {context['expected']}"
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind]} {next(iter(context.values()))}"
    if kind == "too_short":
        return "must not be empty" if context.get("min_length") == 1 else f"must hold at least {context['min_length']}"
    if kind == "too_long":
        return f"must hold at most {context['max_length']} items"
    if kind in _DESCRIPTIONS:
        return _DESCRIPTIONS[kind].format(**context)
    message = item["msg"].removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


def _depth(path: str) -> int:
    return path.count(".") + path.count("[") + (1 if path else 0)


def client_path(body: Any, loc: Iterable[str | int], missing: bool = False) -> str:
    """The path of a validation error's ``loc`` in the client's ``body`` (``a.b[2].c``): the
    steps that exist in the body, less the tags pydantic adds for the alternatives of a union;
    a ``missing`` field's own name last."""
    loc = list(loc)
    path, value = "", body
    for i, step in enumerate(loc):
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}" if path else step, value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif missing and i == len(loc) - 1 and isinstance(value, dict) and isinstance(step, str):
            path = f"{path}.{step}" if path else step
    return path


class PathMap:
    """The client's paths of the fields of a request read as another API's: ``add(read, sent)``
    says the field at path ``read`` (and everything under it) came from ``sent``; ``error(e)`` is
    ``e`` (an APIError of the reading) naming the client's path."""

    def __init__(self):
        self._pairs: list[tuple[str, str]] = []

    def add(self, read: str, sent: str) -> None:
        self._pairs.append((read, sent))

    def sent(self, path: str) -> str:
        """``path`` of the reading as the client's path: the longest mapped prefix replaced."""
        best = None
        for read, sent in self._pairs:
            if path.startswith(read) and path[len(read):len(read) + 1] in ("", ".", "[") and (
                    best is None or len(read) > len(best[0])):
                best = (read, sent)
        return path if best is None else best[1] + path[len(best[0]):]

    def error(self, e: APIError) -> APIError:
        if e.param is None:
            return e
        param = self.sent(e.param)
        message = e.message.replace(f"'{e.param}", f"'{param}").replace(f"{e.param}:", f"{param}:")
        return APIError(e.status, message, param=param, code=e.code)
