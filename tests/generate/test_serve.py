"""``foxlm serve``: transformers' own OpenAI-compatible server for a foxlm model, queried over HTTP with the OpenAI
client. The server runs as a user starts it (``foxlm serve MODEL --host 127.0.0.1 --port P``), in a child process,
on a tiny random FoX model with the offline GPT-2 tokenizer and a chat template."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch
import transformers
from foxlm_cli import ctrl_c_reaches_it, foxlm, one_line_error
from packaging.version import Version

openai = pytest.importorskip("openai", reason="the [serve] extra is not installed: pip install 'foxlm[serve]'")
if Version(transformers.__version__) < Version("5.25"):  # the extra's own pin: foxlm serve refuses, naming it
    pytest.skip(f"foxlm serve needs transformers>=5.25, not {transformers.__version__}", allow_module_level=True)

# A chat template of the usual shape: one line per message, then the assistant's turn
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny random FoX model and the GPT-2 tokenizer, with a chat template, as a save_pretrained folder."""
    from foxlm.data import get_tokenizer
    from foxlm.data.tokenizer import save_fast_tokenizer
    from foxlm.models import FoxConfig, FoxForCausalLM

    tok = get_tokenizer("gpt2")
    cfg = FoxConfig.preset("fox-pro", "tiny", vocab_size=tok.vocab_size, num_hidden_layers=1, hidden_size=32,
                           num_attention_heads=2, intermediate_size=64, bos_token_id=tok.eot_id,
                           eos_token_id=tok.eot_id)
    cfg.foxlm_tokenizer = tok.spec()
    folder = tmp_path_factory.mktemp("serve") / "fox"
    torch.manual_seed(0)
    FoxForCausalLM(cfg).save_pretrained(folder)
    hf = tok.hf_tokenizer()
    hf.chat_template = CHAT_TEMPLATE
    save_fast_tokenizer(hf, folder)
    assert "auto_map" not in json.loads((folder / "config.json").read_text())  # nothing for trust_remote_code
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(model: str, *options: str, env: dict | None = None, log: list[str] | None = None) -> Iterator[str]:
    """``foxlm serve MODEL OPTIONS`` on 127.0.0.1, ready (its /health answers), at the URL given; stopped with Ctrl-C
    as a user stops it, its output then appended to ``log``."""
    port = _free_port()
    child_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FOXLM_DEBUG")}
    child_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "foxlm.cli", "serve", model, "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu", "--log-level", "warning", *options],
                            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ctrl_c_reaches_it)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"foxlm serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("foxlm serve did not answer /health within 120 s")
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            log.append(proc.stdout.read())


