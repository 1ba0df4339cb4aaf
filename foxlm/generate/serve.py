"""``foxlm serve MODEL [OPTIONS]``: transformers' own OpenAI-compatible server (``transformers serve``) for foxlm
models, without ``trust_remote_code``.

``transformers serve`` loads a model as ``getattr(transformers, config.architectures[0])``, in a model process it
spawns, so registering foxlm with the Auto classes is not enough there: ``register`` also makes foxlm's classes
attributes of the ``transformers`` module, and ``FoxModelLoader`` (pickled into every process the server spawns, so
that unpickling it imports this module) registers them in each process before it loads anything.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import math

import transformers
from fastapi import HTTPException
from transformers.cli.serve import Serve
from transformers.cli.serving import chat_completion, completion
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import prompt_length, request_logger


def register() -> None:
    """Register foxlm's config and models with transformers' Auto classes and as attributes of ``transformers``
    (where ``transformers serve`` looks a checkpoint's architecture up); idempotent."""
    from foxlm.models import FoxConfig, FoxForCausalLM, FoxModel, register_auto_classes

    register_auto_classes()
    for cls in (FoxConfig, FoxModel, FoxForCausalLM):
        setattr(transformers, cls.__name__, cls)


class FoxModelLoader(ModelLoader):
    """transformers serve's ``ModelLoader``, which registers foxlm first, in whichever process it loads in."""

    def load_model_and_processor(self, *args, **kwargs):
        register()
        return super().load_model_and_processor(*args, **kwargs)

    def load_config(self, *args, **kwargs):
        register()
        return super().load_config(*args, **kwargs)

    def load_processor(self, *args, **kwargs):
        register()
        return super().load_processor(*args, **kwargs)


def check_messages(messages: object) -> None:
    """Refuse (HTTP 422, naming the field) a chat request's ``messages`` that are not a list of messages: objects with
    a string ``role`` and a ``content`` that is a string, null, or a list of parts (objects with a ``type``)."""
    if not isinstance(messages, list) or not messages:
        problem = "is missing" if messages is None else f"must be a non-empty list of messages, not {messages!r:.60}"
        raise HTTPException(status_code=422, detail=f"messages: {problem}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise HTTPException(status_code=422, detail=f"messages[{i}]: expected an object with a string role "
                                                        f"(and its content), not {message!r:.60}")
        content = message.get("content")
        if not (content is None or isinstance(content, str) or isinstance(content, list) and all(
                isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)):
            raise HTTPException(status_code=422, detail=f"messages[{i}].content: expected a string or a list of "
                                                        f"parts with a type, not {content!r:.60}")


def _refuse(field: str, expected: str, value: object) -> None:
    raise HTTPException(status_code=422, detail=f"{field}: expected {expected}, got {value!r:.60}")


def _is_number(value: object) -> bool:
    # JSON's integers may be past a float's range (math.isfinite would overflow); Python's JSON reads NaN too
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value)


def check_generation_fields(body: dict) -> None:
    """Refuse (HTTP 422, naming the field) the generation settings of a completion or chat request that
    transformers serve would take wrong: a fractional or boolean token count (cut to an int: 1.5 and true were 1),
    ``top_p`` outside (0, 1] or a negative temperature (taken as given), ``stop`` other than strings (a 500) or an
    empty one (it stopped at the first token), ``n`` other than 1 (one choice was returned whatever was asked)."""
    for field in ("max_tokens", "max_completion_tokens", "seed"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or field != "seed" and value < 1):
            _refuse(field, "an integer" if field == "seed" else "a positive integer (tokens)", value)
    if (value := body.get("temperature")) is not None and not (_is_number(value) and value >= 0):
        _refuse("temperature", "a number >= 0 (0: greedy)", value)
    if (value := body.get("top_p")) is not None and not (_is_number(value) and 0 < value <= 1):
        _refuse("top_p", "a probability mass in (0, 1]", value)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) and stop or isinstance(stop, list) and stop and all(
            isinstance(s, str) and s for s in stop)):
        _refuse("stop", "a non-empty string or a list of them", stop)
    if (value := body.get("n")) is not None and value != 1:
        _refuse("n", "1 (transformers serve gives one choice a request)", value)


