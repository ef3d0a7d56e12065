"""What the server feeds the model for a text prompt, and the routes that show it: a tokenizer
that adds a BOS gets it on completions (as vLLM and SGLang encode a prompt) and not twice on
chats; a chat's template fields (continue the last message, template variables); `/tokenize`
counts what `usage.prompt_tokens` will; `/detokenize`; `GET
/v1/models/{model}`; `/version`. A real `eagleserve serve` on a tiny target whose char-level
tokenizer adds `<s>` in front."""

from __future__ import annotations

import json
import os
import random
import string
from collections.abc import Iterator
from importlib.metadata import version

import httpx
import pytest
from conftest import TINY_BOS, TINY_EOS, add_bos_to_tokenizer, save_tiny_model

from bench.server_proc import Server

TEMPLATE = (
    "{% if note is defined %}note: {{ note }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module", name="bos_server")
def bos_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = str(tmp_path_factory.mktemp("bos") / "target")
    save_tiny_model(path, seed=3)
    add_bos_to_tokenizer(path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "chat_template": TEMPLATE}, f)
    flags = ["--model", path, "--device", "cpu", "--dtype", "float32",
             "--served-model-name", "org/tiny-bos"]  # fmt: skip
    server = Server(flags, env={"OMP_NUM_THREADS": "1"})
    yield server
    server.stop()


@pytest.fixture(name="http")
def http_fixture(bos_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=bos_server.url, timeout=60) as client:
        yield client


def words(rng: random.Random) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_letters, k=rng.randint(1, 6)))
        for _ in range(rng.randint(2, 6))
    )


def char_ids(http: httpx.Client, text: str) -> list[int]:
    """The char tokenizer's ids of `text` alone (one token a character)."""
    body = {"prompt": text, "add_special_tokens": False}
    return http.post("/tokenize", json=body).json()["tokens"]


def greedy(http: httpx.Client, prompt: str | list[int], **kw: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_text_prompt_gets_the_tokenizers_bos(http: httpx.Client) -> None:
    rng = random.Random()
    for _ in range(3):
        text = words(rng)
        ids = char_ids(http, text)
        assert len(ids) == len(text) and TINY_BOS not in ids
        tokenized = http.post("/tokenize", json={"prompt": text}).json()
        assert tokenized["tokens"] == [TINY_BOS, *ids] and tokenized["count"] == len(ids) + 1
        ctx = http.get("/v1/models").json()["data"][0]["max_model_len"]
        assert tokenized["max_model_len"] == ctx
        # The BOS reaches the model: the text's answer is the ids' with the BOS in front.
        by_text = greedy(http, text)
        assert by_text["usage"]["prompt_tokens"] == tokenized["count"]
        assert by_text["choices"][0]["text"] == greedy(http, [TINY_BOS, *ids])["choices"][0]["text"]
        plain = greedy(http, text, add_special_tokens=False)
        assert plain["usage"]["prompt_tokens"] == len(ids)
        assert plain["choices"][0]["text"] == greedy(http, ids)["choices"][0]["text"]


@pytest.mark.parametrize("eos_bias", [0, 100], ids=["as drawn", "all EOS"])
def test_echo_shows_the_prompt_as_sent(http: httpx.Client, eos_bias: int) -> None:
    text = words(random.Random())
    bias = {"logit_bias": {str(TINY_EOS): eos_bias}} if eos_bias else {}
    out = greedy(http, text, echo=True, logprobs=1, **bias)["choices"][0]
    assert out["text"].startswith(text)
    lp = out["logprobs"]
    assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None
    # Every entry's offset points at its text in the echo; the added BOS takes no room, nor does
    # a special token the model draws (an EOS kept by ignore_eos, a BOS: the text skips them).
    offsets = lp["text_offset"]
    assert offsets[:2] == [0, 0]
    for i, (token, offset) in enumerate(zip(lp["tokens"], offsets, strict=True)):
        if token in ("<unk>", "<s>", "</s>"):
            assert offset == (offsets[i + 1] if i + 1 < len(offsets) else len(out["text"]))
        else:
            assert out["text"][offset : offset + len(token)] == token
    if eos_bias == 100:
        assert lp["tokens"][-6:] == ["</s>"] * 6 and out["text"] == text


def test_a_chat_is_not_given_a_second_bos(http: httpx.Client) -> None:
    rng = random.Random()
    msgs = [{"role": "user", "content": words(rng)}]
    tokenized = http.post("/tokenize", json={"messages": msgs}).json()
    text = f"user: {msgs[0]['content']}\nassistant:"  # TEMPLATE's rendering of one message
    assert tokenized["tokens"] == char_ids(http, text)
    body = {"messages": msgs, "max_tokens": 3, "temperature": 0}
    chat = http.post("/v1/chat/completions", json=body).json()
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]
    asked = http.post("/tokenize", json={"messages": msgs, "add_special_tokens": True}).json()
    assert asked["tokens"] == [TINY_BOS, *tokenized["tokens"]]
    no_prompt = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})
    assert no_prompt.json()["tokens"] == char_ids(http, text[: -len("assistant:")])


def test_a_chat_continues_its_last_message_and_fills_template_variables(
    http: httpx.Client,
) -> None:
    rng = random.Random()
    user, start = words(rng), words(rng)
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": start}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = http.post("/tokenize", json=body).json()
    text = f"user: {user}\nassistant: {start}"  # left open: no newline after the last message
    assert tokenized["tokens"] == char_ids(http, text)
    asked = {**body, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = http.post("/v1/chat/completions", json=asked).json()
    assert chat["usage"]["prompt_tokens"] == tokenized["count"]
    completion = greedy(http, char_ids(http, text))["choices"][0]["text"]
    assert chat["choices"][0]["message"]["content"] == completion
    for bad in ({**body, "add_generation_prompt": True}, {**body, "messages": msgs[:1]}):
        resp = http.post("/v1/chat/completions", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "continue_final_message"
    note = words(rng)
    filled = {"messages": msgs[:1], "chat_template_kwargs": {"note": note}}
    with_note = http.post("/tokenize", json=filled).json()
    assert with_note["tokens"] == char_ids(http, f"note: {note}\nuser: {user}\nassistant:")
    reserved = {"messages": msgs[:1], "chat_template_kwargs": {"tokenize": True}}
    resp = http.post("/v1/chat/completions", json=reserved)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs"


def test_detokenize_reads_ids_back(http: httpx.Client) -> None:
    text = words(random.Random())
    tokens = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokens["token_strs"] == ["<s>", *text]
    back = http.post("/detokenize", json={"tokens": tokens["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "<s>" + text}
    bad = http.post("/detokenize", json={"tokens": [5, 256]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenize_rejects_what_it_cannot_read(http: httpx.Client) -> None:
    both = {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    for body in (both, {}):
        resp = http.post("/tokenize", json=body)
        assert resp.status_code == 400 and "prompt or messages" in resp.text
    resp = http.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_a_model_is_retrieved_by_its_name(http: httpx.Client) -> None:
    card = http.get("/v1/models/org/tiny-bos")
    assert card.status_code == 200
    assert card.json() == {
        **http.get("/v1/models").json()["data"][0],
        "created": card.json()["created"],
    }
    missing = http.get("/v1/models/org/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert http.get("/version").json() == {"version": version("eagleserve")}