@pytest.fixture(scope="module")
def server(model_folder):
    with _serving(str(model_folder)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(model_folder):
    """The same model and tokenizer loaded here, for greedy decoding to compare with the server's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_folder).eval(), AutoTokenizer.from_pretrained(model_folder)


def _greedy(local, ids: list[int], new_tokens: int = NEW_TOKENS) -> str:
    model, tok = local
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return tok.decode(out[0, len(ids):])


def test_completions_greedy_and_streamed(client, model_folder, local):
    """/v1/completions gives the FoX model's own greedy continuation; streamed, it comes in several chunks that add
    up to the same text."""
    prompt = "To be, or not to be"
    args = dict(model=str(model_folder), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    done = client.completions.create(**args)
    text = done.choices[0].text
    assert done.usage.completion_tokens == NEW_TOKENS and done.choices[0].finish_reason == "length"
    assert text == _greedy(local, local[1](prompt)["input_ids"])

    chunks = [c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices]
    pieces = [c for c in chunks if c]
    # token by token, though a stream that falls behind joins what is waiting into one event
    assert len(pieces) >= 2, chunks
    assert "".join(pieces) == text


def test_chat_completions_use_the_chat_template(client, model_folder, local):
    messages = [{"role": "user", "content": "Good morrow, sweet lady."}]
    done = client.chat.completions.create(model=str(model_folder), messages=messages, max_tokens=NEW_TOKENS,
                                          temperature=0)
    ids = local[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert done.choices[0].message.content == _greedy(local, list(ids))
    assert done.usage.prompt_tokens == len(ids)


def test_bad_arguments_are_one_line(model_folder, tmp_path):
    line = one_line_error(foxlm("serve", tmp_path), "serve")
    assert line.endswith(f"MODEL: {tmp_path} is not a run folder, a checkpoint folder or a save_pretrained folder")
    from foxlm.models import FoxConfig, FoxForCausalLM

    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=256, num_hidden_layers=1)).save_pretrained(
        tmp_path / "bytes")  # as a byte-level run's model: no tokenizer files
    line = one_line_error(foxlm("serve", tmp_path / "bytes"), "serve")
    assert "has no tokenizer.json (a byte-level model's has none)" in line
    line = one_line_error(foxlm("serve", model_folder, "--continuous-batching"), "serve")
    assert "--continuous-batching" in line and "forget gate" in line


def test_a_missing_serving_dependency_names_the_extra(model_folder):
    """Without fastapi (as without the [serve] extra): one line naming the extra, not transformers' own."""
    child = f"import sys; sys.modules['fastapi'] = None; from foxlm.cli import main; sys.exit(main(['serve', " \
            f"{str(model_folder)!r}]))"
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "foxlm serve: error: this needs fastapi, which is not installed: pip install 'foxlm[serve]'"), proc.stderr