class _StopCut:
    """The text of a stream (a ``Detokenizer``'s output queue, as far as transformers serve's handlers read it) up to
    the first of ``stops``, which it holds back while its end could begin one; other outputs pass as they come."""

    def __init__(self, queue: asyncio.Queue, stops: list[str]):
        self.queue, self.stops = queue, stops
        self.ready: collections.deque = collections.deque()
        self.held, self.stopped = "", False

    def _take(self, item: object) -> None:
        if type(item) is not str:  # the end (None), an error, a tool call or reasoning: what is held goes first
            if self.held and not self.stopped:
                self.ready.append(self.held)
            self.held = ""
            self.ready.append(item)
            return
        if self.stopped:
            return
        self.held += item
        cut = cut_at_stop(self.held, self.stops)
        if cut is not None:
            self.held, self.stopped = "", True
            text = cut
        else:  # hold back the longest end of the text that begins a stop string
            keep = max((k for stop in self.stops for k in range(1, len(stop)) if self.held.endswith(stop[:k])),
                       default=0)
            text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if text:
            self.ready.append(text)

    async def get(self) -> object:
        while not self.ready:
            self._take(await self.queue.get())
        return self.ready.popleft()

    def empty(self) -> bool:
        while not self.ready and not self.queue.empty():
            self._take(self.queue.get_nowait())
        return not self.ready

    def get_nowait(self) -> object:
        if self.empty():
            raise asyncio.QueueEmpty
        return self.ready.popleft()


