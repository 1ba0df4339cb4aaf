"""``foxlm serve MODEL [OPTIONS]``: transformers' own OpenAI-compatible server (``transformers serve``) for foxlm
models, without ``trust_remote_code``.

``transformers serve`` loads a model as ``getattr(transformers, config.architectures[0])``, in a model process it
spawns, so registering foxlm with the Auto classes is not enough there: ``register`` also makes foxlm's classes
attributes of the ``transformers`` module, and ``FoxModelLoader`` (pickled into every process the server spawns, so
that unpickling it imports this module) registers them in each process before it loads anything.
"""

from __future__ import annotations

import transformers
from fastapi import HTTPException
from transformers.cli.serve import Serve
from transformers.cli.serving import chat_completion
from transformers.cli.serving.model_manager import ModelLoader


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


class FoxChatCompletionHandler(chat_completion.ChatCompletionHandler):
    """transformers serve's /v1/chat/completions handler, which checks ``messages`` first: transformers' own reads
    them while rendering the chat template, so a missing or malformed one was a 500 and a traceback in the log."""

    def _validate_request(self, body: dict) -> None:
        super()._validate_request(body)
        check_messages(body.get("messages"))


class FoxServe(Serve):
    """``transformers serve``, its models loaded by ``FoxModelLoader``, its chat requests checked by
    ``FoxChatCompletionHandler``."""

    def run(self, *args, **kwargs) -> None:
        # Serve.run builds its handlers from the chat_completion module's class, in each process that serves the API
        chat_completion.ChatCompletionHandler = FoxChatCompletionHandler
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