def test_a_model_neither_here_nor_reachable_is_one_line(tmp_path):
    """A path that does not exist went to transformers as a hub name (its OSError traceback: "Repo id must use
    alphanumeric chars"); a hub name where the hub cannot be reached (nothing answers at HF_ENDPOINT), and not in its
    cache, is one line saying so, found by one request rather than huggingface_hub's retries."""
    line = one_line_error(foxlm("serve", tmp_path / "missing"), "serve")
    assert line.endswith(f"MODEL: {tmp_path / 'missing'} does not exist (expected a run, checkpoint or "
                         "save_pretrained folder, or a model name on the Hugging Face hub)")
    env = {"HF_ENDPOINT": _unreachable_endpoint(), "HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path / "hf")}
    proc = foxlm("serve", "foxlm-tests/no-such-model", env=env)
    line = one_line_error(proc, "serve")
    assert "MODEL: foxlm-tests/no-such-model is not a folder here" in line and "cannot be reached" in line


def _unreachable_endpoint() -> str:
    with socket.socket() as s:  # a free port: connections to it are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_hub_model_in_the_cache_is_served_where_the_hub_cannot_be_reached(model_folder, local, tmp_path):
    """A model downloaded before (in the hub's cache, as huggingface_hub lays it out) is served where the hub cannot
    be reached, offline mode not set: it was refused as unreachable, though transformers loads it from the cache."""
    name = "foxlm-tests/tiny-fox"
    repo = tmp_path / "hf" / "hub" / "models--foxlm-tests--tiny-fox"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(model_folder, repo / "snapshots" / ("0" * 40))
    env = {"HF_ENDPOINT": _unreachable_endpoint(), "HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path / "hf")}
    with _serving(name, env=env) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        prompt = "To be, or not to be"
        done = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert done.choices[0].text == _greedy(local, local[1](prompt)["input_ids"])


def _post(url: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` as JSON; the HTTP status and the JSON answer, an error's too."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("messages, field", [
    (None, "messages: is missing"), ("Hello", "messages: must be a non-empty list"), ([], "messages: must be"),
    (["Hello"], "messages[0]: expected an object with a string role"),
    ([{"content": "Hello"}], "messages[0]: expected an object with a string role"),
    ([{"role": "user", "content": 5}], "messages[0].content: expected a string or a list of parts"),
    ([{"role": "user", "content": ["Hello"]}], "messages[0].content: expected a string or a list of parts")])
def test_chat_requests_without_proper_messages_are_refused(server, model_folder, messages, field):
    """A chat request whose messages are missing or not messages is a 422 naming the field, as a request's other
    mistakes are; it was a 500 (Internal Server Error), with a traceback in the server's log."""
    body = {"model": str(model_folder), "max_tokens": 4}
    if messages is not None:
        body["messages"] = messages
    status, answer = _post(f"{server}/v1/chat/completions", body)
    assert status == 422 and answer["detail"].startswith(field), (status, answer)


@pytest.mark.parametrize("endpoint, field, value, detail", [
    ("completions", "max_tokens", 1.5, "max_tokens: expected a positive integer"),  # was cut to 1
    ("completions", "max_tokens", True, "max_tokens: expected a positive integer"),  # was 1
    ("chat/completions", "max_completion_tokens", 2.5, "max_completion_tokens: expected a positive integer"),
    ("completions", "temperature", -1, "temperature: expected a number >= 0"),  # was taken as given
    ("completions", "temperature", "hot", "temperature: expected a number >= 0"),  # named no field
    ("completions", "top_p", 5, "top_p: expected a probability mass in (0, 1]"),  # was taken as given
    ("completions", "stop", 5, "stop: expected a non-empty string or a list of them"),  # a 500
    ("chat/completions", "stop", ["\n", 1], "stop: expected a non-empty string or a list of them"),  # a 500
    ("completions", "stop", "", "stop: expected a non-empty string"),  # stopped after the first token
    ("completions", "n", 2, "n: expected 1"),  # one choice came back
    ("completions", "seed", "x", "seed: expected an integer")])
def test_generation_settings_that_would_be_taken_wrong_are_refused(server, model_folder, endpoint, field, value,
                                                                   detail):
    """A request's generation setting that transformers serve would take as something else, or fail on inside the
    model's process (a 500, with a traceback in the server's log), is a 422 naming the field."""
    body = {"model": str(model_folder), "max_tokens": 4, field: value}
    body.update({"messages": [{"role": "user", "content": "Hello"}]} if endpoint.startswith("chat") else
                {"prompt": "Hello"})
    status, answer = _post(f"{server}/v1/{endpoint}", body)
    assert status == 422 and answer["detail"].startswith(detail), (status, answer)


@pytest.mark.parametrize("prompt", [None, "missing"])
def test_a_completion_without_a_prompt_is_refused(server, model_folder, prompt):
    """A completion request without a prompt (or a null one) is a 422 naming it, as a request's other mistakes are:
    transformers serve took it as an empty prompt."""
    body = {"model": str(model_folder), "max_tokens": 4}
    if prompt is None:
        body["prompt"] = None
    status, answer = _post(f"{server}/v1/completions", body)
    assert (status, answer.get("detail")) == (422, "prompt: is missing (the text to complete)"), (status, answer)


def test_answers_end_before_their_stop_string(client, model_folder, local):
    """An answer that a stop string ended stops before it, as OpenAI's API gives it, streamed or not (transformers
    serve's included the stop string)."""
    prompt = "To be, or not to be"
    text = _greedy(local, local[1](prompt)["input_ids"])
    words = text.split()
    # two words from the middle of the greedy answer, as a stop string of several tokens: a stream holds the first
    # back until it knows whether the stop string follows
    i = next(i for i in range(len(words) // 3, len(words) - 1)
             if all(w.isascii() and w.isalpha() and len(w) >= 3 for w in words[i:i + 2]))
    stop = f" {words[i]} {words[i + 1]}"
    assert stop in text and len(local[1](stop)["input_ids"]) >= 2
    args = dict(model=str(model_folder), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=[stop])
    done = client.completions.create(**args)
    assert done.choices[0].text == text[:text.index(stop)] and done.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == text[:text.index(stop)]


def test_answers_fit_the_context_with_their_prompt(model_folder, local):
    """``--max-model-len`` bounds a request, prompt and answer (as its help says): an answer left to the server's
    default (at least 1024 tokens) ends where the context does, finish_reason "length", streamed or not; one asked
    for up to that room is given. transformers serve checked the prompt only, and generated past it."""
    prompt, limit = "To be, or not to be", 16
    ids = local[1](prompt)["input_ids"]
    room = limit - len(ids)
    with _serving(str(model_folder), "--max-model-len", str(limit)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for asked in ({"max_tokens": room}, {}):
            done = client.completions.create(model=str(model_folder), prompt=prompt, temperature=0, **asked)
            assert done.usage.completion_tokens == room and done.choices[0].finish_reason == "length", asked
            assert done.choices[0].text == _greedy(local, ids, room)
        chunks = list(client.completions.create(model=str(model_folder), prompt=prompt, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        _asking_past_the_context_is_refused(url, model_folder, local, limit)


def test_a_default_answer_length_past_the_context_is_cut_and_logged(model_folder, local, tmp_path):
    """A model whose generation_config.json asks for more new tokens than the context leaves (transformers serve's
    default answer length): as vLLM, the answer is cut to the room left after the prompt (finish_reason "length"),
    not refused, and the request log (--enable-log-requests) says so (it was cut silently, the log showing the default
    only). The request's own generation_config field asking for more is the request's ask, refused as max_tokens is
    (it was cut silently too)."""
    from transformers import GenerationConfig

    folder = tmp_path / "fox"
    shutil.copytree(model_folder, folder)
    GenerationConfig(max_new_tokens=5000, do_sample=False).save_pretrained(folder)
    prompt, limit = "To be, or not to be", 16
    ids = local[1](prompt)["input_ids"]
    room = limit - len(ids)
    log: list[str] = []
    with _serving(str(folder), "--max-model-len", str(limit), "--log-level", "info", "--enable-log-requests",
                  log=log) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        asking = {"model": str(folder), "prompt": prompt, "generation_config": json.dumps({"max_new_tokens": room + 1})}
        for stream in (False, True):
            status, answer = _post(f"{url}/v1/completions", {**asking, "stream": stream})
            assert (status, answer.get("detail")) == (400, (
                f"generation_config.max_new_tokens: {room + 1} tokens asked for, but the context is {limit} tokens "
                f"(--max-model-len), prompt and answer, and the prompt has {len(ids)}: at most {room}")), stream
        done = client.completions.create(model=str(folder), prompt=prompt)
    assert done.usage.completion_tokens == room and done.choices[0].finish_reason == "length"
    assert done.choices[0].text == _greedy(local, ids, room)
    assert (f"max_new_tokens 5000 (the server's default) cut to {room}, the room its {len(ids)}-token prompt leaves in "
            f"the {limit}-token context (--max-model-len)") in log[0], log[0]


def _asking_past_the_context_is_refused(url, model_folder, local, limit):
    """A request whose max_tokens (chat: or max_completion_tokens) is more than the context leaves after its prompt
    is a 400 naming the field and the numbers, streamed or not, as vLLM's and OpenAI's are: it was silently given
    fewer tokens."""
    prompt = "To be, or not to be"
    messages = [{"role": "user", "content": "Good morrow"}]
    chat_ids = local[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    for endpoint, field, body, length in (
            ("completions", "max_tokens", {"prompt": prompt}, len(local[1](prompt)["input_ids"])),
            ("chat/completions", "max_tokens", {"messages": messages}, len(chat_ids)),
            ("chat/completions", "max_completion_tokens", {"messages": messages}, len(chat_ids))):
        room = limit - length
        for stream in (False, True):
            request = {"model": str(model_folder), field: room + 1, "temperature": 0, "stream": stream, **body}
            status, answer = _post(f"{url}/v1/{endpoint}", request)
            assert (status, answer.get("detail")) == (400, (
                f"{field}: {room + 1} tokens asked for, but the context is {limit} tokens (--max-model-len), prompt "
                f"and answer, and the prompt has {length}: at most {room}")), (endpoint, stream)