def cut_at_stop(text: str, stops: list[str]) -> str | None:
    """``text`` up to the first of ``stops`` in it, or None if none is."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[:min(found)] if found else None


class _StopCutEngine:
    """A transformers serve engine whose answers end before the stop string that ended them, as OpenAI's API gives
    them (transformers serve's include it)."""

    def __init__(self, engine, stops: list[str]):
        self.engine, self.stops = engine, stops

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate_non_streaming(self, *args, **kwargs) -> tuple[str, int, list[int]]:
        text, input_len, generated_ids = await self.engine.generate_non_streaming(*args, **kwargs)
        cut = cut_at_stop(text, self.stops)
        return text if cut is None else cut, input_len, generated_ids

    def generate_streaming(self, *args, **kwargs):
        queue, streamer = self.engine.generate_streaming(*args, **kwargs)
        return _StopCut(queue, self.stops), streamer


def _cutting_stops(engine, generation_kwargs: dict):
    stops = generation_kwargs.get("stop_strings")
    return engine if not stops else _StopCutEngine(engine, [stops] if isinstance(stops, str) else list(stops))


# The answer length a request asks for, (its field, tokens), or None: set for the request's task by
# ``_Answers.handle_request``, read by ``_Answers._fitted`` (which transformers serve's handlers call without the body)
_ASKED: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("foxlm_serve_asked", default=None)


def asked_tokens(body: dict) -> tuple[str, int] | None:
    """The answer length a completion or chat request asks for itself, as (its field, tokens), as transformers serve
    reads them: chat's ``max_completion_tokens``, then ``max_tokens``, then the ``max_new_tokens`` of the request's
    ``generation_config`` (a JSON object, transformers serve's own field); None where it leaves it to the server."""
    field = next((f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None), None)
    if field is not None:
        return field, body[field]
    try:  # transformers serve refuses a generation_config it cannot read, later and in its own words
        settings = json.loads(body["generation_config"]) if isinstance(body.get("generation_config"), str) else None
    except ValueError:
        return None
    tokens = settings.get("max_new_tokens") if isinstance(settings, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool):  # none, or one for generate to refuse
        return None
    return "generation_config.max_new_tokens", tokens


class _Answers:
    """A handler whose answers end before their stop string (``_StopCutEngine``) and fit the context the server
    takes (``--max-model-len``, else the model's), prompt and answer: transformers serve checks the prompt only, so
    an answer ran past it (with its default of at least 1024 new tokens, or any ``max_tokens``). As vLLM does, an
    answer left to the server's default (the model's generation_config.json ``max_new_tokens``, at least 1024) is cut
    to the room the prompt leaves, said in the request log (``--enable-log-requests``: its line above shows the
    default), while a request asking for more than that room itself (``asked_tokens``) is refused (HTTP 400 naming
    the field and the numbers, as vLLM and OpenAI refuse it), not silently given less."""

    async def handle_request(self, body: dict, request_id: str):
        token = _ASKED.set(asked_tokens(body))
        try:
            return await super().handle_request(body, request_id)
        finally:
            _ASKED.reset(token)

    def _fitted(self, request_id: str, engine, inputs: dict, generation_kwargs: dict) -> dict:
        limit = self.generation_state.context_length(engine.model_config)
        if limit is None:
            return generation_kwargs
        length = prompt_length(inputs)
        room = limit - length  # at least 1: a longer prompt was refused
        whose = "--max-model-len" if self.generation_state.max_model_len is not None else "the model's"
        asked = _ASKED.get()
        if asked is not None and asked[1] > room:
            (field, tokens) = asked
            raise HTTPException(status_code=400, detail=f"{field}: {tokens} tokens asked for, but the context is "
                                                        f"{limit} tokens ({whose}), prompt and answer, and the prompt "
                                                        f"has {length}: at most {room}")
        default = generation_kwargs["max_new_tokens"]
        if default <= room:
            return generation_kwargs
        request_logger.info("Request %s: max_new_tokens %d (the server's default) cut to %d, the room its %d-token "
                            "prompt leaves in the %d-token context (%s)", request_id, default, room, length, limit,
                            whose)
        return {**generation_kwargs, "max_new_tokens": room}

    def _streaming(self, request_id, engine, inputs, generation_kwargs, *args, **kwargs):
        generation_kwargs = self._fitted(request_id, engine, inputs, generation_kwargs)
        return super()._streaming(request_id, _cutting_stops(engine, generation_kwargs), inputs, generation_kwargs,
                                  *args, **kwargs)

    async def _non_streaming(self, request_id, engine, inputs, generation_kwargs, *args, **kwargs):
        generation_kwargs = self._fitted(request_id, engine, inputs, generation_kwargs)
        return await super()._non_streaming(request_id, _cutting_stops(engine, generation_kwargs), inputs,
                                            generation_kwargs, *args, **kwargs)


class FoxCompletionHandler(_Answers, completion.CompletionHandler):
    """transformers serve's /v1/completions handler, which checks the prompt and the generation settings first
    (``check_generation_fields``) and ends answers before their stop string, within the context (``_Answers``)."""

    def _validate_request(self, body: dict) -> None:
        super()._validate_request(body)
        if body.get("prompt") is None:  # transformers serve took it as "" and generated from no token at all
            raise HTTPException(status_code=422, detail="prompt: is missing (the text to complete)")
        check_generation_fields(body)


class FoxChatCompletionHandler(_Answers, chat_completion.ChatCompletionHandler):
    """transformers serve's /v1/chat/completions handler, which checks ``messages`` and the generation settings
    first (transformers' own reads messages while rendering the chat template, so a missing or malformed one was a
    500 and a traceback in the log), and ends answers before their stop string, within the context (``_Answers``)."""

    def _validate_request(self, body: dict) -> None:
        super()._validate_request(body)
        check_messages(body.get("messages"))
        check_generation_fields(body)


class FoxServe(Serve):
    """``transformers serve``, its models loaded by ``FoxModelLoader``, its requests checked by
    ``FoxCompletionHandler`` and ``FoxChatCompletionHandler``."""

    def run(self, *args, **kwargs) -> None:
        # Serve.run builds its handlers from the classes of their modules, in each process that serves the API
        chat_completion.ChatCompletionHandler = FoxChatCompletionHandler
        completion.CompletionHandler = FoxCompletionHandler
        super().run(*args, **kwargs)

    # Serve.__init__ builds its ModelLoader and starts serving at once: the loader is made a FoxModelLoader as it is
    # assigned (FoxModelLoader adds no state, so the object stays as built)
    @property
    def loader(self) -> FoxModelLoader:
        return self.__dict__["loader"]

    @loader.setter
    def loader(self, loader: ModelLoader) -> None:
        loader.__class__ = FoxModelLoader
        self.__dict__["loader"] = loader


FoxServe.__doc__ = Serve.__doc__.replace("pip install transformers[serving]", "pip install 'foxlm[serve]'")


def serve(model: str, options: list[str]) -> int:
    """Run ``transformers serve MODEL OPTIONS`` (options as on its command line) for a foxlm model until stopped."""
    import typer

    register()
    app = typer.Typer(add_completion=False)
    app.command()(FoxServe)
    # click's standalone mode: its own usage errors and --help; it exits (sys.exit) when the server stops
    return typer.main.get_command(app).main([model, *options], prog_name="foxlm serve")
