"""``foxlm serve MODEL [OPTIONS]``: transformers' own OpenAI-compatible server (``transformers serve``) for foxlm
models, without ``trust_remote_code``.

``transformers serve`` loads a model as ``getattr(transformers, config.architectures[0])``, in a model process it
spawns, so registering foxlm with the Auto classes is not enough there: ``register`` also makes foxlm's classes
attributes of the ``transformers`` module, and ``FoxModelLoader`` (pickled into every process the server spawns, so
that unpickling it imports this module) registers them in each process before it loads anything.
"""

from __future__ import annotations

import transformers
from transformers.cli.serve import Serve
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


class FoxServe(Serve):
    """``transformers serve``, its models loaded by ``FoxModelLoader``."""

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
